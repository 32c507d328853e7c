"""A local transformers policy (CPU or GPU) that keeps every episode as exact token ids.

The context of an episode is a list of token ids: the prompt as the processor renders it (image
pads expanded), then, turn after turn, the tokens the model sampled (mask 1) and the tokens the
environment appended (mask 0): the ``<|im_end|>`` that closes a turn stopped at ``</code>``, and
the ``<|im_start|>user ... <|im_end|>\\n<|im_start|>assistant\\n`` interpreter turn, rendered exactly
as the Qwen2-VL chat template renders a user message. Training therefore sees the very tokens
that were sampled, with the same boundaries SFT saw.

Several episodes advance together: their contexts are left-padded into one batch, their images'
pixel values (computed once per image and cached) are concatenated in order, and one ``generate``
call produces everyone's next turn.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pipelines.agent.policies.base import Generation, Sampling
from pipelines.agent.protocol import CODE_STOP
from pipelines.agent.trajectory import TokenTrace


@dataclass
class _Episode:
    ids: list[int]
    prompt_len: int
    mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    images: list[Any] = field(default_factory=list)
    pixel_values: list[Any] = field(default_factory=list)  # one tensor per image
    grids: list[Any] = field(default_factory=list)         # one [1, 3] tensor per image


class HFPolicy:
    """Qwen2.5-VL through transformers; shares its model object with the local RL trainer."""

    name = "hf"

    def __init__(self, model: Any, processor: Any, *, image_min_pixels: int = 3136,
                 image_max_pixels: int = 2_000_000) -> None:
        self.model = model
        self.processor = processor
        self.tokenizer = processor.tokenizer
        self.min_pixels = image_min_pixels
        self.max_pixels = image_max_pixels
        tok = self.tokenizer
        self.im_end = tok.convert_tokens_to_ids("<|im_end|>")
        self.eos_ids = {self.im_end, tok.convert_tokens_to_ids("<|endoftext|>")}
        self.image_token_id = getattr(model.config, "image_token_id", None) or \
            tok.convert_tokens_to_ids("<|image_pad|>")
        self.pad_id = tok.pad_token_id if tok.pad_token_id is not None else self.im_end

    @classmethod
    def from_pretrained(cls, path: str, *, device: str = "auto", dtype: str = "auto",
                        image_min_pixels: int = 3136, image_max_pixels: int = 2_000_000) -> "HFPolicy":
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

    # -- episode state -------------------------------------------------------------------------

    def _encode(self, text: str, images: list[Any]) -> tuple[list[int], list[Any], list[Any]]:
        kwargs: dict[str, Any] = {}
        if images:
            kwargs.update(images=images, min_pixels=self.min_pixels, max_pixels=self.max_pixels)
        enc = self.processor(text=[text], return_tensors="pt", **kwargs)
        ids = enc["input_ids"][0].tolist()
        pixel_values, grids = [], []
        if images:
            offset = 0
            for grid in enc["image_grid_thw"]:
                n = int(grid.prod())
                pixel_values.append(enc["pixel_values"][offset: offset + n])
                grids.append(grid[None])
                offset += n
        return ids, pixel_values, grids

    def begin(self, messages: list[dict]) -> _Episode:
        images = [p["image"] for m in messages if isinstance(m["content"], list)
                  for p in m["content"] if p.get("type") == "image"]
        plain = [{"role": m["role"], "content": m["content"] if isinstance(m["content"], str) else
                  [{"type": "image"} if p.get("type") == "image" else p for p in m["content"]]}
                 for m in messages]
        text = self.processor.apply_chat_template(plain, add_generation_prompt=True, tokenize=False)
        ids, pix, grids = self._encode(text, images)
        return _Episode(ids=ids, prompt_len=len(ids), images=list(images), pixel_values=pix,
                        grids=grids)

    def observe(self, handle: _Episode, parts: list[dict], images: list[Any]) -> None:
        # Close the assistant turn as the chat template does: "<|im_end|>\n".
        closing = "\n" if handle.ids and handle.ids[-1] == self.im_end else "<|im_end|>\n"
        body = "".join(p["text"] if p.get("type") == "text"
                       else "<|vision_start|><|image_pad|><|vision_end|>" for p in parts)
        text = f"{closing}<|im_start|>user\n{body}<|im_end|>\n<|im_start|>assistant\n"
        ids, pix, grids = self._encode(text, images)
        handle.ids += ids
        handle.mask += [0] * len(ids)
        handle.images += images
        handle.pixel_values += pix
        handle.grids += grids

    def context_tokens(self, handle: _Episode) -> int:
        return len(handle.ids)

    def token_counts(self, handle: _Episode) -> dict[str, int]:
        generated = sum(handle.mask)
        return {"prompt": handle.prompt_len, "generated": generated,
                "observation": len(handle.mask) - generated,
                "visual": sum(1 for t in handle.ids if t == self.image_token_id)}

    def trace(self, handle: _Episode) -> TokenTrace:
        return TokenTrace(input_ids=list(handle.ids), prompt_len=handle.prompt_len,
                          response_mask=list(handle.mask), logprobs=list(handle.logprobs),
                          images=list(handle.images))

    def end(self, handle: _Episode) -> None:
        handle.pixel_values.clear()

    # -- generation ----------------------------------------------------------------------------

    def generate(self, handles: list[_Episode], sampling: Sampling) -> list[Generation]:
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
        do_sample = sampling.temperature > 0
        sample_kwargs = {"temperature": sampling.temperature, "top_p": sampling.top_p,
                         "top_k": 0} if do_sample else {}
        with torch.no_grad():
            out = self.model.generate(
                input_ids=ids.to(device), attention_mask=attn.to(device), **kwargs,
                max_new_tokens=sampling.max_new_tokens, do_sample=do_sample, **sample_kwargs,
                stop_strings=[CODE_STOP], tokenizer=self.tokenizer,
                eos_token_id=sorted(self.eos_ids), pad_token_id=self.pad_id,
                return_dict_in_generate=True, output_logits=True)
        new = out.sequences[:, longest:].cpu()
        logits = torch.stack(out.logits, dim=1).float().cpu() if out.logits else None
        results = []
        for i, h in enumerate(handles):
            row = new[i].tolist()
            kept, finish, text = self._cut(row)
            if logits is not None and kept:
                logp = torch.log_softmax(logits[i, : len(kept)], dim=-1)
                lp = logp.gather(-1, torch.tensor(kept)[:, None]).squeeze(-1).tolist()
            else:
                lp = [0.0] * len(kept)
            h.ids += kept
            h.mask += [1] * len(kept)
            h.logprobs += lp
            results.append(Generation(text=text, finish=finish, n_tokens=len(kept)))
        return results

    def _cut(self, row: list[int]) -> tuple[list[int], str, str]:
        """Tokens this row really generated (up to eos or the token completing </code>)."""
        kept: list[int] = []
        for tok in row:
            kept.append(tok)
            if tok in self.eos_ids:
                text = self.tokenizer.decode(kept[:-1], skip_special_tokens=False)
                return kept, "eos", text
            tail = self.tokenizer.decode(kept[-8:], skip_special_tokens=False)
            if CODE_STOP in tail:
                text = self.tokenizer.decode(kept, skip_special_tokens=False)
                return kept, "code", text[: text.find(CODE_STOP) + len(CODE_STOP)]
        return kept, "length", self.tokenizer.decode(kept, skip_special_tokens=False)
