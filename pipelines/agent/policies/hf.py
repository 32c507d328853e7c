"""A local transformers policy (CPU or GPU) that keeps every episode as exact token ids.

The token context of an episode (prompt with image pads expanded, sampled tokens with mask 1,
turn boundaries and interpreter turns with mask 0) is :class:`ChatTokens`' job (``tokens.py``),
shared with the verl agent loop; this module only samples.

Several episodes advance together: their contexts are left-padded into one batch, their images'
pixel values (computed once per image and cached) are concatenated in order, and one batched
decode (``decode.py``, which drops each row from the batch as soon as its turn ends) produces
everyone's next turn.

Each episode's KV states are kept on its :class:`TokenContext` between turns (``reuse_cache``,
on by default), so a turn runs only its new tokens and new images through the model. They are
used only while the context still starts with the tokens they were computed for, under the same
weights (an optimizer step changes ``_weights()``), and never split an image; otherwise the
turn prefills its whole context. ``end`` (which the agent loop calls for every episode, finished
or abandoned) drops them.

Episodes also share their prompts' heads (``share_prefixes``, with ``reuse_cache``): every task of
a family starts with the same system prompt and instructions (about 200 of a demo prompt's
230-266 tokens) and differs only from its question on. The states of an episode's text before its
first image are kept (a few prompt heads, the most recently used), and a new episode whose
context starts with at least ``MIN_SHARED`` tokens of one continues those states, as a later turn
continues its own: its first turn prefills only its question and image. This is vLLM's
automatic prefix caching, for the in-process policy; the logits differ from a whole prefill by
float32 rounding only (``tests/pipelines/agent/test_kv_reuse.py``).
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pipelines.agent.policies.base import Generation, Sampling
from pipelines.agent.policies.drafts import NgramDrafts
from pipelines.agent.policies.tokens import ChatTokens, TokenContext, mm_token_type_ids
from pipelines.agent.trajectory import TokenTrace


@dataclass
class _Cached:
    """The KV states of an episode's first tokens, kept between its turns."""

    ids: list[int]                    # the tokens whose states ``layers`` hold
    layers: list[tuple[Any, Any]]     # per layer (keys, values), [heads, len(ids), dim]
    weights: tuple | None             # HFPolicy._weights() when they were computed
    n_image_tokens: int               # image pad tokens among ``ids``
    next_position: int                # the (m)RoPE position of the token after ``ids``
    shared: bool = False              # a kept prompt head's, not the episode's own


# A new episode continues a kept prompt head when it shares at least this many tokens with it.
# A shorter common head (a chat template's system line and the user turn's opening, 30-35 tokens
# before an image prompt's image) is prefilled with its row: not worth a forward pass of its own.
MIN_SHARED = 64
# Prompt heads kept at once (least recently used dropped first): one per prompt family in use.
MAX_SHARED = 8


def _common(a: list[int], b: list[int]) -> int:
    """How many leading tokens ``a`` and ``b`` share."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class HFPolicy:
    """Qwen2.5-VL or Qwen3-VL through transformers; shares its model object with the local RL
    trainer."""

    name = "hf"

    def __init__(self, model: Any, processor: Any, *, image_min_pixels: int = 3136,
                 image_max_pixels: int = 2_000_000, image_factor: int = 28,
                 reuse_cache: bool = True, share_prefixes: bool = True, draft_tokens: int = 0,
                 threads: int = 0) -> None:
        self.model = model
        self.processor = processor
        self.tokenizer = processor.tokenizer
        self.tokens = ChatTokens(processor, image_min_pixels=image_min_pixels,
                                 image_max_pixels=image_max_pixels,
                                 image_token_id=getattr(model.config, "image_token_id", None),
                                 image_factor=image_factor)
        self.min_pixels = image_min_pixels
        self.max_pixels = image_max_pixels
        self.im_end = self.tokens.im_end
        self.eos_ids = self.tokens.eos_ids
        self.image_token_id = self.tokens.image_token_id
        self.pad_id = self.tokens.pad_id
        # Extra transformers LogitsProcessors applied when sampling (tests force tokens with one);
        # the recorded log-probs stay the model's own.
        self.logits_processors: list[Any] = []
        # Keep each episode's KV cache between its turns, so that a turn runs only its new tokens
        # through the model (False: every turn prefills its whole context, as a reference).
        # Qwen2.5-VL and Qwen3-VL with full attention only (a sliding window would need the
        # padding this cache adds to stay out of its window).
        self.reuse_cache = reuse_cache
        # New episodes continue the kept states of a prompt head they start with (module
        # docstring); only with ``reuse_cache``. Keyed by the head's tokens.
        self.share_prefixes = share_prefixes
        self._heads: OrderedDict[tuple[int, ...], _Cached] = OrderedDict()
        self._vision_start = getattr(model.config, "vision_start_token_id", None)
        text = model.config.get_text_config()
        self._reusable = model.config.model_type in ("qwen2_5_vl", "qwen3_vl") and \
            set(getattr(text, "layer_types", None) or ["full_attention"]) == {"full_attention"}
        # Rows that reused states / were prefilled whole, their tokens, and dropped states; and
        # the work decoding did (``decode_batch``'s ``stats``).
        self.cache_stats: Counter[str] = Counter()
        # Greedy turns check up to ``draft_tokens`` tokens drafted from the earlier turns' n-grams
        # per forward pass (``drafts.py``); 0: one token a pass.
        self.draft_tokens = draft_tokens
        self.drafts = NgramDrafts()
        # torch CPU threads while generating or encoding on the CPU (``agent.cpu_threads``; 0:
        # torch's own), see ``_cpu_threads``.
        self.threads = threads

    @classmethod
    def from_pretrained(cls, path: str, *, device: str = "auto", dtype: str = "auto",
                        image_min_pixels: int = 3136, image_max_pixels: int = 2_000_000,
                        image_factor: int = 28, draft_tokens: int = 0,
                        threads: int = 0, share_prefixes: bool = True) -> HFPolicy:
        from pipelines.core.device import resolve_device, torch_dtype
        from pipelines.core.modeldir import load_vlm
        from pipelines.inputs import check_model

        check_model(str(path), "model")  # a missing folder is "not found", not a bad hub id
        device = resolve_device(device)
        model, processor = load_vlm(path, dtype=torch_dtype(dtype, device),
                                    hint="pass a local Hugging Face model folder (offline) or a "
                                         "hub id reachable from here")
        model.to(device).eval()
        return cls(model, processor, image_min_pixels=image_min_pixels,
                   image_max_pixels=image_max_pixels, image_factor=image_factor,
                   draft_tokens=draft_tokens, threads=threads, share_prefixes=share_prefixes)

    # -- episode state (ChatTokens) --------------------------------------------------------------

    def begin(self, messages: list[dict]) -> TokenContext:
        with self._cpu_threads():  # the processor's tensor work
            return self.tokens.begin(messages)

    def observe(self, handle: TokenContext, parts: list[dict], images: list[Any]) -> None:
        with self._cpu_threads():
            self.tokens.observe(handle, parts, images)

    def context_tokens(self, handle: TokenContext) -> int:
        return self.tokens.context_tokens(handle)

    def token_counts(self, handle: TokenContext) -> dict[str, int]:
        return self.tokens.token_counts(handle)

    def trace(self, handle: TokenContext) -> TokenTrace:
        return self.tokens.trace(handle)

    def end(self, handle: TokenContext) -> None:
        self.tokens.end(handle)

    # -- generation ----------------------------------------------------------------------------

    def generate(self, handles: list[TokenContext], sampling: Sampling,
                 on_done: Callable[[int, Generation], None] | None = None) -> list[Generation]:
        import torch

        # Inference mode, not only no_grad: the same kernels (the same logits, bit for bit)
        # without autograd's per-op bookkeeping, which a small model's decode step pays for in
        # every one of its ~200 ops. The KV states kept between turns are then inference
        # tensors, only ever read or copied here.
        with torch.inference_mode(), self._cpu_threads():
            return self._generate(handles, sampling, on_done)

    def _cpu_threads(self) -> Any:
        """torch at ``self.threads`` CPU threads for one call that computes (generating, and the
        processor encoding a turn), when the model is on the CPU; restored after it. Every
        such call, not only generation: a tensor op at torch's default between two turns leaves
        its idle OpenMP thread spinning on a core the sandboxes use."""
        from pipelines.core.device import cpu_threads

        on_cpu = next(self.model.parameters()).device.type == "cpu"
        return cpu_threads(self.threads if on_cpu else 0)

    def _generate(self, handles: list[TokenContext], sampling: Sampling,
                  on_done: Callable[[int, Generation], None] | None) -> list[Generation]:
        import torch

        from pipelines.agent.policies.decode import Row, decode_batch, initial_positions, pad_past

        device = next(self.model.parameters()).device
        reuse = self.reuse_cache and self._reusable
        weights = self._weights() if reuse else None
        if reuse and self.share_prefixes:
            self._share_heads(handles, weights)
        starts = [self._cached_prefix(h, weights) if reuse else (0, 0) for h in handles]
        before = [len(h.ids) for h in handles]
        longest = max(before)
        ids = torch.full((len(handles), longest), self.pad_id, dtype=torch.long)
        attn = torch.zeros((len(handles), longest), dtype=torch.long)
        for i, h in enumerate(handles):  # left padding: every row ends where generation starts
            ids[i, longest - len(h.ids):] = torch.tensor(h.ids)
            attn[i, longest - len(h.ids):] = 1
        ids, attn = ids.to(device), attn.to(device)
        full = ids
        # What goes through the model now: each row's tokens after its cached prefix (all of
        # them for a row without one), still left-padded, and the pixels of their images.
        width = max(n - c for n, (c, _) in zip(before, starts))
        ids, attn = ids[:, longest - width:].clone(), attn[:, longest - width:].clone()
        for i, (n, (c, _)) in enumerate(zip(before, starts)):
            ids[i, : width - (n - c)] = self.pad_id
            attn[i, : width - (n - c)] = 0
        new_grids = [g for h, (_, k) in zip(handles, starts) for g in h.grids[k:]]
        # Their positions in the whole context: (m)RoPE numbers a context's pieces in order, each
        # from where the one before it ended, so the new tokens' positions are the ones they
        # get on their own, moved on by where the cached prefix ended.
        positions = initial_positions(self.model, ids, attn, {
            "image_grid_thw": torch.cat(new_grids).to(device),
            "mm_token_type_ids": mm_token_type_ids(ids, self.model.config).to(device)}
            if new_grids else {})
        shift = torch.tensor([h.kv.next_position if c else 0
                              for h, (c, _) in zip(handles, starts)], device=device)
        positions = positions + shift[None, :, None] * attn[None]
        # The position after each row's context: its first generated token's.
        after = (positions[:, :, -1].max(0).values + 1).tolist()
        kwargs: dict[str, Any] = {}
        pix = [p for h, (_, k) in zip(handles, starts) for p in h.pixel_values[k:]]
        if pix:
            kwargs["pixel_values"] = torch.cat(pix).to(device)
            kwargs["image_grid_thw"] = torch.cat(new_grids).to(device)
        past = pad_past([h.kv.layers if c else None for h, (c, _) in zip(handles, starts)],
                        room=width + 64) if reuse else None
        for i, (c, _) in enumerate(starts):
            shared = c and handles[i].kv.shared
            self.cache_stats["shared" if shared else "reused" if c else "prefilled"] += 1
            self.cache_stats["tokens_shared" if shared else "tokens_reused"] += c
            self.cache_stats["tokens_prefilled"] += before[i] - c

        results: list[Generation | None] = [None] * len(handles)

        def finish(i: int, row: Row) -> None:
            h = handles[i]
            kept, reason, text = self.tokens.cut(row.tokens)
            self.tokens.append_generated(h, kept, row.logprobs[: len(kept)],
                                         row.temperatures[: len(kept)])
            h.kv = None
            if row.cache is not None and row.fed <= len(kept):
                n = before[i] + row.fed  # the states cover the context and the fed tokens
                # Generated tokens take one position each after the context's.
                h.kv = _Cached(h.ids[:n], row.cache, weights,
                               h.ids[:n].count(self.image_token_id), after[i] + row.fed)
            results[i] = Generation(text=text, finish=reason, n_tokens=len(kept))
            if on_done is not None:
                on_done(i, results[i])

        decode_batch(
            self.model, ids, attn, kwargs,
            max_new_tokens=sampling.max_new_tokens, temperature=sampling.temperature,
            top_p=sampling.top_p, stops=self.tokens.ends_turn, eos_ids=sorted(self.eos_ids),
            suppress=self.model.generation_config.suppress_tokens or (),
            processors=self.logits_processors, on_done=finish,
            code_temperature=sampling.code_temperature,
            opens_code=self.tokens.opens_code if sampling.code_temperature is not None
            else None, positions=positions, past=past, keep_cache=reuse,
            context=full if self.logits_processors else None,
            row_images=[len(h.grids) - k for h, (_, k) in zip(handles, starts)],
            stats=self.cache_stats, drafts=self.drafts, draft_tokens=self.draft_tokens)
        return results  # type: ignore[return-value]

    # -- the KV cache kept between turns -------------------------------------------------------

    def _weights(self) -> tuple:
        """Changes whenever a parameter is updated in place (an optimizer step) or replaced: states
        computed under other weights are never reused."""
        return tuple((p.data_ptr(), p._version) for p in self.model.parameters())

    def _share_heads(self, handles: list[TokenContext], weights: tuple) -> None:
        """Give every episode without states of its own those of the kept prompt head it shares
        most tokens with (at least ``MIN_SHARED``), as far as they agree and before its first
        image; a head shared with none is computed now (one single-row prefill: no more tokens
        than its row's own prefill would have run) and kept for the episodes after it."""
        if any(c.weights != weights for c in self._heads.values()):
            self._heads.clear()  # computed under weights an optimizer step has since changed
        for h in handles:
            if h.kv is not None:
                continue
            ids = h.ids
            end = len(ids) - 1  # at least one token must still go through the model
            if self._vision_start is not None and self._vision_start in ids:
                end = min(end, ids.index(self._vision_start))
            if end < MIN_SHARED:
                continue
            head = list(ids[:end])
            best, n = None, 0
            for key, c in self._heads.items():
                k = _common(c.ids, head)
                if k > n:
                    best, n = key, k
            if n < MIN_SHARED:
                from pipelines.agent.policies.decode import text_states

                best, n = tuple(head), end
                self._heads[best] = _Cached(head, text_states(self.model, head), weights, 0, end,
                                            shared=True)
                while len(self._heads) > MAX_SHARED:
                    self._heads.popitem(last=False)
                self.cache_stats["heads_computed"] += 1
            self._heads.move_to_end(best)
            c = self._heads[best]
            h.kv = _Cached(c.ids[:n], [(k[:, :n], v[:, :n]) for k, v in c.layers], weights, 0, n,
                           shared=True)

    def _cached_prefix(self, h: TokenContext, weights: tuple) -> tuple[int, int]:
        """How many of ``h``'s tokens, and of its images, its kept states cover; (0, 0) (and the
        states dropped) when they cannot be reused: computed under other weights, not a prefix
        of the context any more, leaving no new token, or ending inside an image."""
        c: _Cached | None = h.kv
        if c is None:
            return 0, 0
        n = len(c.ids)
        images, seen = 0, 0
        if c.weights == weights and n < len(h.ids) and h.ids[:n] == c.ids:
            while images < len(h.grids) and seen < c.n_image_tokens:
                seen += int(h.grids[images].prod()) // self.tokens.merge
                images += 1
            if seen == c.n_image_tokens:
                return n, images
        self.cache_stats["fallbacks"] += 1
        h.kv = None
        return 0, 0
