"""Episode state for policies that speak OpenAI-style chat messages.

The OpenAI-compatible client and in-process vLLM keep each episode as a list of chat messages and
count visual tokens with the model's resize rule (one token per ``agent.image_factor`` square:
28 pixels for Qwen2.5-VL, 32 for Qwen3-VL); they differ only in how an image travels
(a base64 data URL over HTTP, a PIL object in-process), which each supplies as ``image_part``.
"""

from __future__ import annotations

from typing import Any


def visual_tokens_for(image: Any, min_pixels: int, max_pixels: int, factor: int = 28) -> int:
    """Tokens the model spends on ``image``: one per ``factor`` x ``factor`` pixels after its
    resize rule (Qwen2.5-VL 28, Qwen3-VL 32)."""
    from pipelines.agent.prompts import visual_tokens

    return visual_tokens(image.width, image.height, min_pixels, max_pixels, factor)


class ChatMessages:
    """``begin`` / ``observe`` / ``trace`` / ``end`` of the Policy protocol over chat messages.

    A subclass sets ``Chat`` (its per-episode dataclass, with ``messages`` and ``visual`` fields),
    ``min_pixels`` / ``max_pixels`` / ``factor``, and implements ``image_part``.
    """

    Chat: type
    min_pixels: int
    max_pixels: int
    factor: int

    def image_part(self, image: Any) -> dict:
        raise NotImplementedError

    def _convert(self, parts: list[dict], images: list[Any]) -> tuple[list[dict], int]:
        out, it, visual = [], iter(images), 0
        for p in parts:
            if p.get("type") == "text":
                out.append({"type": "text", "text": p["text"]})
            else:
                img = p["image"] if "image" in p else next(it)
                visual += visual_tokens_for(img, self.min_pixels, self.max_pixels, self.factor)
                out.append(self.image_part(img))
        return out, visual

    def begin(self, messages: list[dict]) -> Any:
        converted, visual = [], 0
        for m in messages:
            if isinstance(m["content"], str):
                converted.append(dict(m))
            else:
                content, v = self._convert(m["content"], [])
                visual += v
                converted.append({"role": m["role"], "content": content})
        return self.Chat(messages=converted, visual=visual)

    def observe(self, handle: Any, parts: list[dict], images: list[Any]) -> None:
        content, v = self._convert(parts, images)
        handle.visual += v
        handle.messages.append({"role": "user", "content": content})

    def trace(self, handle: Any) -> None:
        return None

    def end(self, handle: Any) -> None:
        handle.messages.clear()
