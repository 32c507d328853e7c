"""A local transformers policy (CPU or GPU) that keeps every episode as exact token ids.

The token context of an episode (prompt with image pads expanded, sampled tokens with mask 1,
turn boundaries and interpreter turns with mask 0) is :class:`ChatTokens`' job (``tokens.py``),
shared with the verl agent loop; this module only samples.

Several episodes advance together: their contexts are left-padded into one batch, their images'
pixel values (computed once per image and cached) are concatenated in order, and one ``generate``
call produces everyone's next turn.
"""

from __future__ import annotations

from typing import Any

from pipelines.agent.policies.base import Generation, Sampling
from pipelines.agent.policies.tokens import ChatTokens, TokenContext, mm_token_type_ids
from pipelines.agent.protocol import CODE_STOP
from pipelines.agent.trajectory import TokenTrace


class HFPolicy:
    """Qwen2.5-VL through transformers; shares its model object with the local RL trainer."""

    name = "hf"

    def __init__(self, model: Any, processor: Any, *, image_min_pixels: int = 3136,
                 image_max_pixels: int = 2_000_000) -> None:
        self.model = model
        self.processor = processor
        self.tokenizer = processor.tokenizer
        self.tokens = ChatTokens(processor, image_min_pixels=image_min_pixels,
                                 image_max_pixels=image_max_pixels,
                                 image_token_id=getattr(model.config, "image_token_id", None))
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
                        image_min_pixels: int = 3136, image_max_pixels: int = 2_000_000) -> HFPolicy:
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
                   image_max_pixels=image_max_pixels)

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

    def generate(self, handles: list[TokenContext], sampling: Sampling) -> list[Generation]:
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
        do_sample = sampling.temperature > 0
        sample_kwargs = {"temperature": sampling.temperature, "top_p": sampling.top_p,
                         "top_k": 0} if do_sample else {}
        if self.logits_processors:
            from transformers import LogitsProcessorList

            sample_kwargs["logits_processor"] = LogitsProcessorList(self.logits_processors)
        with torch.no_grad():
            out = self.model.generate(
                input_ids=ids.to(device), attention_mask=attn.to(device), **kwargs,
                max_new_tokens=sampling.max_new_tokens, do_sample=do_sample, **sample_kwargs,
                stop_strings=[CODE_STOP], tokenizer=self.tokenizer,
                eos_token_id=sorted(self.eos_ids), pad_token_id=self.pad_id,
                return_dict_in_generate=True, output_logits=True,
                # Checkpoints saved by trainers often carry use_cache=false (LLaMA-Factory turns
                # it off for training); without the KV cache every step re-reads the context.
                use_cache=True)
        new = out.sequences[:, longest:].cpu()
        logits = torch.stack(out.logits, dim=1).float().cpu() if out.logits else None
        if logits is not None and do_sample and sampling.temperature != 1.0:
            # The log-probs of the distribution the tokens were sampled from (the trainer
            # recomputes them the same way; top-p is not applied to either).
            logits = logits / sampling.temperature
        results = []
        for i, h in enumerate(handles):
            row = new[i].tolist()
            kept, finish, text = self.tokens.cut(row)
            if logits is not None and kept:
                logp = torch.log_softmax(logits[i, : len(kept)], dim=-1)
                lp = logp.gather(-1, torch.tensor(kept)[:, None]).squeeze(-1).tolist()
            else:
                lp = [0.0] * len(kept)
            self.tokens.append_generated(h, kept, lp)
            results.append(Generation(text=text, finish=finish, n_tokens=len(kept)))
        return results
