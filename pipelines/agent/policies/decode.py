"""Batched decoding for the in-process policy: rows leave the batch as soon as they stop.

``transformers``' ``generate`` keeps computing every row until the last one stops, so a batch of
agent turns (most end at ``</code>`` after a few dozen tokens, one runs to the limit) costs the
longest turn times the batch: measured on the tiny SFT model at batch 16, 2.35 row-steps were
computed per token kept. Here a finished row is dropped from the batch, its KV cache included,
and the forward pass shrinks with it.

Two changes make a decode step cheap on a CPU, where a small model's step is memory traffic, not
arithmetic: the KV cache grows in place (capacity doubles when full) instead of being concatenated
every step, and single-token queries attend with grouped KV heads without first copying each K/V
head once per query head (``transformers``' sdpa path repeats them whenever there is a mask).
``transformers``' own continuous batching would do more, but it is text-only.

Everything else is what ``generate`` does: a prefill that runs the vision tower once, then one
token per step from the KV cache, the 3-D (mRoPE) positions of Qwen2.5-VL and Qwen3-VL for image
tokens (computed once by the model's own ``get_rope_index``; text positions then advance by one
per token),
temperature / top-p sampling from the global torch RNG (so a seeded run repeats), suppressed
tokens, optional logits processors. The log-prob recorded for each token is that of the
distribution it was sampled from before any processor or top-p cut (``softmax(logits / T)``,
or ``T = 1`` when greedy): what the trainer recomputes.

A second temperature can apply inside code (``code_temperature``, Thyme's idea): a row samples at
``code_temperature`` from the token after its turn has opened a ``<code>`` block (``opens_code``
says so) until the turn ends, and at ``temperature`` before. Each token's temperature is
recorded (``Row.temperatures``) so that the trainer recomputes every log-prob under the
distribution that token was sampled from.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Row:
    """What one row generated, and whether it has stopped."""

    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    temperatures: list[float] = field(default_factory=list)  # what each token was sampled at
    done: bool = False
    in_code: bool = False


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

        def batch_select_indices(self, indices: Any) -> None:
            if self.get_seq_length() > 0:
                self.keys = self.keys[indices]
                self.values = self.values[indices]

    return GrowingLayer


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


def decode_batch(model: Any, ids: Any, attn: Any, vision: dict[str, Any], *, max_new_tokens: int,
                 temperature: float, top_p: float, stops: Callable[[list[int]], bool],
                 eos_ids: Sequence[int], suppress: Sequence[int] = (),
                 processors: Sequence[Any] = (),
                 on_done: Callable[[int, Row], None] | None = None,
                 code_temperature: float | None = None,
                 opens_code: Callable[[list[int]], bool] | None = None) -> list[Row]:
    """Generate for every row of a left-padded batch until it stops; see the module docstring.

    ``stops(tokens)`` says whether a row's tokens so far end its turn (besides an eos token);
    ``on_done(i, row)`` is called the moment row ``i`` stops (the others keep decoding), or at
    the end for rows cut off by ``max_new_tokens``; ``opens_code(tokens)`` whether a row's last
    token completed a ``<code>`` tag (needed when ``code_temperature`` is set).
    """
    if code_temperature is not None and opens_code is None:
        raise ValueError("code_temperature needs opens_code")
    import torch
    from transformers import DynamicCache

    device = ids.device
    rows = [Row() for _ in range(ids.shape[0])]
    live = list(range(ids.shape[0]))  # batch position -> row
    eos = torch.tensor(sorted(eos_ids), device=device)
    suppress_t = torch.tensor(sorted(suppress), device=device, dtype=torch.long)
    cache = DynamicCache(config=model.config.get_text_config())
    cache.layers = [_growing_layer_class()() for _ in cache.layers]
    positions = initial_positions(model, ids, attn, vision)
    nxt = positions[:, :, -1] + 1  # [3, B]: text tokens advance every axis by one
    context = ids  # kept only for logits processors, which see every row's ids so far
    with _use_decode_attention(model):
        out = model(input_ids=ids, attention_mask=attn, position_ids=positions,
                    past_key_values=cache, use_cache=True, logits_to_keep=1,
                    **{k: v for k, v in vision.items() if k != "mm_token_type_ids"})
        for _ in range(max_new_tokens):
            logits = out.logits[:, -1].float()
            scores = logits.clone()
            if len(suppress_t):
                scores[:, suppress_t] = float("-inf")
            for proc in processors:
                scores = proc(context, scores)
            temps = [code_temperature if code_temperature is not None and rows[r].in_code
                     else temperature for r in live]
            tok, lp = _sample(logits, scores, temps, top_p)
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
                if not row.done:
                    keep.append(j)
                elif on_done is not None:
                    on_done(r, row)
            if not keep:
                break
            if len(keep) < len(live):  # the finished rows leave the batch, cache included
                idx = torch.tensor(keep, device=device)
                for layer in cache.layers:
                    layer.batch_select_indices(idx)
                live = [live[j] for j in keep]
                tok, attn, nxt, context = tok[idx], attn[idx], nxt[:, idx], context[idx]
            if processors:
                context = torch.cat([context, tok[:, None]], dim=1)
            attn = torch.cat([attn, attn.new_ones((attn.shape[0], 1))], dim=1)
            out = model(input_ids=tok[:, None], attention_mask=attn,
                        position_ids=nxt[:, :, None], past_key_values=cache, use_cache=True)
            nxt = nxt + 1
    if on_done is not None:
        for i, row in enumerate(rows):
            if not row.done:
                row.done = True
                on_done(i, row)
    return rows


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
