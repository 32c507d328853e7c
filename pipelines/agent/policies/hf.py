"""A local transformers policy (CPU or GPU) that keeps every episode as exact token ids.

The token context of an episode (prompt with image pads expanded, sampled tokens with mask 1,
turn boundaries and interpreter turns with mask 0) is :class:`ChatTokens`' job (``tokens.py``),
shared with the verl agent loop; this module only samples.

Several episodes advance together: their contexts are left-padded into one batch, their images'
pixel values (computed once per image and cached) are concatenated in order, and one batched
decode (``decode.py``, which drops each row from the batch as soon as its turn ends) produces
everyone's next turn.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pipelines.agent.policies.base import Generation, Sampling
from pipelines.agent.policies.tokens import ChatTokens, TokenContext, mm_token_type_ids
from pipelines.agent.trajectory import TokenTrace


class HFPolicy:
    """Qwen2.5-VL or Qwen3-VL through transformers; shares its model object with the local RL
    trainer."""

    name = "hf"

    def __init__(self, model: Any, processor: Any, *, image_min_pixels: int = 3136,
                 image_max_pixels: int = 2_000_000, image_factor: int = 28) -> None:
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

    @classmethod
    def from_pretrained(cls, path: str, *, device: str = "auto", dtype: str = "auto",
                        image_min_pixels: int = 3136, image_max_pixels: int = 2_000_000,
                        image_factor: int = 28) -> HFPolicy:
        import torch
        from transformers import AutoModelForImageTextToText, AutoProcessor

        from pipelines.errors import UserError

        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        torch_dtype = {"auto": torch.bfloat16 if device == "cuda" else torch.float32,
                       "float32": torch.float32, "bfloat16": torch.bfloat16,
                       "float16": torch.float16}[dtype]
        try:
            processor = AutoProcessor.from_pretrained(path)
            model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch_dtype)
        except OSError as exc:
            raise UserError(f"cannot load model '{path}': {str(exc).splitlines()[0]}",
                            hint="pass a local Hugging Face model folder (offline) or a hub id "
                                 "reachable from here") from None
        model.to(device).eval()
        return cls(model, processor, image_min_pixels=image_min_pixels,
                   image_max_pixels=image_max_pixels, image_factor=image_factor)

    # -- episode state (ChatTokens) --------------------------------------------------------------

    def begin(self, messages: list[dict]) -> TokenContext:
        return self.tokens.begin(messages)

    def observe(self, handle: TokenContext, parts: list[dict], images: list[Any]) -> None:
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

        device = next(self.model.parameters()).device
        longest = max(len(h.ids) for h in handles)
        ids = torch.full((len(handles), longest), self.pad_id, dtype=torch.long)
        attn = torch.zeros((len(handles), longest), dtype=torch.long)
        for i, h in enumerate(handles):  # left padding: every row ends where generation starts
            ids[i, longest - len(h.ids):] = torch.tensor(h.ids)
            attn[i, longest - len(h.ids):] = 1
        kwargs: dict[str, Any] = {}
        pix = [p for h in handles for p in h.pixel_values]
        if pix:
            kwargs["pixel_values"] = torch.cat(pix).to(device)
            kwargs["image_grid_thw"] = torch.cat([g for h in handles for g in h.grids]).to(device)
            kwargs["mm_token_type_ids"] = mm_token_type_ids(ids, self.model.config).to(device)
        from pipelines.agent.policies.decode import Row, decode_batch

        results: list[Generation | None] = [None] * len(handles)

        def finish(i: int, row: Row) -> None:
            kept, reason, text = self.tokens.cut(row.tokens)
            self.tokens.append_generated(handles[i], kept, row.logprobs[: len(kept)],
                                         row.temperatures[: len(kept)])
            results[i] = Generation(text=text, finish=reason, n_tokens=len(kept))
            if on_done is not None:
                on_done(i, results[i])

        with torch.no_grad():
            decode_batch(
                self.model, ids.to(device), attn.to(device), kwargs,
                max_new_tokens=sampling.max_new_tokens, temperature=sampling.temperature,
                top_p=sampling.top_p, stops=self.tokens.ends_turn, eos_ids=sorted(self.eos_ids),
                suppress=self.model.generation_config.suppress_tokens or (),
                processors=self.logits_processors, on_done=finish,
                code_temperature=sampling.code_temperature,
                opens_code=self.tokens.opens_code if sampling.code_temperature is not None
                else None)
        return results  # type: ignore[return-value]
