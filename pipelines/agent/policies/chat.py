"""Episode state for policies that speak OpenAI-style chat messages.

The OpenAI-compatible client and in-process vLLM keep each episode as a list of chat messages and
count visual tokens with Qwen2.5-VL's resize rule; they differ only in how an image travels
(a base64 data URL over HTTP, a PIL object in-process), which each supplies as ``image_part``.
"""

from __future__ import annotations

from typing import Any


def visual_tokens_for(image: Any, min_pixels: int, max_pixels: int) -> int:
    """Tokens Qwen2.5-VL spends on ``image`` (one per 28x28 pixels after its resize rule)."""
    from pipelines.agent.prompts import smart_resize

    h, w = smart_resize(image.height, image.width, factor=28, min_pixels=min_pixels,
                        max_pixels=max_pixels)
    return (h // 28) * (w // 28)


class ChatMessages:
    """``begin`` / ``observe`` / ``trace`` / ``end`` of the Policy protocol over chat messages.

    A subclass sets ``Chat`` (its per-episode dataclass, with ``messages`` and ``visual`` fields),
    ``min_pixels`` / ``max_pixels``, and implements ``image_part``.
    """

    Chat: type
    min_pixels: int
    max_pixels: int

    def image_part(self, image: Any) -> dict:
        raise NotImplementedError

    def _convert(self, parts: list[dict], images: list[Any]) -> tuple[list[dict], int]:
        out, it, visual = [], iter(images), 0
        for p in parts:
            if p.get("type") == "text":
                out.append({"type": "text", "text": p["text"]})
            else:
                img = p["image"] if "image" in p else next(it)
                visual += visual_tokens_for(img, self.min_pixels, self.max_pixels)
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
