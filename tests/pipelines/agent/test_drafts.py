"""Speculative greedy decoding (``drafts.py``, ``decode.py``): drafts drawn from earlier turns'
n-grams are checked several tokens a forward pass, and the tokens kept are greedy decoding's own.
On a tiny Qwen2.5-VL, multi-turn episodes batched as the agent loop batches them (KV cache kept
between turns, rows stopping at different lengths) give the same tokens with drafts as without,
good drafts or bad, in fewer forward passes when the drafts are good."""

from __future__ import annotations

import pytest
import torch
from PIL import Image

from pipelines.agent.policies.base import Sampling
from pipelines.agent.policies.drafts import NgramDrafts
from pipelines.agent.policies.hf import HFPolicy
from pipelines.agent.protocol import format_observation

QUESTIONS = ["How many red objects are there?", "What colour is it?\n(A) red\n(B) blue",
             "Where is the cyan square? Answer in a few words, please."]
# The chosen tokens' log-probs from a pass over several tokens against one token a pass: float32
# rounding (other matrix shapes), as for the KV cache kept between turns (test_kv_reuse.py).
# Measured here: at most 1.1e-4, on log-probs of order 1 in these sharpened random models.
CHOSEN_ATOL = 5e-4


# -- the drafts ----------------------------------------------------------------------------------

def test_a_draft_continues_the_longest_recent_match():
    d = NgramDrafts(max_ngram=3)
    d.learn([1, 2, 3, 4, 5, 6])
    d.learn([9, 3, 4, 7, 8])
    assert d.propose([3, 4], 2) == [7, 8]  # the latest occurrence of (3, 4) wins
    assert d.propose([2, 3, 4], 3) == [5, 6]  # a longer match beats a later shorter one
    assert d.propose([0, 0, 6], 5) == []  # 6 ended a turn: nothing followed it
    assert d.propose([42], 4) == []
    assert d.propose([3, 4], 0) == []
    assert d.propose([1], 3) == [2, 3, 4]


def test_drafts_forget_old_turns_and_repeat_for_the_same_turns():
    a, b = NgramDrafts(max_ngram=2, keep_tokens=6), NgramDrafts(max_ngram=2, keep_tokens=6)
    turns = [[1, 2, 3], [4, 5, 6], [7, 8, 9], [10, 11, 12], [13, 1, 50]]
    for t in turns:
        a.learn(t)
        b.learn(t)
        assert len(a) <= 12  # bounded: past twice keep_tokens, the oldest turns go
    assert len(a) == 6  # the fifth turn passed 12 tokens: the last two turns are kept
    assert a.propose([1], 2) == [50] == b.propose([1], 2)
    assert a.propose([4], 2) == []  # forgotten
    assert a.propose([10], 2) == [11, 12]
    with pytest.raises(ValueError):
        NgramDrafts(max_ngram=0)


# -- decoding with drafts ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def policy(tiny_model_dir) -> HFPolicy:
    return _sharpened(tiny_model_dir, "cpu")


def _sharpened(tiny_model_dir, device: str) -> HFPolicy:
    pol = HFPolicy.from_pretrained(str(tiny_model_dir), device=device, dtype="float32",
                                   image_max_pixels=12544, image_factor=28)
    with torch.no_grad():  # sharper than the random init, so rows stop at different lengths
        for p in pol.model.parameters():
            p.mul_(6.0)
    pol.model.generation_config.suppress_tokens = pol.tokenizer.convert_tokens_to_ids(
        ["<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>"])
    probes = [_begin(pol, i) for i in range(3)]
    pol.generate(probes, Sampling(8, 0.0, 1.0))
    # Tokens these weights write now and then: turns end at different lengths.
    pol.eos_ids.update({h.ids[h.prompt_len + 5] for h in probes} - pol.eos_ids)
    for h in probes:
        pol.end(h)
    return pol


def _begin(policy, i: int):
    img = Image.new("RGB", (200 + 60 * i, 140), (200, 30 * i, 40))
    return policy.begin([{"role": "user", "content": [{"type": "image", "image": img},
                                                      {"type": "text", "text": QUESTIONS[i]}]}])


def _session(policy, draft_tokens: int, drafts: NgramDrafts, max_new: int = 16,
             sampling_t: float = 0.0):
    """Three greedy episodes of three turns, batched (an interpreter turn between turns, the
    KV cache kept); returns each episode's ids and log-probs, and the work counters."""
    policy.draft_tokens, policy.drafts = draft_tokens, drafts
    policy.cache_stats.clear()
    try:
        handles = [_begin(policy, i) for i in range(3)]
        for turn in range(3):
            policy.generate(handles, Sampling(max_new, sampling_t, 1.0))
            for i, h in enumerate(handles):
                parts = format_observation("ok", f"value {turn * 7 + i}\n", "", 0, 1 + turn,
                                           "feedback")
                policy.observe(h, parts, [])
        out = [(list(h.ids), list(h.logprobs)) for h in handles]
        for h in handles:
            policy.end(h)
        return out, dict(policy.cache_stats)
    finally:
        policy.draft_tokens, policy.drafts = 0, NgramDrafts()


@pytest.fixture(scope="module")
def sessions(policy):
    plain, plain_stats = _session(policy, 0, NgramDrafts())
    # Drafts that are right (what these episodes' turns will be), and mostly wrong (the same
    # tokens, each episode reversed).
    good, bad = _learnt(ids for ids, _ in plain), _learnt(ids[::-1] for ids, _ in plain)
    return plain, plain_stats, _session(policy, 8, good), _session(policy, 8, bad)


def _learnt(turns) -> NgramDrafts:
    drafts = NgramDrafts()
    for turn in turns:
        drafts.learn(turn)
    return drafts


def test_good_drafts_give_greedy_s_tokens_in_fewer_passes(sessions):
    plain, plain_stats, (spec, stats), _ = sessions
    assert [ids for ids, _ in spec] == [ids for ids, _ in plain]
    for (_, a), (_, b) in zip(plain, spec):
        assert a == pytest.approx(b, abs=CHOSEN_ATOL)
    assert sum(len(lp) for _, lp in plain) >= 60
    assert plain_stats.get("draft_tokens", 0) == 0
    assert stats["draft_kept"] >= 0.5 * stats["draft_tokens"] > 0
    assert stats["decode_steps"] <= 0.6 * plain_stats["decode_steps"]
    assert stats["reused"] == plain_stats["reused"] == 6  # the cache kept between turns holds


def test_wrong_drafts_change_nothing_but_the_work(sessions):
    plain, _, _, (spec, stats) = sessions
    assert [ids for ids, _ in spec] == [ids for ids, _ in plain]
    for (_, a), (_, b) in zip(plain, spec):
        assert a == pytest.approx(b, abs=CHOSEN_ATOL)
    assert stats["draft_tokens"] > 0 and stats["draft_kept"] < 0.5 * stats["draft_tokens"]


def test_a_turn_cut_off_at_the_limit_keeps_the_limit(policy, sessions):
    plain, _, _, _ = sessions
    good = _learnt(ids for ids, _ in plain)
    short, _ = _session(policy, 0, NgramDrafts(), max_new=5)
    spec, stats = _session(policy, 8, good, max_new=5)
    assert [ids for ids, _ in spec] == [ids for ids, _ in short]
    assert stats["draft_kept"] > 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_drafts_on_cuda_give_greedy_s_tokens_in_fewer_passes(tiny_model_dir):
    """The same promise on a GPU, whose kernels pick other algorithms for other shapes: checking
    drafts several tokens a pass keeps greedy decoding's tokens (float32, TF32 off)."""
    assert not torch.backends.cuda.matmul.allow_tf32
    pol = _sharpened(tiny_model_dir, "cuda")
    plain, plain_stats = _session(pol, 0, NgramDrafts())
    spec, stats = _session(pol, 8, _learnt(ids for ids, _ in plain))
    assert [ids for ids, _ in spec] == [ids for ids, _ in plain]
    for (_, a), (_, b) in zip(plain, spec):
        assert a == pytest.approx(b, abs=CHOSEN_ATOL)
    assert sum(len(lp) for _, lp in plain) >= 60
    assert stats["decode_steps"] <= 0.6 * plain_stats["decode_steps"]


def test_sampled_turns_ignore_the_drafts(policy, sessions):
    plain, _, _, _ = sessions
    good = _learnt(ids for ids, _ in plain)
    _, stats = _session(policy, 8, good, sampling_t=0.7)
    assert stats.get("draft_tokens", 0) == 0


@pytest.mark.parametrize("sizes", [[9, 3, 1, 6, 9, 2], [2, 1], [1, 1, 1, 4]])
def test_a_packed_pass_gives_each_real_position_the_padded_pass_s_logits(policy, sizes):
    """Only each row's token and its own draft go through the weights (``real``): at one CPU
    thread (``agent.cpu_threads``' default) the logits of those positions are the padded pass's,
    bit for bit, whatever the batch's shape (a pass with fewer than four real positions runs
    padded)."""
    from pipelines.agent.policies import decode
    from pipelines.core.device import cpu_threads

    step = decode.lean_step(policy.model)
    b, t, past = len(sizes), max(sizes), 37
    gen = torch.Generator().manual_seed(0)
    heads, dim = policy.model.config.text_config.num_key_value_heads, \
        policy.model.config.text_config.hidden_size // policy.model.config.text_config.num_attention_heads
    states = [(torch.randn(b, heads, past + 64, dim, generator=gen),
               torch.randn(b, heads, past + 64, dim, generator=gen))
              for _ in policy.model.model.language_model.layers]

    def cache():
        c = decode._growing_cache(policy.model)
        for layer, (k, v) in zip(c.layers, states):
            layer.preset(k.clone(), v.clone(), past)
        return c.layers

    span = torch.arange(t)
    real = span[None] < torch.tensor(sizes)[:, None]
    feed = torch.randint(10, 200, (b, t), generator=gen) * real
    positions = (torch.arange(past, past + t)[None, None].expand(3, b, t)).clone()
    held = torch.ones(b, past, dtype=torch.bool)
    held[1, :5] = False  # one row left-padded
    mask = torch.cat([held[:, None, None, :].expand(b, 1, t, past),
                      (span[None, :] <= span[:, None])[None, None].expand(b, 1, -1, -1)], -1)
    with torch.inference_mode(), cpu_threads(1):
        padded = step.verify(feed, positions, mask, cache())
        packed = step.verify(feed, positions, mask, cache(), real)
    assert packed.shape == (sum(sizes), padded.shape[-1])
    assert torch.equal(packed, padded[real])
    # At several threads a product's rows are split between them by its shape, so the packed
    # pass rounds differently: float rounding, as for drafts (the tokens chosen do not move).
    with torch.inference_mode(), cpu_threads(2):
        packed = step.verify(feed, positions, mask, cache(), real)
    assert torch.allclose(packed, padded[real], atol=1e-3, rtol=0)
