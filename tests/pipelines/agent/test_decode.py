"""The in-process policy's batched decoding: same tokens as transformers' generate, rows leave
the batch as they stop, and each row is reported done exactly once; on a tiny Qwen2.5-VL and a
tiny Qwen3-VL (whose 3-D positions and deepstack visual features differ)."""

from __future__ import annotations

import itertools

import pytest
import torch
from PIL import Image

from pipelines.agent.policies.base import Sampling
from pipelines.agent.policies.hf import HFPolicy
from pipelines.agent.policies.tokens import mm_token_type_ids

QUESTIONS = ["How many red objects are there?", "What colour is it?\n(A) red\n(B) blue",
             "Where is the cyan square? Answer in a few words, please."]


# model fixture, agent.image_factor, model class
ARCHS = {"qwen2_5_vl": ("tiny_model_dir", 28, "Qwen2_5_VLForConditionalGeneration"),
         "qwen3_vl": ("tiny_qwen3_dir", 32, "Qwen3VLForConditionalGeneration")}


@pytest.fixture(scope="module", params=list(ARCHS))
def policy(request) -> HFPolicy:
    fixture, factor, model_class = ARCHS[request.param]
    pol = HFPolicy.from_pretrained(str(request.getfixturevalue(fixture)), device="cpu",
                                   dtype="float32", image_max_pixels=12544, image_factor=factor)
    assert type(pol.model).__name__ == model_class
    with torch.no_grad():  # sharper than the random init, so rows stop at different lengths
        for p in pol.model.parameters():
            p.mul_(6.0)
    return pol


def _handles(policy, with_images: bool):
    out = []
    for i, q in enumerate(QUESTIONS):
        content = [{"type": "text", "text": q}]
        if with_images:  # images of different sizes: different pad runs, so left padding
            img = Image.new("RGB", (200 + 60 * i, 140), (200, 30 * i, 40))
            content = [{"type": "image", "image": img}, *content]
        out.append(policy.begin([{"role": "user", "content": content}]))
    return out


def _reference(policy, handle, max_new: int) -> list[int]:
    """transformers' generate on one row alone (no padding), cut where our policy cuts."""
    ids = torch.tensor([handle.ids])
    kwargs = {}
    if handle.pixel_values:
        kwargs = {"pixel_values": torch.cat(handle.pixel_values),
                  "image_grid_thw": torch.cat(handle.grids),
                  "mm_token_type_ids": mm_token_type_ids(ids, policy.model.config)}
    out = policy.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **kwargs,
                                max_new_tokens=max_new, do_sample=False,
                                eos_token_id=sorted(policy.eos_ids), pad_token_id=policy.pad_id)
    return policy.tokens.cut(out[0, ids.shape[1]:].tolist())[0]


@pytest.mark.parametrize("with_images", [False, True])
def test_greedy_batch_equals_generate_row_by_row(policy, with_images):
    want = [_reference(policy, h, 40) for h in _handles(policy, with_images)]
    handles = _handles(policy, with_images)
    done: list[int] = []
    gens = policy.generate(handles, Sampling(40, 0.0, 1.0), on_done=lambda i, g: done.append(i))
    assert [h.ids[h.prompt_len:] for h in handles] == want
    assert sorted(done) == [0, 1, 2]
    assert [g.n_tokens for g in gens] == [len(w) for w in want]
    assert all(len(h.logprobs) == len(w) for h, w in zip(handles, want))


def test_rows_that_stop_leave_the_batch_and_the_others_continue_unchanged(policy):
    from pipelines.agent.policies.decode import decode_batch

    long = [_reference(policy, h, 40) for h in _handles(policy, True)]
    # A stop token that ends the rows at different lengths: the first token of row 0's turn
    # that differs from everything row 2 generates, so row 2 runs on after row 0 has left.
    stop = next(t for t in long[0][3:] if t not in long[2])
    want = [w[: w.index(stop) + 1] if stop in w else w for w in long]
    assert len({len(w) for w in want}) > 1
    handles = _handles(policy, True)
    longest = max(len(h.ids) for h in handles)
    ids = torch.full((3, longest), policy.pad_id)
    attn = torch.zeros((3, longest), dtype=torch.long)
    for i, h in enumerate(handles):
        ids[i, longest - len(h.ids):] = torch.tensor(h.ids)
        attn[i, longest - len(h.ids):] = 1
    vision = {"pixel_values": torch.cat([p for h in handles for p in h.pixel_values]),
              "image_grid_thw": torch.cat([g for h in handles for g in h.grids]),
              "mm_token_type_ids": mm_token_type_ids(ids, policy.model.config)}
    order: list[int] = []
    with torch.no_grad():
        rows = decode_batch(policy.model, ids, attn, vision, max_new_tokens=40, temperature=0.0,
                            top_p=1.0, stops=lambda toks: False, eos_ids=[stop],
                            on_done=lambda i, row: order.append(i))
    assert [r.tokens for r in rows] == want
    assert order == sorted(range(3), key=lambda i: len(want[i]))  # reported as each one stops


def test_keys_only_a_finished_row_used_leave_the_batch_with_it(policy, monkeypatch):
    """When the row with the longest context stops first, the rows left attend over their own
    context only (the leading positions only it used are dropped from the cache), and their
    tokens do not change."""
    from pipelines.agent.policies import decode

    handles = _handles(policy, True)
    lengths = [len(h.ids) for h in handles]
    first = max(range(3), key=lambda i: lengths[i])
    others = [i for i in range(3) if i != first]
    assert lengths[first] > max(lengths[i] for i in others)
    long = [_reference(policy, h, 24) for h in _handles(policy, True)]
    cut = long[first][:3]
    assert all(long[i][:3] != cut for i in others)
    want = [cut if i == first else long[i] for i in range(3)]
    seen: list[tuple[int, int]] = []  # (rows, cached positions) after each write to layer 0
    layers: list = []
    make = decode._growing_layer_class

    def spying():
        class Spy(make()):  # type: ignore[misc]
            def __init__(self, *args, **kwargs):
                super().__init__(*args, **kwargs)
                layers.append(self)

            def update(self, keys, values, *args, **kwargs):
                out = super().update(keys, values, *args, **kwargs)
                if self is layers[0]:
                    seen.append((keys.shape[0], self.length))
                return out

        return Spy

    monkeypatch.setattr(decode, "_growing_layer_class", spying)
    ids, attn, vision = _batch(policy, handles)
    with torch.no_grad():
        rows = decode.decode_batch(policy.model, ids, attn, vision, max_new_tokens=24,
                                   temperature=0.0, top_p=1.0, eos_ids=sorted(policy.eos_ids),
                                   stops=lambda toks: toks == cut)
    assert [r.tokens for r in rows] == want
    drop = lengths[first] - max(lengths[i] for i in others)
    steps = list(itertools.pairwise(seen))
    assert any(a[0] == 3 and b[0] == 2 and b[1] == a[1] + 1 - drop for a, b in steps)
    assert all(b[1] == a[1] + 1 for a, b in steps if a[0] == b[0])


def test_a_seeded_sampled_batch_repeats(policy):
    runs = []
    for _ in range(2):
        torch.manual_seed(3)
        handles = _handles(policy, True)
        policy.generate(handles, Sampling(24, 1.0, 0.9))
        runs.append([(h.ids[h.prompt_len:], h.logprobs) for h in handles])
    assert runs[0] == runs[1]


def _batch(policy, handles):
    longest = max(len(h.ids) for h in handles)
    ids = torch.full((len(handles), longest), policy.pad_id)
    attn = torch.zeros((len(handles), longest), dtype=torch.long)
    for i, h in enumerate(handles):
        ids[i, longest - len(h.ids):] = torch.tensor(h.ids)
        attn[i, longest - len(h.ids):] = 1
    vision = {}
    if any(h.pixel_values for h in handles):
        vision = {"pixel_values": torch.cat([p for h in handles for p in h.pixel_values]),
                  "image_grid_thw": torch.cat([g for h in handles for g in h.grids]),
                  "mm_token_type_ids": mm_token_type_ids(ids, policy.model.config)}
    return ids, attn, vision


@pytest.mark.parametrize("temperature,top_p", [(0.0, 1.0), (1.0, 0.9), (0.7, 1.0)])
@pytest.mark.parametrize("with_images", [False, True])
def test_the_lean_decode_step_gives_the_reference_tokens_and_logprobs(policy, with_images,
                                                                     temperature, top_p):
    """The fast decode step (no transformers forward per token) is bit-identical to the model's
    own forward: same tokens, same log-probs, greedy and seeded sampling, rows of different
    lengths (left padding) leaving the batch at different steps, with and without images."""
    from pipelines.agent.policies.decode import decode_batch, lean_step

    if type(policy.model).__name__ != "Qwen2_5_VLForConditionalGeneration":
        assert lean_step(policy.model) is None  # Qwen3-VL keeps the model's own forward
        return
    assert lean_step(policy.model) is not None  # the stock tiny model takes the fast path
    handles = _handles(policy, with_images)
    ids, attn, vision = _batch(policy, handles)
    assert len({len(h.ids) for h in handles}) > 1

    def run(lean: bool, eos: list[int]):
        torch.manual_seed(11)
        with torch.no_grad():
            rows = decode_batch(policy.model, ids, attn, vision, max_new_tokens=48,
                                temperature=temperature, top_p=top_p,
                                stops=policy.tokens.ends_turn, eos_ids=eos, lean=lean,
                                code_temperature=0.3 if temperature else None,
                                opens_code=policy.tokens.opens_code)
        return [(r.tokens, r.logprobs, r.temperatures) for r in rows]

    # A stop token that row 0 samples early and the other rows later or never, so that rows
    # leave the batch (cache and all) at different steps.
    free = [toks for toks, _, _ in run(True, sorted(policy.eos_ids))]
    stop = next(t for t in free[0][2:] if any(free[0].index(t) < (toks + [t]).index(t)
                                              for toks in free[1:]))
    eos = sorted(policy.eos_ids | {stop})
    runs = [run(False, eos), run(True, eos)]
    assert runs[0] == runs[1]
    assert len({len(toks) for toks, _, _ in runs[0]}) > 1  # the rows did stop at different steps


def test_the_lean_prefill_leaves_the_models_logits_and_states_bit_for_bit(policy):
    """A prefill through the lean step (no ``model(...)``) gives the logits and KV states the
    model's own forward gives, bit for bit: a left-padded text batch from nothing, then a batch
    with images of different sizes over those states."""
    from pipelines.agent.policies import decode

    step = decode.lean_step(policy.model)
    if step is None:  # Qwen3-VL keeps the model's own forward
        assert type(policy.model).__name__ != "Qwen2_5_VLForConditionalGeneration"
        return
    ids1, attn1, _ = _batch(policy, _handles(policy, False))
    ids2, attn2, vision = _batch(policy, _handles(policy, True))
    pos1 = decode.initial_positions(policy.model, ids1, attn1, {})
    pos2 = decode.initial_positions(policy.model, ids2, attn2, vision) + int(pos1.max()) + 1

    def run(lean):
        cache = decode._growing_cache(policy.model)
        with torch.no_grad(), decode._use_decode_attention(policy.model):
            first = decode._prefill(policy.model, lean, ids1, attn1, pos1, cache, {})
            second = decode._prefill(policy.model, lean, ids2, torch.cat([attn1, attn2], dim=1),
                                     pos2, cache, vision)
        states = [t[:, :, : layer.length] for layer in cache.layers
                  for t in (layer.keys, layer.values)]
        return [first, second, *states]

    lean, reference = run(step), run(None)
    assert lean[2].shape[2] == ids1.shape[1] + ids2.shape[1]
    assert all(torch.equal(a, b) for a, b in zip(lean, reference, strict=True))


def test_a_model_with_a_forward_hook_takes_the_reference_path(policy):
    from pipelines.agent.policies.decode import lean_step

    stock = type(policy.model).__name__ == "Qwen2_5_VLForConditionalGeneration"
    handle = policy.model.model.language_model.layers[0].register_forward_hook(lambda *a: None)
    try:
        assert lean_step(policy.model) is None
    finally:
        handle.remove()
    assert (lean_step(policy.model) is not None) == stock  # Qwen3-VL never takes the lean step


def test_processor_kwarg_checks_are_remembered_and_bad_ones_still_raise(policy):
    from transformers import processing_utils

    from pipelines.agent.policies import tokens

    assert getattr(processing_utils.validate_typed_dict, "remembers", False)
    side = 2 * policy.tokens.factor  # an image already at its context size
    img = Image.new("RGB", (side, side))
    policy.tokens.encode("<|vision_start|><|image_pad|><|vision_end|>hi", [img])
    seen = len(tokens._CHECKED)
    policy.tokens.encode("<|vision_start|><|image_pad|><|vision_end|>hi again", [img])
    assert len(tokens._CHECKED) == seen  # the same arguments: nothing new to check
    with pytest.raises(Exception, match="min_pixels"):
        policy.processor(text=["x"], images=[img], min_pixels="many", return_tensors="pt")


def test_generation_runs_at_the_policys_cpu_threads_with_the_same_tokens(policy, monkeypatch):
    """``agent.cpu_threads``: torch runs the turn at the policy's thread count (seen from inside
    the batch, as each row finishes), and so does the processor encoding a prompt; it is back at
    its own count afterwards, also when generation raises, and the tokens are those made at
    torch's own count."""
    from pipelines.agent.policies.drafts import NgramDrafts

    encoding: list[int] = []
    real_begin = policy.tokens.begin

    def begin(messages):
        encoding.append(torch.get_num_threads())
        return real_begin(messages)

    monkeypatch.setattr(policy.tokens, "begin", begin)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    runs = {}
    try:
        for threads in (0, 1):
            policy.threads, policy.drafts = threads, NgramDrafts()
            seen: list[int] = []
            encoding.clear()
            handles = _handles(policy, True)
            policy.generate(handles, Sampling(24, 0.0, 1.0),
                            on_done=lambda i, g, seen=seen: seen.append(torch.get_num_threads()))
            runs[threads] = [h.ids for h in handles]
            assert seen == encoding == [2 if threads == 0 else 1] * len(QUESTIONS)
            assert torch.get_num_threads() == 2
        assert runs[1] == runs[0]

        def fail(i, g):
            raise RuntimeError("a callback that fails")

        policy.threads = 1
        with pytest.raises(RuntimeError, match="fails"):
            policy.generate(_handles(policy, False), Sampling(8, 0.0, 1.0), on_done=fail)
        assert torch.get_num_threads() == 2
    finally:
        policy.threads = 0
        torch.set_num_threads(before)
