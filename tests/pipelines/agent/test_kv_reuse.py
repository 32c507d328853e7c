"""The in-process policy keeps each episode's KV cache between turns (``hf.py``, ``decode.py``):
a turn then runs only its new tokens (the closing of the last turn, the interpreter's text and
images, the next turn's opening) through the model. Checked on a tiny Qwen2.5-VL and a tiny
Qwen3-VL against the same policy prefilling every turn's whole context: the next-token
distributions agree to float32 rounding, greedy trajectories are token for token the same, a
context that no longer starts with the cached tokens (or weights that changed) is prefilled
whole, and an episode's cache goes when the episode ends."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from PIL import Image

from pipelines.agent.policies import decode
from pipelines.agent.policies.base import Sampling
from pipelines.agent.policies.hf import HFPolicy
from pipelines.agent.protocol import format_observation

ARCHS = {"qwen2_5_vl": ("tiny_model_dir", 28), "qwen3_vl": ("tiny_qwen3_dir", 32)}

QUESTIONS = ["How many red objects are there?", "What colour is it?\n(A) red\n(B) blue",
             "Where is the cyan square? Answer in a few words, please."]

# float32 next-token log-probs of a cached continuation against a whole-context prefill differ
# by rounding only (the same arithmetic in another order: attention over a padded cache, other
# matmul shapes). Measured here: at most 2.3e-4 over the whole vocabulary (whose unlikely tokens
# have log-probs down to -47 in these sharpened random models, so logits are large) and 3e-5 for
# the tokens chosen; positions off by one, or the new images blanked, moved them by 6 to 25 (tried).
VOCAB_ATOL = 1e-3
CHOSEN_ATOL = 1e-4


@pytest.fixture(scope="module", params=list(ARCHS))
def policy(request) -> HFPolicy:
    fixture, factor = ARCHS[request.param]
    return _sharpened(HFPolicy.from_pretrained(
        str(request.getfixturevalue(fixture)), device="cpu", dtype="float32",
        image_max_pixels=12544, image_factor=factor))


def _sharpened(pol: HFPolicy) -> HFPolicy:
    with torch.no_grad():  # sharper than the random init, so rows stop at different lengths
        for p in pol.model.parameters():
            p.mul_(6.0)
    # A random model writes image pads too, which no image backs; a trained one does not.
    pol.model.generation_config.suppress_tokens = pol.tokenizer.convert_tokens_to_ids(
        ["<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>"])
    return pol


def _begin(policy, i: int):
    img = Image.new("RGB", (200 + 60 * i, 140), (200, 30 * i, 40))
    return policy.begin([{"role": "user", "content": [{"type": "image", "image": img},
                                                      {"type": "text", "text": QUESTIONS[i]}]}])


def _observe(policy, handle, turn: int, i: int) -> None:
    """An interpreter turn: printed text and, on every other turn, one or two figures (of
    sizes that differ per row, so image pad runs and cached lengths differ)."""
    side = policy.tokens.factor
    n = (turn + i) % 3
    images = [Image.new("RGB", (side * (2 + i + k), side * 3), (20 * k, 90, 30 * turn))
              for k in range(n)]
    parts = format_observation("ok", f"value {turn * 7 + i}\n", "", n, 1 + turn, "feedback")
    policy.observe(handle, parts, images)


def _record_steps(policy) -> list[torch.Tensor]:
    """Record the full next-token log-probs of every decode step (until the caller empties
    ``policy.logits_processors``) into the list returned."""
    steps: list[torch.Tensor] = []

    def record(context, scores):
        steps.append(torch.log_softmax(scores, dim=-1))
        return scores

    policy.logits_processors = [record]
    return steps


def _session(policy, reuse: bool, stops: set[int], turns: int = 3, max_new: int = 16):
    """Greedy multi-turn episodes, batched as the agent loop batches them: three episodes, a
    fourth joining at the second turn (a row without a cache beside rows with one), the first
    one leaving after the second turn; ``stops`` end a turn as an eos token does, so turns end
    at different lengths (their last token not yet run through the model) or at ``max_new``
    (all of them run). Returns each handle's context and log-probs, the full next-token
    log-probs of every decode step, the turns' lengths and the policy's cache counters."""
    policy.reuse_cache = reuse
    policy.cache_stats.clear()
    policy.eos_ids.update(stops)
    lengths: list[int] = []
    try:
        steps = _record_steps(policy)
        handles = [_begin(policy, i) for i in range(3)]
        active = list(handles)
        for turn in range(turns):
            if turn == 1:
                late = _begin(policy, 2)
                handles.append(late)
                active.append(late)
            lengths += [g.n_tokens for g in policy.generate(active, Sampling(max_new, 0.0, 1.0))]
            if turn == 1:
                policy.end(active.pop(0))
            for i, h in enumerate(active):
                _observe(policy, h, turn, i)
        stats = dict(policy.cache_stats)
        for h in active:
            policy.end(h)
    finally:
        policy.logits_processors = []
        policy.reuse_cache = True
        policy.eos_ids.difference_update(stops)
    return [(h.ids, h.logprobs) for h in handles], steps, lengths, stats


@pytest.fixture(scope="module")
def sessions(policy):
    probes = [_begin(policy, i) for i in range(3)]
    policy.generate(probes, Sampling(8, 0.0, 1.0))
    # Tokens these weights write now and then (not the eos tokens themselves).
    stops = {h.ids[h.prompt_len + 5] for h in probes} - policy.eos_ids
    for h in probes:
        policy.end(h)
    full = _session(policy, False, stops)
    apart = decode._prefill_apart
    split: list[tuple[list[list[int]], list[int]]] = []

    def spy(model, step, groups, *args):
        split.append((groups, list(args[-2])))  # the groups and each row's new images
        return apart(model, step, groups, *args)

    decode._prefill_apart = spy
    try:
        cached = _session(policy, True, stops)
    finally:
        decode._prefill_apart = apart
    return full, cached, split


def test_cached_turns_give_the_same_next_token_distributions(sessions):
    (_, full_steps, _, full_stats), (_, cached_steps, lengths, stats), _ = sessions
    assert 16 in lengths and min(lengths) < 16  # turns cut at the limit and stopped early
    assert full_stats.get("reused", 0) == 0
    # Turn 2: three rows continue their cache, the new one is prefilled; turn 3: three rows.
    assert stats["reused"] == 6 and stats["prefilled"] == 4
    assert stats["tokens_prefilled"] < 0.6 * full_stats["tokens_prefilled"]
    assert len(cached_steps) == len(full_steps) > 0
    for a, b in zip(full_steps, cached_steps):
        finite = a.isfinite()  # suppressed tokens are -inf on both sides
        assert torch.equal(finite, b.isfinite())
        assert float((a[finite] - b[finite]).abs().max()) <= VOCAB_ATOL


def test_greedy_multi_turn_trajectories_are_the_same_token_for_token(sessions):
    (full, _, _, _), (cached, _, _, _), _ = sessions
    assert [ids for ids, _ in cached] == [ids for ids, _ in full]
    generated = sum(len(lp) for _, lp in full)
    assert generated >= 100  # 4 episodes, 9 turns cached or not
    for (_, a), (_, b) in zip(full, cached):
        assert a == pytest.approx(b, abs=CHOSEN_ATOL)


def test_new_rows_are_prefilled_apart_from_rows_that_continue_their_cache(sessions):
    """Turn 2 mixes three rows that continue their cache (two with new figures) with a new
    episode (its prompt image): each group is prefilled on its own, and the comparisons above
    (against whole-context prefills) hold for it."""
    _, _, split = sessions
    assert len(split) == 1  # turn 1 has no cache yet, turn 3 no new row
    groups, images = split[0]
    assert groups == [[0, 1, 2], [3]]
    assert images[3] == 1 and sum(images[:3]) >= 1


def test_positions_of_new_tokens_are_those_of_the_whole_context(policy, monkeypatch):
    """A turn computes (m)RoPE positions for its new tokens only, moved on by where the cached
    prefix ended: they must equal the whole context's, images among the new tokens included."""
    from pipelines.agent.policies.tokens import mm_token_type_ids

    seen = []
    real = decode.decode_batch

    def spy(model, ids, attn, vision, **kw):
        seen.append((attn.clone(), kw["positions"].clone()))
        return real(model, ids, attn, vision, **kw)

    monkeypatch.setattr(decode, "decode_batch", spy)
    handles = [_begin(policy, i) for i in range(3)]
    try:
        for turn in range(3):
            contexts = [(list(h.ids), list(h.grids)) for h in handles]
            policy.generate(handles, Sampling(6, 0.0, 1.0))
            longest = max(len(ids) for ids, _ in contexts)
            ids = torch.zeros((3, longest), dtype=torch.long)
            attn = torch.zeros((3, longest), dtype=torch.long)
            for i, (row, _) in enumerate(contexts):
                ids[i, longest - len(row):] = torch.tensor(row)
                attn[i, longest - len(row):] = 1
            ref = decode.initial_positions(policy.model, ids, attn, {
                "image_grid_thw": torch.cat([g for _, gs in contexts for g in gs]),
                "mm_token_type_ids": mm_token_type_ids(ids, policy.model.config)})
            new_attn, got = seen[-1]
            width = new_attn.shape[1]
            keep = new_attn.bool()[None].expand(3, -1, -1)
            assert torch.equal(got[keep], ref[:, :, longest - width:][keep])
            for i, h in enumerate(handles):
                _observe(policy, h, turn, i)
        assert policy.cache_stats["reused"] >= 6
    finally:
        for h in handles:
            policy.end(h)


def test_a_context_that_no_longer_starts_with_the_cached_tokens_is_prefilled_whole(policy):
    def two_turns(reuse: bool, edit: bool):
        policy.reuse_cache = reuse
        policy.cache_stats.clear()
        try:
            h = _begin(policy, 1)
            policy.generate([h], Sampling(8, 0.0, 1.0))
            _observe(policy, h, 0, 1)
            if edit:  # an earlier token changed: the cached states are of another context
                h.ids[h.prompt_len] = policy.tokenizer.convert_tokens_to_ids("a")
            assert (h.kv is not None) == reuse
            policy.generate([h], Sampling(8, 0.0, 1.0))
            return h.ids, dict(policy.cache_stats)
        finally:
            policy.reuse_cache = True

    want, _ = two_turns(False, edit=True)
    got, stats = two_turns(True, edit=True)
    assert got == want
    assert stats["fallbacks"] == 1 and stats.get("reused", 0) == 0
    _, stats = two_turns(True, edit=False)
    assert stats["reused"] == 1 and stats.get("fallbacks", 0) == 0


def test_states_computed_under_other_weights_are_not_reused(policy):
    h = _begin(policy, 0)
    policy.generate([h], Sampling(8, 0.0, 1.0))
    _observe(policy, h, 0, 0)
    policy.cache_stats.clear()
    weight = next(policy.model.parameters())
    with torch.no_grad():
        weight.add_(0.0)  # an in-place update, as an optimizer step makes
    policy.generate([h], Sampling(8, 0.0, 1.0))
    assert policy.cache_stats["fallbacks"] == 1 and policy.cache_stats["reused"] == 0
    policy.end(h)


def test_an_episode_s_cache_is_released_when_it_ends(policy):
    h = _begin(policy, 0)
    policy.generate([h], Sampling(8, 0.0, 1.0))
    assert h.kv is not None and len(h.kv.ids) >= len(h.ids) - 1
    keys = weakref.ref(h.kv.layers[0][0])
    policy.end(h)
    gc.collect()
    assert h.kv is None and keys() is None


def test_generation_keeps_no_autograd_state(policy):
    """Turns are generated in inference mode: the states kept between turns carry no autograd
    bookkeeping, and the weights the trainer updates are left as they were."""
    versions = [p._version for p in policy.model.parameters()]
    h = _begin(policy, 0)
    policy.generate([h], Sampling(8, 0.0, 1.0))
    assert h.kv is not None and all(k.is_inference() and v.is_inference() for k, v in h.kv.layers)
    assert not any(p.is_inference() for p in policy.model.parameters())
    assert [p._version for p in policy.model.parameters()] == versions
    policy.end(h)


def test_reuse_off_keeps_no_cache(policy):
    policy.reuse_cache = False
    try:
        h = _begin(policy, 0)
        policy.generate([h], Sampling(8, 0.0, 1.0))
        assert h.kv is None
    finally:
        policy.reuse_cache = True


def test_closing_the_holes_right_aligns_each_row_s_states_in_order():
    """After a prefill over cached states a row is [padding, cached, padding, new]; closed, it
    is [padding, cached, new], as long as the longest row, the states in their order."""
    from pipelines.agent.policies.decode import _close_holes, _growing_layer_class

    attn = torch.tensor([[0, 1, 1, 0, 1], [1, 1, 1, 1, 1], [0, 0, 0, 1, 1]])
    keys = (torch.arange(5.0) + 10 * torch.arange(3.0)[:, None])[:, None, :, None]  # [3, 1, 5, 1]
    layer = _growing_layer_class()()
    layer.preset(keys.clone(), -keys.clone(), 5)
    assert torch.equal(_close_holes([layer], attn), attn)  # nothing to close: unchanged
    attn = attn[[0, 2]]
    layer.preset(keys[[0, 2]].clone(), -keys[[0, 2]].clone(), 5)
    closed = _close_holes([layer], attn)
    assert closed.tolist() == [[1, 1, 1], [0, 1, 1]]
    assert layer.length == 3
    assert layer.keys[0, 0, :3, 0].tolist() == [1.0, 2.0, 4.0]
    assert layer.keys[1, 0, 1:3, 0].tolist() == [23.0, 24.0]
    assert layer.values[0, 0, :3, 0].tolist() == [-1.0, -2.0, -4.0]


# -- prompt heads shared between episodes -------------------------------------------------------

# A family's instructions, the same for every task: the shared head of its prompts.
INSTRUCTIONS = ("Sample the frames you need with Python, show them with plt.show() and print "
                "values with print(); the results come back inside <interpreter>. Write code as "
                "<code> ... </code> and finish with <answer> \\boxed{your answer} </answer>.")


def _begin_text(policy, i: int, image: bool = False):
    """A prompt whose instructions come before the task's own words (and its image, if any),
    as the video family's do: every such prompt starts with the same long head."""
    content = [{"type": "text", "text": f"{INSTRUCTIONS}\n{QUESTIONS[i % 3]} ({i})"}]
    if image:
        content.append({"type": "image", "image": Image.new("RGB", (140, 84), (40 * i, 90, 30))})
    return policy.begin([{"role": "user", "content": content}])


def _greedy_rows(policy, share: bool, image: bool, max_new: int = 12):
    """Three episodes' first turns together, then two more joining the second turn (the head is
    kept by then); returns their contexts, the next-token log-probs of every step, the stats."""
    policy.share_prefixes = share
    policy._heads.clear()
    policy.cache_stats.clear()
    try:
        steps = _record_steps(policy)
        first = [_begin_text(policy, i, image) for i in range(3)]
        policy.generate(first, Sampling(max_new, 0.0, 1.0))
        for i, h in enumerate(first):
            _observe(policy, h, 0, i)
        later = [_begin_text(policy, i, image) for i in range(3, 5)]
        policy.generate(first + later, Sampling(max_new, 0.0, 1.0))
        stats = dict(policy.cache_stats)
        contexts = [list(h.ids) for h in first + later]
        for h in first + later:
            policy.end(h)
    finally:
        policy.logits_processors = []
        policy.share_prefixes = True
    return contexts, steps, stats


@pytest.mark.parametrize("image", [False, True], ids=["text", "image-after-text"])
def test_episodes_share_their_prompts_head_with_the_same_next_token_distributions(policy, image):
    from pipelines.agent.policies.hf import MIN_SHARED

    plain_ctx, plain_steps, plain = _greedy_rows(policy, False, image)
    ctx, steps, stats = _greedy_rows(policy, True, image)
    assert plain.get("shared", 0) == 0 and plain.get("heads_computed", 0) == 0
    # One head, computed with the first row, continued by all five new episodes.
    assert stats["heads_computed"] == 1 and stats["shared"] == 5
    assert stats["tokens_shared"] >= 5 * MIN_SHARED
    assert stats["tokens_prefilled"] + stats["tokens_shared"] == plain["tokens_prefilled"]
    assert stats["reused"] == plain["reused"] == 3  # the second turns continue their own states
    assert ctx == plain_ctx  # greedy: token for token
    assert len(steps) == len(plain_steps) > 0
    for a, b in zip(plain_steps, steps):
        finite = a.isfinite()
        assert torch.equal(finite, b.isfinite())
        assert float((a[finite] - b[finite]).abs().max()) <= VOCAB_ATOL


def test_a_head_stops_before_the_first_image_and_a_short_one_is_not_shared(policy):
    """Tasks' images differ, so nothing after the first one is shared; prompts that open with
    their image (a chat template's few tokens before it) share nothing."""
    h = _begin_text(policy, 0, image=True)
    policy._heads.clear()
    policy.cache_stats.clear()
    policy.generate([h], Sampling(4, 0.0, 1.0))
    (head,) = policy._heads
    start = policy.model.config.vision_start_token_id
    assert len(head) == h.ids.index(start) and policy.image_token_id not in head
    policy.end(h)
    policy._heads.clear()
    policy.cache_stats.clear()
    short = [_begin(policy, i) for i in range(2)]  # the image first
    policy.generate(short, Sampling(4, 0.0, 1.0))
    assert not policy._heads and policy.cache_stats.get("shared", 0) == 0
    for s in short:
        policy.end(s)


def test_heads_are_dropped_when_the_weights_change_and_bounded_in_number(policy):
    from pipelines.agent.policies.hf import MAX_SHARED

    policy._heads.clear()
    policy.cache_stats.clear()
    h = _begin_text(policy, 0)
    policy.generate([h], Sampling(4, 0.0, 1.0))
    policy.end(h)
    with torch.no_grad():
        next(policy.model.parameters()).add_(0.0)  # an optimizer step's in-place update
    h = _begin_text(policy, 1)
    policy.generate([h], Sampling(4, 0.0, 1.0))
    policy.end(h)
    assert policy.cache_stats["heads_computed"] == 2 and len(policy._heads) == 1
    # Prompts that share nothing each keep a head; only the most recent MAX_SHARED stay.
    for k in range(MAX_SHARED + 2):
        h = policy.begin([{"role": "user", "content": [
            {"type": "text", "text": f"{k} " * 3 + INSTRUCTIONS}]}])
        policy.generate([h], Sampling(2, 0.0, 1.0))
        policy.end(h)
    assert len(policy._heads) == MAX_SHARED


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_shared_heads_on_cuda_keep_greedy_s_tokens(tiny_model_dir):
    """The same promise on a GPU, whose kernels pick algorithms by shape (a head is prefilled
    as one row, then continued in a batch): greedy tokens unchanged, float32 without TF32."""
    assert not torch.backends.cuda.matmul.allow_tf32
    pol = _sharpened(HFPolicy.from_pretrained(str(tiny_model_dir), device="cuda",
                                              dtype="float32", image_max_pixels=12544))
    plain_ctx, plain_steps, _ = _greedy_rows(pol, False, image=True)
    ctx, steps, stats = _greedy_rows(pol, True, image=True)
    assert stats["heads_computed"] == 1 and stats["shared"] == 5
    assert ctx == plain_ctx
    for a, b in zip(plain_steps, steps):
        finite = a.isfinite()
        assert float((a[finite] - b[finite]).abs().max()) <= VOCAB_ATOL
