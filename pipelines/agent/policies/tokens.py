"""Exact token contexts for Qwen2.5-VL and Qwen3-VL episodes, shared by the token-level policies.

The context of an episode is a list of token ids: the prompt as the processor renders it (image
pads expanded), then, turn after turn, the tokens the model sampled (mask 1) and the tokens the
environment appended (mask 0): the ``<|im_end|>`` that closes a turn stopped at ``</code>``, and
the ``<|im_start|>user ... <|im_end|>\\n<|im_start|>assistant\\n`` interpreter turn, rendered exactly
as the Qwen2-VL chat template renders a user message. Training therefore sees the very tokens
that were sampled, with the same boundaries SFT saw.

This is the boundary verl's Qwen continuous-token builder produces too (it inserts the ``\\n``
after a sampled ``<|im_end|>`` with mask 0), except that verl's builder assumes every assistant
turn ends with ``<|im_end|>``; a turn stopped at ``</code>`` does not, so the closing
``<|im_end|>\\n`` is appended here, with mask 0, before the interpreter turn.

:class:`ChatTokens` owns that logic; the transformers policy (``hf.py``) and the verl agent loop
(``pipelines/rl/verl/agent_loop.py``) only differ in how they obtain the sampled tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pipelines.agent.policies.base import Finish
from pipelines.agent.protocol import CODE_STOP
from pipelines.agent.trajectory import TokenTrace
from pipelines.errors import UserError

CODE_OPEN = "<code>"

VISION_PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"


def mm_token_type_ids(input_ids: Any, config: Any) -> Any:
    """Each token's modality (0 text, 1 image, 2 video) as Qwen2.5-VL's and Qwen3-VL's forward
    want it.

    Without it Qwen2.5-VL silently falls back to 1-D positions for every token (Qwen3-VL
    raises), while LLaMA-Factory, verl and vLLM train and serve with 3-D (mRoPE) positions for
    vision tokens: on the tiny SFT model the logits after an image differed by up to 4.0 between
    the two. Every
    forward pass and ``generate`` call over a context with images must pass it.
    """
    import torch

    types = torch.zeros_like(input_ids, dtype=torch.int32)
    types[input_ids == config.image_token_id] = 1
    video = getattr(config, "video_token_id", None)
    if video is not None:
        types[input_ids == video] = 2
    return types


_CHECKED: dict[tuple, tuple] = {}


def _remember_processor_kwarg_checks() -> None:
    """Make transformers' processors check their keyword arguments once per distinct set.

    A processor call validates its merged keyword arguments against a ``TypedDict`` it builds
    anew on every call, which defeats ``huggingface_hub``'s cache of the strict dataclass made
    from it: each call built dataclasses again, ~6 ms, two thirds of encoding a short turn. The
    same field types (same objects) with the same plain values are valid again; anything else
    (and the first call of each) is checked as before, and an invalid set still raises."""
    from transformers import processing_utils

    check = processing_utils.validate_typed_dict
    if getattr(check, "remembers", False):
        return
    plain = (int, float, str, bool, type(None))

    def validate(schema: Any, data: dict) -> None:
        fields = getattr(schema, "__annotations__", None)
        if fields is None or not all(type(v) in plain for v in data.values()):
            return check(schema, data)
        key = (tuple((k, id(v)) for k, v in fields.items()),
               tuple(sorted((k, type(v).__name__, v) for k, v in data.items())))
        if key not in _CHECKED:
            check(schema, data)
            _CHECKED[key] = tuple(fields.values())  # keeps the ids in the key from being reused
        return None

    validate.remembers = True  # type: ignore[attr-defined]
    processing_utils.validate_typed_dict = validate


@dataclass
class TokenContext:
    """One episode's context, token for token."""

    ids: list[int]
    prompt_len: int
    mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)    # one per model token (mask 1)
    temperatures: list[float] = field(default_factory=list)  # per model token, when recorded
    images: list[Any] = field(default_factory=list)        # PIL, in context order
    pixel_values: list[Any] = field(default_factory=list)  # one tensor per image (if kept)
    grids: list[Any] = field(default_factory=list)         # one [1, 3] tensor per image
    # The in-process policy's KV cache of a prefix of ``ids`` (``hf.py``); None when none is kept.
    kv: Any = field(default=None, repr=False, compare=False)


def check_image_factor(processor: Any, factor: int) -> int:
    """The processor's merge size squared (pad tokens per visual token); raises a precise error
    when its patch size x merge size is not ``factor`` (``agent.image_factor``)."""
    ip = getattr(processor, "image_processor", None)
    patch = getattr(ip, "patch_size", None)
    merge = getattr(ip, "merge_size", None)
    if not patch or not merge:
        raise UserError(f"the model's image processor ({type(ip).__name__}) has no patch_size / "
                        "merge_size, so its visual tokens cannot be counted",
                        hint="use a Qwen2.5-VL or Qwen3-VL checkpoint")
    if patch * merge != factor:
        name = type(processor).__name__
        raise UserError(f"the model's processor ({name}) makes one visual token per "
                        f"{patch * merge}x{patch * merge} pixels (patch {patch} x merge {merge}) "
                        f"but agent.image_factor is {factor}",
                        hint=f"set agent.image_factor={patch * merge} in the recipe "
                             "(Qwen2.5-VL: 28, Qwen3-VL: 32)")
    return merge * merge


class ChatTokens:
    """Renders, extends and accounts for :class:`TokenContext` s with one processor."""

    def __init__(self, processor: Any, *, image_min_pixels: int = 3136,
                 image_max_pixels: int = 2_000_000, image_token_id: int | None = None,
                 keep_pixels: bool = True, image_factor: int = 28) -> None:
        self.processor = processor
        self.tokenizer = processor.tokenizer
        _remember_processor_kwarg_checks()
        self.min_pixels = image_min_pixels
        self.max_pixels = image_max_pixels
        self.factor = image_factor
        self.merge = check_image_factor(processor, image_factor)
        # A server-backed policy never feeds pixels itself; not keeping them saves memory.
        self.keep_pixels = keep_pixels
        tok = self.tokenizer
        self.im_end = tok.convert_tokens_to_ids("<|im_end|>")
        self.eos_ids = {self.im_end, tok.convert_tokens_to_ids("<|endoftext|>")}
        self.image_token_id = image_token_id or getattr(processor, "image_token_id", None) or \
            tok.convert_tokens_to_ids("<|image_pad|>")
        self.pad_id = tok.pad_token_id if tok.pad_token_id is not None else self.im_end
        self._closing: set[int] | None = None  # ids whose token text holds ">"

    def _closes_tag(self, tokens: list[int]) -> bool:
        if self._closing is None:
            pieces = self.tokenizer.convert_ids_to_tokens(list(range(len(self.tokenizer))))
            self._closing = {i for i, p in enumerate(pieces) if p and ">" in p}
        return bool(tokens) and tokens[-1] in self._closing

    def ends_turn(self, tokens: list[int]) -> bool:
        """Whether a turn's tokens so far end with the code stop ``</code>`` (checked by decoding
        the tail only after a token that can close it)."""
        return self._closes_tag(tokens) and \
            CODE_STOP in self.tokenizer.decode(tokens[-8:], skip_special_tokens=False)

    def opens_code(self, tokens: list[int]) -> bool:
        """Whether a turn's last token completed a ``<code>`` tag: the tokens after it are code
        (what ``agent.code_temperature`` applies to)."""
        if not self._closes_tag(tokens):
            return False
        tail = self.tokenizer.decode(tokens[-8:], skip_special_tokens=False)
        return tail.rstrip().endswith(CODE_OPEN)

    @property
    def processor_kwargs(self) -> dict[str, int]:
        """The resize bounds every consumer of these ids must process images with."""
        return {"min_pixels": self.min_pixels, "max_pixels": self.max_pixels}

    def context_images(self, images: list[Any]) -> list[Any]:
        """``images`` at their context size (``resize_for_context``; a no-op for images the
        agent loop already resized)."""
        from pipelines.agent.prompts import resize_for_context

        return [resize_for_context(img, self.min_pixels, self.max_pixels, self.factor)
                for img in images]

    def encode(self, text: str, images: list[Any]) -> tuple[list[int], list[Any], list[Any]]:
        """Token ids of ``text`` with each image's pad run expanded; per-image pixels and grids.

        Images must already be at their context size (``context_images``). The processor then
        has nothing to resize, whether or not it honours ``min_pixels``/``max_pixels``, and the
        visual tokens it made for each image are checked against that size."""
        kwargs: dict[str, Any] = {}
        if images:
            kwargs.update(images=images, **self.processor_kwargs)
        enc = self.processor(text=[text], return_tensors="pt", **kwargs)
        ids = enc["input_ids"][0].tolist()
        pixel_values, grids = [], []
        if images:
            offset = 0
            for img, grid in zip(images, enc["image_grid_thw"], strict=True):
                n = int(grid.prod())
                expected = (img.width // self.factor) * (img.height // self.factor)
                if n // self.merge != expected:
                    raise UserError(
                        f"the processor made {n // self.merge} visual tokens for a "
                        f"{img.width}x{img.height} image at its context size, which has "
                        f"{expected} ({self.factor}x{self.factor} pixels each): it resized the "
                        f"image although it was already within min_pixels={self.min_pixels} / "
                        f"max_pixels={self.max_pixels}",
                        hint="the model's preprocessor_config.json bounds must contain the "
                             "recipe's agent.image_min_pixels / image_max_pixels; widen them "
                             "there or narrow the recipe's")
                if self.keep_pixels:
                    pixel_values.append(enc["pixel_values"][offset: offset + n])
                grids.append(grid[None])
                offset += n
        return ids, pixel_values, grids

    def begin(self, messages: list[dict]) -> TokenContext:
        images = self.context_images([p["image"] for m in messages
                                      if isinstance(m["content"], list)
                                      for p in m["content"] if p.get("type") == "image"])
        plain = [{"role": m["role"], "content": m["content"] if isinstance(m["content"], str) else
                  [{"type": "image"} if p.get("type") == "image" else p for p in m["content"]]}
                 for m in messages]
        text = self.processor.apply_chat_template(plain, add_generation_prompt=True, tokenize=False)
        ids, pix, grids = self.encode(text, images)
        return TokenContext(ids=ids, prompt_len=len(ids), images=list(images), pixel_values=pix,
                            grids=grids)

    def observe(self, ctx: TokenContext, parts: list[dict], images: list[Any]) -> None:
        # Close the assistant turn as the chat template does: "<|im_end|>\n".
        closing = "\n" if ctx.ids and ctx.ids[-1] == self.im_end else "<|im_end|>\n"
        body = "".join(p["text"] if p.get("type") == "text" else VISION_PLACEHOLDER for p in parts)
        text = f"{closing}<|im_start|>user\n{body}<|im_end|>\n<|im_start|>assistant\n"
        images = self.context_images(images)
        ids, pix, grids = self.encode(text, images)
        ctx.ids += ids
        ctx.mask += [0] * len(ids)
        ctx.images += images
        ctx.pixel_values += pix
        ctx.grids += grids

    def append_generated(self, ctx: TokenContext, ids: list[int], logprobs: list[float],
                         temperatures: list[float] | None = None) -> None:
        ctx.ids += ids
        ctx.mask += [1] * len(ids)
        ctx.logprobs += logprobs
        if temperatures is not None:
            ctx.temperatures += temperatures

    def cut(self, row: list[int]) -> tuple[list[int], Finish, str]:
        """Tokens a row really generated (up to eos or the token completing ``</code>``), why it
        stopped, and its text (cut right after ``</code>``)."""
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

    def context_tokens(self, ctx: TokenContext) -> int:
        return len(ctx.ids)

    def token_counts(self, ctx: TokenContext) -> dict[str, int]:
        generated = sum(ctx.mask)
        return {"prompt": ctx.prompt_len, "generated": generated,
                "observation": len(ctx.mask) - generated,
                "visual": sum(1 for t in ctx.ids if t == self.image_token_id)}

    def trace(self, ctx: TokenContext) -> TokenTrace:
        return TokenTrace(input_ids=list(ctx.ids), prompt_len=ctx.prompt_len,
                          response_mask=list(ctx.mask), logprobs=list(ctx.logprobs),
                          images=list(ctx.images),
                          temperatures=(list(ctx.temperatures)
                                        if len(ctx.temperatures) == len(ctx.logprobs) else []))

    def end(self, ctx: TokenContext) -> None:
        ctx.pixel_values.clear()
        ctx.kv = None
