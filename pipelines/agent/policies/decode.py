"""Batched decoding for the in-process policy: rows leave the batch as soon as they stop.

``transformers``' ``generate`` keeps computing every row until the last one stops, so a batch of
agent turns (most end at ``</code>`` after a few dozen tokens, one runs to the limit) costs the
longest turn times the batch: measured on the tiny SFT model at batch 16, 2.35 row-steps were
computed per token kept. Here a finished row is dropped from the batch, its KV cache included,
and the forward pass shrinks with it; when it had the longest context, the leading positions
that only it used go too (on the demo's evaluation this cut the keys a decode step attends over
by a fifth, 639 to 508 a row).

Two changes make a decode step cheap on a CPU, where a small model's step is memory traffic, not
arithmetic: the KV cache grows in place (capacity doubles when full) instead of being concatenated
every step, and single-token queries attend with grouped KV heads without first copying each K/V
head once per query head (``transformers``' sdpa path repeats them whenever there is a mask).
``transformers``' own continuous batching would do more, but it is text-only.

A decode step of a stock Qwen2.5-VL does not go through ``model(...)`` at all (:class:`_LeanStep`):
the same ops on the same weights, without the per-call mask construction, output capture and
per-layer rotary work, so logits are bit-identical. Its prefill (:meth:`_LeanStep.prefill`) runs
the model's own vision tower, mask and sdpa attention without the per-layer wrappers, also bit
for bit; on the demo's SFT model it made evaluation 10% faster (64 image tasks, batch 16).

Everything else is what ``generate`` does: a prefill that runs the vision tower once, then one
token per step from the KV cache, the 3-D (mRoPE) positions of Qwen2.5-VL and Qwen3-VL for image
tokens (computed once by the model's own ``get_rope_index``; text positions then advance by one
per token),
temperature / top-p sampling from the global torch RNG (so a seeded run repeats), suppressed
tokens, optional logits processors. The log-prob recorded for each token is that of the
distribution it was sampled from before any processor or top-p cut (``softmax(logits / T)``,
or ``T = 1`` when greedy): what the trainer recomputes.

An agent turn's context is the last turn's context plus a few dozen new tokens (the closing of
the last turn, the interpreter's text and images, the next turn's opening), so the policy
(``hf.py``) keeps each episode's KV states between its turns (``keep_cache``: a row's states are
copied out, padding dropped, when it stops) and the next turn prefills only the new tokens over
them (``past``, built by :func:`pad_past`; ``positions`` are those of the whole context, from
``get_rope_index``, and only the new images' pixels go in). The prefill then leaves two runs of
padding in a row, before its cached states and before its new tokens; :func:`_close_holes`
gathers each row's states right-aligned again, so decode steps attend over no more keys than
without a cache. The logits differ from a whole-context prefill by float32 rounding only
(``tests/pipelines/agent/test_kv_reuse.py``). On the demo's SFT model (64 held-out image tasks,
batch 16, 256 tokens a turn) this prefills 19k tokens instead of 56k. A batch that mixes
continuing rows with new episodes (whose whole prompt is new) prefills the two groups apart
(:func:`_prefill_apart`), so neither is padded to the other's width: on that evaluation the
prefills ran through 26k token positions instead of 38k (20k of them real tokens) and took
2.8 s instead of 4.3 s (cProfile), with the same greedy trajectories.

Greedy turns can check several tokens a forward pass (``drafts``, ``draft_tokens``: model-free
speculative decoding). Each live row's next token goes through the model with a draft after it,
what followed the row's last tokens in an earlier turn (:class:`~pipelines.agent.policies.drafts.
NgramDrafts`); the row keeps the draft's longest prefix that greedy decoding picks at each
position, plus the token picked after it (the next step's first). Rejected positions stay in the
cache, masked (closed by :func:`_close_holes` once there are more than ``_HOLES`` of them), and a
row that stops inside its draft keeps what it would have kept without one. The logits of a pass
over several tokens differ from single steps by float rounding, so the tokens are greedy's
except where rounding flips a near-tie (on the demo's held-out sets: none; docs/tiny-recipe.md).
Rows' drafts differ in length, so the pass is padded to the longest; only the real positions go
through the weights (packed, :meth:`_LeanStep.verify`), the attention alone sees the padding. On
the demo's evaluation (64 image tasks) 17.9k of 20.1k positions.

A second temperature can apply inside code (``code_temperature``, Thyme's idea): a row samples at
``code_temperature`` from the token after its turn has opened a ``<code>`` block (``opens_code``
says so) until the turn ends, and at ``temperature`` before. Each token's temperature is
recorded (``Row.temperatures``) so that the trainer recomputes every log-prob under the
distribution that token was sampled from.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from pipelines.agent.policies.drafts import NgramDrafts


@dataclass
class Row:
    """What one row generated, and whether it has stopped."""

    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    temperatures: list[float] = field(default_factory=list)  # what each token was sampled at
    done: bool = False
    in_code: bool = False
    # With ``keep_cache``: the row's KV states (per layer ``(keys, values)``, ``[heads, n, dim]``)
    # over every token run through the model, its context and the first ``fed`` tokens it
    # generated (not the last: a token is fed at the step after it is sampled).
    cache: list[tuple[Any, Any]] | None = None
    fed: int = 0


@dataclass
class Past:
    """KV states already computed for the rows of a batch: per layer ``(keys, values)`` of
    ``[B, heads, capacity, dim]``, of which the first ``length`` positions are filled, rows
    left-padded, and ``mask`` ``[B, length]`` (1 where a row has a real entry)."""

    layers: list[tuple[Any, Any]]
    length: int
    mask: Any


def pad_past(rows: Sequence[list[tuple[Any, Any]] | None], room: int) -> Past | None:
    """One :class:`Past` from the cached states of each row (:attr:`Row.cache`, or None for a
    row that starts from nothing), left-padded to the longest, with ``room`` free positions
    after it (the next prefill and some decode steps write there without reallocating)."""
    import torch

    lengths = [0 if r is None else r[0][0].shape[1] for r in rows]
    longest = max(lengths)
    if longest == 0:
        return None
    ref = next(r for r in rows if r is not None)
    mask = torch.zeros((len(rows), longest), dtype=torch.long, device=ref[0][0].device)
    layers = []
    for li, (k0, v0) in enumerate(ref):
        heads, _, kd = k0.shape
        # Only the padding needs a value (zero: masked, it must still be finite); the room
        # after ``longest`` is written before anything reads it.
        keys = k0.new_empty((len(rows), heads, longest + room, kd))
        values = v0.new_empty((len(rows), v0.shape[0], longest + room, v0.shape[-1]))
        for i, r in enumerate(rows):
            keys[i, :, : longest - lengths[i]] = 0
            values[i, :, : longest - lengths[i]] = 0
            if r is not None and lengths[i]:
                keys[i, :, longest - lengths[i]: longest] = r[li][0]
                values[i, :, longest - lengths[i]: longest] = r[li][1]
        layers.append((keys, values))
    for i, n in enumerate(lengths):
        if n:
            mask[i, longest - n:] = 1
    return Past(layers, longest, mask)


def _growing_layer_class() -> type:
    from transformers.cache_utils import DynamicLayer

    class GrowingLayer(DynamicLayer):
        """A dynamic cache layer whose buffers grow by doubling; ``update`` writes in place and
        returns views of the filled part."""

        length = 0

        def lazy_initialization(self, key_states: Any, value_states: Any) -> None:
            super().lazy_initialization(key_states, value_states)
            self.length = 0

        def update(self, key_states: Any, value_states: Any, *args: Any, **kwargs: Any):
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            n = key_states.shape[-2]
            if self.keys.numel() == 0 or self.length + n > self.keys.shape[-2]:
                cap = max(2 * (self.length + n), 64)
                b, h, _, d = key_states.shape
                keys = key_states.new_empty((b, h, cap, d))
                values = value_states.new_empty((b, h, cap, value_states.shape[-1]))
                if self.length:
                    keys[:, :, : self.length] = self.keys[:, :, : self.length]
                    values[:, :, : self.length] = self.values[:, :, : self.length]
                self.keys, self.values = keys, values
            self.keys[:, :, self.length: self.length + n] = key_states
            self.values[:, :, self.length: self.length + n] = value_states
            self.length += n
            return self.keys[:, :, : self.length], self.values[:, :, : self.length]

        def get_seq_length(self) -> int:
            return self.length if self.is_initialized else 0

        def preset(self, keys: Any, values: Any, length: int) -> None:
            """Start from buffers whose first ``length`` positions already hold states."""
            self.lazy_initialization(keys, values)
            self.keys, self.values, self.length = keys, values, length

        def row(self, j: int, mask: Any) -> tuple[Any, Any]:
            """Row ``j``'s states at the positions ``mask`` (``[length]``, bool) marks: a copy."""
            return (self.keys[j, :, : self.length][:, mask],
                    self.values[j, :, : self.length][:, mask])

        def keep_rows(self, keep: list[int], lead: int = 0) -> None:
            """Keep the rows ``keep`` (ascending) and drop the first ``lead`` positions
            (padding in every row kept), in place: each kept row after the first one dropped
            moves down (its filled positions only) and the buffers become views of their
            first rows. Rows keep their order, so a sampled batch draws the same numbers."""
            if self.get_seq_length() == 0:
                return
            for i, j in enumerate(keep):
                if i != j:
                    self.keys[i, :, lead: self.length] = self.keys[j, :, lead: self.length]
                    self.values[i, :, lead: self.length] = self.values[j, :, lead: self.length]
            n = len(keep)
            self.keys, self.values = self.keys[:n, :, lead:], self.values[:n, :, lead:]
            self.length -= lead

    return GrowingLayer


def _growing_cache(model: Any) -> Any:
    """An empty KV cache for ``model`` whose layers grow in place."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config.get_text_config())
    cache.layers = [_growing_layer_class()() for _ in cache.layers]
    return cache


def _decode_attention(module: Any, query: Any, key: Any, value: Any, attention_mask: Any,
                      scaling: float | None = None, **kwargs: Any) -> tuple[Any, None]:
    """Attention for decode steps (one query token) with grouped KV heads, no K/V copies; longer
    queries (the prefill) go to the sdpa path unchanged."""
    import torch
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if query.shape[2] != 1:
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling,
                                      **kwargs)
    b, heads, _, d = query.shape
    kv_heads = key.shape[1]
    q = query.reshape(b, kv_heads, heads // kv_heads, d)
    scores = torch.matmul(q, key.transpose(-1, -2)) * (scaling if scaling is not None else d ** -0.5)
    if attention_mask is not None:  # [b, 1, 1, L] additive or boolean
        mask = attention_mask[:, :, :, : key.shape[-2]]
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool \
            else scores + mask
    probs = torch.softmax(scores.float(), dim=-1).to(value.dtype)
    out = torch.matmul(probs, value)  # [b, kv_heads, groups, d]
    return out.reshape(b, heads, 1, d).transpose(1, 2), None


def _draft_attention(module: Any, query: Any, key: Any, value: Any, bias: Any,
                     scaling: float | None = None, **kwargs: Any) -> tuple[Any, None]:
    """:func:`_decode_attention` for ``T`` queries a row (a token and its draft): grouped KV
    heads without copies; ``bias`` is :func:`_mask_bias` of the pass's mask (one pass's layers
    share it). The scores are scaled and masked in place: the same values as new tensors would
    hold, without allocating them."""
    import torch

    b, heads, t, d = query.shape
    kv_heads = key.shape[1]
    groups = heads // kv_heads
    q = query.reshape(b, kv_heads, groups * t, d)
    scores = torch.matmul(q, key.transpose(-1, -2)).mul_(
        scaling if scaling is not None else d ** -0.5)
    scores = scores.view(b, kv_heads, groups, t, -1).add_(bias)
    probs = torch.softmax(scores.float(), dim=-1).to(value.dtype).view(b, kv_heads, groups * t, -1)
    out = torch.matmul(probs, value)  # [b, kv_heads, groups * t, d]
    return out.view(b, heads, t, d).transpose(1, 2), None


def _mask_bias(mask: Any, dtype: Any) -> Any:
    """``mask`` (``[b, 1, T, L]`` boolean) as a term to add to the scores (``[b, 1, 1, T, L]``,
    0 where a query sees a key, -inf elsewhere). Adding it gives exactly what masking the
    scores gives (``x + 0 == x``), in a sixth of the time on the demo's shapes: a broadcast
    ``masked_fill_`` took 104 us a layer, ``add_`` 16."""
    import torch

    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(
        ~mask, float("-inf"))[:, :, None]


_REGISTERED = "pyvision_decode"


def _use_decode_attention(model: Any) -> Any:
    """Switch the model to :func:`_decode_attention` for the duration of a ``with`` block."""
    import contextlib

    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    if _REGISTERED not in AttentionInterface._global_mapping:
        AttentionInterface.register(_REGISTERED, _decode_attention)
        # The same (boolean) masks as sdpa gets: padding must stay masked.
        ALL_MASK_ATTENTION_FUNCTIONS.register(_REGISTERED, sdpa_mask)

    @contextlib.contextmanager
    def switch():
        configs = [c for c in (model.config, getattr(model.config, "text_config", None)) if c]
        saved = [c._attn_implementation for c in configs]
        if not all(s in (None, "sdpa", "eager") for s in saved):
            yield  # flash attention and friends already do well: leave them alone
            return
        for c in configs:
            c._attn_implementation = _REGISTERED
        try:
            yield
        finally:
            for c, s in zip(configs, saved):
                c._attn_implementation = s

    return switch()


class _LeanStep:
    """One decode step (one new token per row) of a Qwen2.5-VL text model, without
    ``transformers``' per-call machinery: no output records, no mask construction (the padding
    mask is the whole mask for a single query), rotary cos/sin computed and split into mRoPE
    sections once per step instead of once per layer, and logits for that token only.

    The arithmetic is the model's own, op for op and in the same order (the same weights through
    the same ``linear`` / RMSNorm / rotary / attention calls), so the logits are bit-identical to
    ``model(...)``'s and the sampled tokens and log-probs do not change; ``tests/pipelines/agent/test_decode.py``
    checks it. :func:`lean_step` builds one only for a model whose modules are exactly the stock
    Qwen2.5-VL ones (no adapters, hooks or kernels replacing a forward); anything else takes the
    ``model(...)`` path.
    """

    def __init__(self, model: Any) -> None:
        from torch.nn.functional import silu  # what the checked SiLU modules call

        lm = model.model.language_model
        self.model = model
        self.config = lm.config
        self.attention = [layer.self_attn for layer in lm.layers]  # sdpa reads its groups
        self.rotary = lm.rotary_emb
        self.embed = lm.embed_tokens.weight
        self.norm = (lm.norm.weight, lm.norm.variance_epsilon)
        self.head = model.lm_head.weight
        self.sections = list(lm.config.rope_parameters["mrope_section"]) * 2
        self.layers = []
        for layer in lm.layers:
            a, m = layer.self_attn, layer.mlp
            self.layers.append((
                layer.input_layernorm.weight, layer.input_layernorm.variance_epsilon,
                a.q_proj.weight, a.q_proj.bias, a.k_proj.weight, a.k_proj.bias,
                a.v_proj.weight, a.v_proj.bias, a.o_proj.weight, a.head_dim, a.scaling,
                layer.post_attention_layernorm.weight,
                layer.post_attention_layernorm.variance_epsilon,
                m.gate_proj.weight, m.up_proj.weight, m.down_proj.weight, silu))

    @staticmethod
    def _rms(x: Any, weight: Any, eps: float) -> Any:
        import torch

        dtype = x.dtype  # Qwen2_5_VLRMSNorm.forward
        x = x.to(torch.float32)
        variance = x.pow(2).mean(-1, keepdim=True)
        x = x * torch.rsqrt(variance + eps)
        return weight * x.to(dtype)

    def __call__(self, tok: Any, positions: Any, mask: Any, layers: list[Any]) -> Any:
        """Logits ``[B, V]`` of the token after ``tok`` (``[B]``) at ``positions`` (``[3, B, 1]``);
        ``mask`` is ``[B, 1, 1, L]`` boolean (L counting this token) or None; ``layers`` the
        cache layers, which this step extends."""
        from torch.nn.functional import linear

        h = self._layers(tok[:, None], positions, mask, layers, _decode_attention)
        return linear(h[:, -1], self.head)

    def verify(self, toks: Any, positions: Any, mask: Any, layers: list[Any],
               real: Any = None) -> Any:
        """Logits after each of ``toks`` (``[B, T]``: a row's next token and its draft) at
        ``positions`` (``[3, B, T]``); ``mask`` ``[B, 1, T, L]`` boolean (the cache's padding,
        then causal over the ``T`` new tokens). The same ops as :meth:`__call__` with ``T``
        queries a row: the logits agree with ``T`` single steps to float rounding (the matrix
        products group their sums by shape), not bit for bit.

        ``real`` (``[B, T]`` boolean: the fed positions that are not padding) packs the batch:
        every matrix product with a weight runs over the real positions only (the attention
        still sees the padded layout, padding as zero keys and values, masked), and the logits
        come back ``[N, V]``, the real positions in row-major order. On one CPU thread (the
        default ``agent.cpu_threads``) a row's logits do not change: a product's rows do not
        depend on how many rows it has, from four on (fewer runs unpacked). Elsewhere (threads
        split a product's rows by its shape, a GPU picks kernels by shape) they move by float
        rounding, as the drafts already make them. Without it, ``[B, T, V]``."""
        from torch.nn.functional import linear

        bias = _mask_bias(mask, self.embed.dtype)  # what the attention gets in the mask's place
        if real is not None and int(real.sum()) < _MIN_PACKED:
            return linear(self._layers(toks, positions, bias, layers, _draft_attention),
                          self.head)[real]
        return linear(self._layers(toks, positions, bias, layers, _draft_attention, real),
                      self.head)

    def prefill(self, ids: Any, attn: Any, positions: Any, cache: Any,
                vision: dict[str, Any]) -> Any:
        """Logits ``[B, V]`` after each row's last token of a left-padded prefill: ``ids`` /
        ``attn`` (``[B, T]``; ``attn`` ``[B, L]`` when ``cache`` already holds states), the
        images' ``pixel_values`` / ``image_grid_thw`` in ``vision``. What ``model(...,
        logits_to_keep=1)`` computes, op for op: the vision tower and the placeholder scatter
        through the model's own methods, the mask from ``transformers``' own
        ``create_causal_mask`` and the attention through its sdpa function (inside
        :func:`_use_decode_attention`, as the model's forward would be), so the logits and the
        cached states are bit-identical; without the model's per-layer wrappers, output
        capture and per-layer rotary work."""
        import torch
        from torch.nn.functional import embedding, linear
        from transformers.masking_utils import create_causal_mask

        h = embedding(ids, self.embed)
        if vision.get("pixel_values") is not None:
            inner = self.model.model
            feats = inner.get_image_features(vision["pixel_values"],
                                             vision["image_grid_thw"]).pooler_output
            feats = torch.cat(feats, dim=0).to(h.device, h.dtype)
            where, _ = inner.get_placeholder_mask(ids, inputs_embeds=h, image_features=feats)
            h = h.masked_scatter(where, feats)
        mask = create_causal_mask(config=self.config, inputs_embeds=h, attention_mask=attn,
                                  past_key_values=cache, position_ids=None)
        h = self._layers(ids, positions, mask, cache.layers, _decode_attention, embeds=h)
        return linear(h[:, -1], self.head)

    def _layers(self, ids: Any, positions: Any, mask: Any, layers: list[Any],
                attention: Callable[..., Any], real: Any = None, embeds: Any = None) -> Any:
        """The decoder over ``ids`` (``[B, T]``): the final hidden states ``[B, T, H]``, or
        ``[N, H]`` for the positions ``real`` marks (:meth:`verify`); ``mask`` goes to
        ``attention`` as it is (a boolean mask, or :func:`_mask_bias`'s term)."""
        import torch
        from torch.nn.functional import embedding, linear

        b, t = ids.shape
        cos, sin = self.rotary(self.embed, positions)  # [3, B, T, D] (the weight: its dtype)
        cos = torch.cat([c[i % 3] for i, c in enumerate(cos.split(self.sections, dim=-1))],
                        dim=-1).unsqueeze(1)
        sin = torch.cat([c[i % 3] for i, c in enumerate(sin.split(self.sections, dim=-1))],
                        dim=-1).unsqueeze(1)
        if embeds is not None:  # a prefill's: the images' features already in place
            h = embeds
        elif real is None:
            h = embedding(ids, self.embed)
        else:  # packed: [N, H]; ``where`` scatters [N, ...] back into [B * T, ...] for attention
            where = real.reshape(-1).nonzero()[:, 0]
            h = embedding(ids.reshape(-1)[where], self.embed)

        def padded(x: Any) -> Any:  # [N, n] -> [B, T, n], zero at the padding
            if real is None:
                return x
            full = x.new_zeros((b * t, x.shape[-1]))
            full.index_copy_(0, where, x)
            return full.view(b, t, -1)

        for cache, module, (in_w, in_eps, qw, qb, kw, kb, vw, vb, ow, hd, scaling, post_w,
                            post_eps, gw, uw, dw, act) in zip(layers, self.attention, self.layers):
            residual = h
            x = self._rms(h, in_w, in_eps)
            q = padded(linear(x, qw, qb)).view(b, t, -1, hd).transpose(1, 2)
            k = padded(linear(x, kw, kb)).view(b, t, -1, hd).transpose(1, 2)
            v = padded(linear(x, vw, vb)).view(b, t, -1, hd).transpose(1, 2)
            q = (q * cos) + (_rotate_half(q) * sin)
            k = (k * cos) + (_rotate_half(k) * sin)
            k, v = cache.update(k, v)
            out, _ = attention(module, q, k, v, mask, scaling=scaling)
            out = out.reshape(b, t, -1).contiguous()
            h = residual + linear(out if real is None else out.view(b * t, -1)[where], ow)
            residual = h
            x = self._rms(h, post_w, post_eps)
            h = residual + linear(act(linear(x, gw)) * linear(x, uw), dw)
        return self._rms(h, *self.norm)


# Packed products need at least this many rows to give each row what the padded batch gives it
# on one CPU thread (MKL multiplies one to three rows with another kernel, which rounds
# differently; measured on this project's model shapes).
_MIN_PACKED = 4


def _rotate_half(x: Any) -> Any:
    import torch

    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def lean_step(model: Any) -> _LeanStep | None:
    """A :class:`_LeanStep` for ``model`` when it is a stock Qwen2.5-VL in eval mode whose
    attention this module handles (sdpa / eager), else None."""
    try:
        from torch import nn
        from transformers.activations import SiLUActivation
        from transformers.models.qwen2_5_vl import modeling_qwen2_5_vl as q
    except ImportError:  # pragma: no cover - an older or newer transformers
        return None
    lm = getattr(getattr(model, "model", None), "language_model", None)
    if type(lm) is not q.Qwen2_5_VLTextModel or model.training:
        return None
    # A forward replaced on the instance (a wrapper, an instrumented model) must be called.
    if any("forward" in vars(m) for m in (model, model.model, lm)):
        return None
    cfg = lm.config
    if set(cfg.layer_types) != {"full_attention"} or \
            cfg.rope_parameters.get("rope_type", "default") != "default" or \
            cfg._attn_implementation not in (None, "sdpa", "eager") or \
            type(model.lm_head) is not nn.Linear or model.lm_head.bias is not None or \
            type(lm.rotary_emb) is not q.Qwen2_5_VLRotaryEmbedding:
        return None
    for layer in lm.layers:
        a, m = layer.self_attn, layer.mlp
        if type(layer) is not q.Qwen2_5_VLDecoderLayer or type(a) is not q.Qwen2_5_VLAttention or \
                type(m) is not q.Qwen2MLP or \
                any(type(x) is not nn.Linear for x in (a.q_proj, a.k_proj, a.v_proj, a.o_proj,
                                                       m.gate_proj, m.up_proj, m.down_proj)) or \
                a.o_proj.bias is not None or m.gate_proj.bias is not None or \
                m.up_proj.bias is not None or m.down_proj.bias is not None or \
                type(m.act_fn) not in (nn.SiLU, SiLUActivation) or "forward" in vars(m.act_fn):
            return None
    for norm in [lm.norm] + [n for L in lm.layers
                             for n in (L.input_layernorm, L.post_attention_layernorm)]:
        if type(norm) is not q.Qwen2_5_VLRMSNorm or "forward" in vars(norm):
            return None
    # A hook anywhere (adapters, offloading, output capture by a caller) would be skipped here.
    from torch.nn.modules import module as torch_module

    if torch_module._global_forward_hooks or torch_module._global_forward_pre_hooks:
        return None
    for mod in model.modules():
        if mod._forward_hooks or mod._forward_pre_hooks:
            return None
    return _LeanStep(model)


def initial_positions(model: Any, ids: Any, attn: Any, vision: dict[str, Any]) -> Any:
    """``[3, B, L]`` positions of a left-padded prompt batch, as the model itself computes them."""
    if vision.get("image_grid_thw") is not None and hasattr(model, "model") \
            and hasattr(model.model, "get_rope_index"):
        positions, _ = model.model.get_rope_index(
            ids, mm_token_type_ids=vision["mm_token_type_ids"],
            image_grid_thw=vision["image_grid_thw"], attention_mask=attn)
        return positions
    text = (attn.long().cumsum(-1) - 1).clamp(min=0)
    return text[None].expand(3, -1, -1).clone()


def text_states(model: Any, ids: Sequence[int]) -> list[tuple[Any, Any]]:
    """The KV states (per layer ``(keys, values)``, ``[heads, len(ids), dim]``) of a run of text
    tokens at the start of a context (positions ``0 .. len(ids) - 1``): one prefill of one row,
    as :func:`decode_batch` prefills. A prompt's shared head (``hf.py``) is computed once with
    this and continued by every episode that starts with it."""
    import torch

    device = next(model.parameters()).device
    row = torch.tensor([list(ids)], dtype=torch.long, device=device)
    attn = torch.ones_like(row)
    cache = _growing_cache(model)
    with _use_decode_attention(model):
        _prefill(model, lean_step(model), row, attn, initial_positions(model, row, attn, {}),
                 cache, {})
    n = len(ids)
    return [(layer.keys[0, :, :n].clone(), layer.values[0, :, :n].clone())
            for layer in cache.layers]


def decode_batch(model: Any, ids: Any, attn: Any, vision: dict[str, Any], *, max_new_tokens: int,
                 temperature: float, top_p: float, stops: Callable[[list[int]], bool],
                 eos_ids: Sequence[int], suppress: Sequence[int] = (),
                 processors: Sequence[Any] = (),
                 on_done: Callable[[int, Row], None] | None = None,
                 code_temperature: float | None = None,
                 opens_code: Callable[[list[int]], bool] | None = None,
                 lean: bool = True, positions: Any = None, past: Past | None = None,
                 keep_cache: bool = False, context: Any = None,
                 row_images: Sequence[int] | None = None,
                 stats: Counter[str] | None = None, drafts: NgramDrafts | None = None,
                 draft_tokens: int = 0) -> list[Row]:
    """Generate for every row of a left-padded batch until it stops; see the module docstring.

    With ``past``, ``ids`` / ``attn`` / ``vision`` are only what follows each row's cached states
    (its new tokens, and the pixels of the images among them) and ``positions`` (``[3, B, L]``,
    required then) their positions in the whole context, and ``context`` (left-padded) the whole
    contexts that logits processors see. ``keep_cache`` fills each row's :attr:`Row.cache`
    before ``on_done`` sees it. ``row_images`` (how many of ``vision``'s images belong to each
    row, in order) lets a batch that mixes rows with and without cached states prefill the two
    apart (:func:`_prefill_apart`). ``stats`` counts the work done, padding included (the
    numbers behind a throughput figure, which do not vary with the machine's load):
    ``prefill_slots`` (token positions through a prefill), ``decode_steps``, ``decode_rows``
    (rows summed over the steps) and ``decode_keys`` (cached positions each row attended over,
    summed), and with drafts ``draft_tokens`` (drafted) and ``draft_kept``.

    ``drafts`` and ``draft_tokens`` > 0 make a greedy batch (``temperature`` 0, no
    ``processors``, a model :func:`lean_step` handles) check up to ``draft_tokens`` drafted
    tokens a step (module docstring); ``drafts`` learns every row's turn as it ends.

    ``stops(tokens)`` says whether a row's tokens so far end its turn (besides an eos token);
    ``on_done(i, row)`` is called the moment row ``i`` stops (the others keep decoding), or at
    the end for rows cut off by ``max_new_tokens``; ``opens_code(tokens)`` whether a row's last
    token completed a ``<code>`` tag (needed when ``code_temperature`` is set). ``lean=False``
    runs every decode step through ``model(...)`` (the reference :class:`_LeanStep` must match).
    """
    if code_temperature is not None and opens_code is None:
        raise ValueError("code_temperature needs opens_code")
    import torch

    device = ids.device
    rows = [Row() for _ in range(ids.shape[0])]
    live = list(range(ids.shape[0]))  # batch position -> row
    eos = torch.tensor(sorted(eos_ids), device=device)
    suppress_t = torch.tensor(sorted(suppress), device=device, dtype=torch.long)
    cache = _growing_cache(model)
    # Speculative greedy decoding (module docstring), when the model also has a lean step: every
    # row's next token and a draft after it go through the model together.
    spec = drafts is not None and draft_tokens > 0 and not processors and temperature <= 0 \
        and not code_temperature
    # Each row's last context tokens: the first draft continues them.
    n_tail = drafts.max_ngram if spec else 0  # type: ignore[union-attr]
    tails = [[t for t, a in zip(ids[i, -n_tail:].tolist(), attn[i, -n_tail:].tolist()) if a]
             for i in range(len(rows))] if spec else []
    if positions is None:
        if past is not None:
            raise ValueError("a batch that continues cached states needs its positions")
        positions = initial_positions(model, ids, attn, vision)
    if past is not None:
        for layer, (keys, values) in zip(cache.layers, past.layers, strict=True):
            layer.preset(keys, values, past.length)
        attn = torch.cat([past.mask.to(attn.dtype), attn], dim=1)
    context_len = attn.sum(-1).tolist()  # tokens in each row's context (cached or not)
    nxt = positions[:, :, -1] + 1  # [3, B]: text tokens advance every axis by one
    # Kept only for logits processors, which see every row's ids so far.
    context = ids if context is None else context
    step = lean_step(model) if lean else None
    with _use_decode_attention(model):
        groups = _prefill_groups(past, ids.shape[0]) \
            if row_images is not None and set(vision) <= _SPLITTABLE else None
        count = stats if stats is not None else Counter()
        if groups is None:
            count["prefill_slots"] += ids.numel()
            last = _prefill(model, step, ids, attn, positions, cache, vision)
            if past is not None:
                attn = _close_holes(cache.layers, attn)
        else:
            last, attn = _prefill_apart(model, step, groups, cache, ids, attn, positions,
                                        vision, past, row_images, count)  # type: ignore[arg-type]
        spec = spec and step is not None
        eos_set = set(eos_ids)

        def finish(j: int, r: int) -> None:
            row = rows[r]
            if keep_cache:
                _keep_row_cache(row, j, cache, attn, context_len[r])
            if spec:
                drafts.learn(tails[r] + row.tokens)  # type: ignore[union-attr]
            if on_done is not None:
                on_done(r, row)

        def retire(keep: list[int]) -> None:
            """The rows not in ``keep`` leave the batch, their cache included."""
            nonlocal attn, live, tok, nxt, context, last
            idx = torch.tensor(keep, device=device)
            attn = attn[idx]
            # Positions that only the finished rows used (the longest context may have left):
            # no later step attends over them.
            lead = int(attn.any(0).to(torch.int8).argmax())
            for layer in cache.layers:
                layer.keep_rows(keep, lead)
            live = [live[j] for j in keep]
            tok, attn, nxt, context = tok[idx], attn[:, lead:], nxt[:, idx], context[idx]
            if last is not None:
                last = last[idx]

        for _ in range(max_new_tokens):
            logits = last.float()
            scores = _suppressed(logits, suppress_t)
            for proc in processors:
                scores = proc(context, scores)
            temps = [code_temperature if code_temperature is not None and rows[r].in_code
                     else temperature for r in live]
            tok, lp = _sample(logits, scores, temps, top_p)
            last = None
            finished = torch.isin(tok, eos).tolist()
            keep = []
            for j, (r, t, p) in enumerate(zip(live, tok.tolist(), lp.tolist())):
                row = rows[r]
                row.tokens.append(t)
                row.logprobs.append(p)
                row.temperatures.append(temps[j])
                if code_temperature is not None and not row.in_code and opens_code(row.tokens):
                    row.in_code = True
                row.done = finished[j] or stops(row.tokens)
                # Rows advance unevenly when speculating: one at the limit is cut off now.
                if spec and not row.done and len(row.tokens) >= max_new_tokens:
                    row.done = True
                if not row.done:
                    keep.append(j)
                    continue
                finish(j, r)
            if not keep:
                break
            if len(keep) < len(live):  # the finished rows leave the batch, cache included
                retire(keep)
            if processors:
                context = torch.cat([context, tok[:, None]], dim=1)
            proposals = []  # each row's draft: at most what keeps it within max_new_tokens
            if spec:
                for r in live:
                    made = rows[r].tokens
                    tail = made[-n_tail:] if len(made) >= n_tail else (tails[r] + made)[-n_tail:]
                    proposals.append(drafts.propose(  # type: ignore[union-attr]
                        tail, min(draft_tokens, max_new_tokens - 1 - len(made))))
            width = max(map(len, proposals), default=0)
            if not width:
                attn = torch.cat([attn, attn.new_ones((attn.shape[0], 1))], dim=1)
                count["decode_steps"] += 1
                count["decode_rows"] += attn.shape[0]
                count["decode_keys"] += attn.numel()
                if step is not None:
                    last = step(tok, nxt[:, :, None], attn[:, None, None, :].bool(), cache.layers)
                else:
                    last = model(input_ids=tok[:, None], attention_mask=attn,
                                 position_ids=nxt[:, :, None], past_key_values=cache,
                                 use_cache=True).logits[:, -1]
                nxt = nxt + 1
                continue
            attn, nxt, last = _verify(step, rows, live, tok, proposals, width, nxt, attn,  # type: ignore[arg-type]
                                      cache, suppress_t, eos_set, stops, count)
            done = [j for j, r in enumerate(live) if rows[r].done]
            for j in done:
                finish(j, live[j])
            if len(done) == len(live):
                break
            if done:
                retire([j for j in range(len(live)) if not rows[live[j]].done])
            # Rejected drafts leave masked holes in the cache; close them before they cost more
            # keys than a prefill's worth of room.
            if attn.shape[1] - int(attn.sum(-1).max()) > _HOLES:
                attn = _close_holes(cache.layers, attn)
        for j, r in enumerate(live):  # cut off by max_new_tokens
            if not rows[r].done:
                rows[r].done = True
                finish(j, r)
    return rows


def _suppressed(logits: Any, suppress_t: Any) -> Any:
    """A copy of ``logits`` (``[..., V]``) with the suppressed tokens at -inf."""
    scores = logits.clone()
    if len(suppress_t):
        scores[..., suppress_t] = float("-inf")
    return scores


# Masked key positions (rejected drafts) a batch may carry before :func:`_close_holes` runs.
_HOLES = 64


def _verify(step: _LeanStep, rows: list[Row], live: list[int], tok: Any,
            proposals: list[list[int]], width: int, nxt: Any, attn: Any, cache: Any,
            suppress_t: Any, eos: set[int], stops: Callable[[list[int]], bool],
            count: Counter[str]) -> tuple[Any, Any, Any]:
    """One forward pass over each live row's next token ``tok`` and its draft (padded to
    ``width`` tokens); each row keeps its draft's longest prefix that greedy decoding chooses
    (appended to the row with its log-prob, stopping at the end of the turn). Returns the
    padding mask with the new positions (1 where a kept token was fed), the next positions and
    the logits after each row's last kept token."""
    import torch

    b = len(live)
    feed = tok.new_zeros((b, width + 1))
    feed[:, 0] = tok
    for j, d in enumerate(proposals):
        if d:
            feed[j, 1: 1 + len(d)] = torch.tensor(d, dtype=feed.dtype)
    span = torch.arange(width + 1, device=tok.device)
    causal = span[None, :] <= span[:, None]  # [T, T]: a token sees itself and those before
    mask = torch.cat([attn[:, None, None, :].bool().expand(b, 1, width + 1, attn.shape[1]),
                      causal[None, None].expand(b, 1, -1, -1)], dim=-1)
    # Only the real positions (each row's token and its own draft) go through the weights.
    sizes = [1 + len(d) for d in proposals]
    real = span[None, :] < torch.tensor(sizes, device=tok.device)[:, None]
    logits = step.verify(feed, nxt[:, :, None] + span, mask, cache.layers, real).float()
    choice = _suppressed(logits, suppress_t).argmax(-1).tolist()  # greedy's token after each fed one
    logp = torch.log_softmax(logits, dim=-1)  # [N, V]: row j's position q at start[j] + q
    start = [0]
    for n in sizes[:-1]:
        start.append(start[-1] + n)
    fed = []  # per row: its fed tokens that stay (the next token and the agreed draft)
    accepted = 0
    for j, (r, d) in enumerate(zip(live, proposals)):
        row, n = rows[r], 1
        for q, t in enumerate(d):
            if choice[start[j] + q] != t:
                break
            row.tokens.append(t)
            row.logprobs.append(float(logp[start[j] + q, t]))
            row.temperatures.append(0.0)
            accepted += 1
            if t in eos or stops(row.tokens):
                row.done = True  # the token that ends the turn is not fed, as without a draft
                break
            n += 1
        fed.append(n)
    kept = torch.tensor(fed, device=attn.device)
    new = (span[None, :] < kept[:, None]).to(attn.dtype)
    attn = torch.cat([attn, new], dim=1)
    count["decode_steps"] += 1
    count["decode_rows"] += b
    count["decode_keys"] += attn.numel()
    count["draft_tokens"] += sum(map(len, proposals))
    count["draft_kept"] += accepted
    last = logits[torch.tensor(start, device=logits.device) + kept - 1]
    return attn, nxt + kept[None], last


# The vision inputs :func:`_prefill_apart` knows how to divide between rows (images only).
_SPLITTABLE = {"pixel_values", "image_grid_thw", "mm_token_type_ids"}


def _prefill_groups(past: Past | None, n: int) -> list[list[int]] | None:
    """The rows to prefill apart: those that continue cached states and those that start from
    nothing, when a batch has both (else None: one prefill).

    Together, a new episode's whole prompt (a few hundred tokens, image included) sets the width
    every continuing row is padded to, and the continuing rows' cached length sets how many
    (padding) keys the new prompts attend over: on the demo's evaluation (batch 16) about half
    of the prefill's token slots were padding."""
    if past is None:
        return None
    has = past.mask.any(-1).tolist()
    groups = [[i for i in range(n) if has[i]], [i for i in range(n) if not has[i]]]
    return groups if all(groups) else None


def _prefill(model: Any, step: _LeanStep | None, ids: Any, attn: Any, positions: Any,
             cache: Any, vision: dict[str, Any]) -> Any:
    """The last logits ``[B, V]`` of a prefill into ``cache``: through :meth:`_LeanStep.prefill`
    when there is a lean step and the only media are images, else through ``model(...)``."""
    inputs = {k: v for k, v in vision.items() if k != "mm_token_type_ids"}
    if step is not None and set(inputs) <= _SPLITTABLE:
        return step.prefill(ids, attn, positions, cache, inputs)
    return model(input_ids=ids, attention_mask=attn, position_ids=positions,
                 past_key_values=cache, use_cache=True, logits_to_keep=1, **inputs).logits[:, -1]


def _prefill_apart(model: Any, step: _LeanStep | None, groups: list[list[int]], cache: Any,
                   ids: Any, attn: Any, positions: Any, vision: dict[str, Any], past: Past,
                   row_images: Sequence[int], count: Counter[str]) -> tuple[Any, Any]:
    """Prefill each group of rows on its own (only as wide as its own rows need, over only its
    own cached states), then gather every row's states into ``cache`` right-aligned, in batch
    order, as one prefill followed by :func:`_close_holes` leaves them. Returns the last logits
    ``[B, V]`` and the padding mask over ``cache``.

    A group of consecutive rows (the agent loop keeps continuing episodes first and new ones
    after them) works on views of ``past``: its states are copied once, into the final buffer."""
    import torch

    pixels, grids = vision.get("pixel_values"), vision.get("image_grid_thw")
    first_image = [0]
    for k in row_images:
        first_image.append(first_image[-1] + k)
    patch_end = grids.prod(-1).cumsum(0).tolist() if grids is not None else []
    last = None
    parts = []  # per group: (rows, cache layers, mask over them)
    for rows in groups:
        pick = _rows(rows, ids.device)
        a = attn[pick][:, past.length:]  # ``attn`` already starts with the cached states' mask
        width = int(a.sum(-1).max())
        kwargs: dict[str, Any] = {}
        images = [j for r in rows for j in range(first_image[r], first_image[r + 1])]
        if images:
            spans = [(patch_end[j - 1] if j else 0, patch_end[j]) for j in images]
            kwargs["pixel_values"] = torch.cat([pixels[s:e] for s, e in spans])
            kwargs["image_grid_thw"] = grids[torch.tensor(images, device=grids.device)]
        sub = _growing_cache(model)
        mask = a[:, -width:]
        held = past.mask[pick]
        if bool(held.any()):
            lead = past.length - int(held.sum(-1).max())  # columns that are padding in every row
            for layer, (keys, values) in zip(sub.layers, past.layers, strict=True):
                layer.preset(keys[pick][:, :, lead:], values[pick][:, :, lead:],
                             past.length - lead)
            mask = torch.cat([held[:, lead:].to(mask.dtype), mask], dim=1)
        count["prefill_slots"] += len(rows) * width
        logits = _prefill(model, step, ids[pick][:, -width:], mask, positions[:, pick, -width:],
                          sub, kwargs)
        if last is None:
            last = logits.new_empty((ids.shape[0], logits.shape[-1]))
        last[pick] = logits
        parts.append((pick, sub.layers, mask))
    # Each row's real states, right-aligned in one buffer in batch order, in one gather per
    # group (what :func:`_close_holes` makes of the groups' buffers side by side).
    width = max(int(m.sum(-1).max()) for _, _, m in parts)
    merged = attn.new_zeros((ids.shape[0], width))
    gathers = []
    for pick, layers, m in parts:
        order = _right_order(m.bool(), width)
        kept = torch.gather(m, 1, order)
        kept[:, : max(0, width - m.shape[1])] = 0  # a narrower group's leading positions
        merged[pick] = kept
        gathers.append((pick, layers, order))
    _gather_states(cache.layers, gathers, ids.shape[0], width)
    return last, merged


def _rows(rows: list[int], device: Any) -> Any:
    """An index for ``rows`` of a batch: a slice (views, no copies) when they are consecutive."""
    import torch

    if rows == list(range(rows[0], rows[0] + len(rows))):
        return slice(rows[0], rows[0] + len(rows))
    return torch.tensor(rows, device=device)


def _close_holes(layers: list[Any], attn: Any) -> Any:
    """Move each row's real states to the right end of a buffer as long as the longest row's,
    and return the new padding mask.

    A prefill over cached states leaves two runs of padding in a row (before its cached states
    and before its new tokens, each as long as the batch's longest one needs); the decode steps
    after it would attend over both. Closed, the rows are plain left-padded again, as long as
    without a cache. Only masked positions move out, so the logits do not change."""
    import torch

    valid = attn.bool()
    width = int(valid.sum(-1).max())
    if width == attn.shape[1]:
        return attn
    index = _right_order(valid, width)
    _gather_states(layers, [(slice(None), layers, index)], attn.shape[0], width)
    return torch.gather(attn, 1, index)


def _right_order(valid: Any, width: int) -> Any:
    """Per row of ``valid`` (``[B, L]`` boolean): its masked positions first, then its real
    ones, each in order, the last ``width`` of them (all the real ones, right-aligned). A row
    shorter than ``width`` starts with position 0 repeated: a masked place, any finite state."""
    import torch

    order = torch.sort(valid.to(torch.int8), dim=-1, stable=True).indices
    short = width - order.shape[1]
    if short > 0:
        order = torch.cat([order.new_zeros((order.shape[0], short)), order], dim=1)
    return order[:, -width:]


def _gather_states(layers: list[Any], groups: list[tuple[Any, list[Any], Any]], n_rows: int,
                   width: int, room: int = 64) -> None:
    """Give each of ``layers`` new buffers of ``n_rows`` rows and ``width`` positions (plus
    ``room`` free after them): for each ``(rows, source layers, order)`` group, its rows hold
    their source states at the positions ``order`` (``[len(rows), width]``) names. A source may
    be the layer itself: it is read before it is replaced."""
    import torch

    for li, layer in enumerate(layers):
        ref = groups[0][1][li]
        buffers = [old.new_empty((n_rows, old.shape[1], width + room, old.shape[-1]))
                   for old in (ref.keys, ref.values)]
        for rows, sources, order in groups:
            src = sources[li]
            for buf, old in zip(buffers, (src.keys, src.values)):
                buf[rows, :, :width] = torch.gather(
                    old[:, :, : src.length], 2,
                    order[:, None, :, None].expand(-1, old.shape[1], -1, old.shape[-1]))
        layer.preset(*buffers, width)


def _keep_row_cache(row: Row, j: int, cache: Any, attn: Any, context_len: int) -> None:
    """Copy batch row ``j``'s real (unpadded) states out of ``cache`` into ``row``."""
    mask = attn[j, : cache.layers[0].length].bool()
    row.cache = [layer.row(j, mask) for layer in cache.layers]
    row.fed = int(mask.sum()) - context_len


def _sample(logits: Any, scores: Any, temps: list[float], top_p: float) -> tuple[Any, Any]:
    """The next token of every row from ``scores`` (logits after suppression and processors;
    row i at ``temps[i]``, 0 is greedy), and its log-prob under the unmodified distribution it
    was sampled from (``softmax(logits / T)``, ``T = 1`` for greedy rows)."""
    import torch

    if len(set(temps)) == 1:  # the common case: one temperature for the whole batch
        t = temps[0]
        if t > 0:
            logp = torch.log_softmax(logits / t, dim=-1)
            probs = torch.softmax(scores / t, dim=-1)
            if top_p < 1.0:
                probs = _top_p(probs, top_p)
            tok = torch.multinomial(probs, 1)[:, 0]
        else:
            logp = torch.log_softmax(logits, dim=-1)
            tok = scores.argmax(-1)
        return tok, logp.gather(-1, tok[:, None])[:, 0]
    t = torch.tensor([x if x > 0 else 1.0 for x in temps], dtype=logits.dtype,
                     device=logits.device)[:, None]
    greedy = torch.tensor([x <= 0 for x in temps], device=logits.device)
    logp = torch.log_softmax(logits / t, dim=-1)
    probs = torch.softmax(scores / t, dim=-1)
    if top_p < 1.0:
        probs = _top_p(probs, top_p)
    tok = torch.where(greedy, scores.argmax(-1), torch.multinomial(probs, 1)[:, 0])
    return tok, logp.gather(-1, tok[:, None])[:, 0]


def _top_p(probs: Any, top_p: float) -> Any:
    """Keep the smallest set of most likely tokens whose mass reaches ``top_p`` (at least one)."""
    import torch

    sorted_p, order = torch.sort(probs, descending=True, dim=-1)
    cum = sorted_p.cumsum(-1)
    drop = cum - sorted_p > top_p
    sorted_p = sorted_p.masked_fill(drop, 0.0)
    kept = torch.zeros_like(probs).scatter(-1, order, sorted_p)
    return kept / kept.sum(-1, keepdim=True)
