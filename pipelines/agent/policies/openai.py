"""Any OpenAI-compatible chat endpoint (vLLM, SGLang, `transformers serve`, hosted APIs) as a
policy.

Images travel as base64 PNG data URLs. Generation stops at ``</code>``. vLLM and SGLang keep the
stop string when asked (the fields :mod:`~pipelines.agent.policies.endpoint` sends them); other
servers drop it, so a turn that stopped inside an open ``<code>`` block gets it back (vLLM's
``stop_reason`` and SGLang's ``matched_stop`` confirm it where present), and text generated past
it by a server that ignores ``stop`` is cut. Requests run concurrently up to ``concurrency`` on
daemon threads; each is retried with backoff as the client settings say, and a server that stays
down, rejects the request or returns something that is not a chat completion raises a one-line
:class:`~pipelines.errors.EndpointError`, never a hang.
"""

from __future__ import annotations

import base64
import io
import threading
from dataclasses import dataclass, field
from typing import Any

from pipelines.agent.policies.base import Generation, Sampling
from pipelines.agent.policies.chat import ChatMessages
from pipelines.agent.policies.endpoint import CLOSE_DRAIN_S, ChatClient, DaemonPool, wait_all
from pipelines.agent.protocol import CODE_STOP, stopped_inside_code, truncate_at_code_stop
from pipelines.config.client import ClientConfig

_END_MARKERS = ("<|im_end|>", "<|endoftext|>")


def image_data_url(image: Any) -> str:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


@dataclass
class _Chat:
    messages: list[dict]
    prompt_tokens: int = 0
    generated: int = 0
    observation_estimate: int = 0
    visual: int = 0
    last_prompt_tokens: int = 0
    history: list[int] = field(default_factory=list)
    billed_prompt: int = 0            # prompt tokens over every request (what a hosted API bills)
    billed_completion: int = 0
    cost: float | None = None         # summed where the server reports a cost


def _read_choice(data: dict[str, Any]) -> dict[str, Any]:
    """The parts of a chat completion the policy uses; raises on anything else (malformed)."""
    choice = data["choices"][0]
    text = choice["message"].get("content")
    if text is None:
        text = ""
    if not isinstance(text, str):
        raise TypeError("message content is not text")
    usage = data.get("usage") if isinstance(data.get("usage"), dict) else {}
    return {"text": text, "finish": choice.get("finish_reason"),
            "matched": choice.get("stop_reason") or choice.get("matched_stop"), "usage": usage,
            "cost": usage.get("cost", data.get("cost"))}


class OpenAIPolicy(ChatMessages):
    name = "openai"
    Chat = _Chat

    def __init__(self, base_url: str, model: str | None = None, *,
                 client: ClientConfig | None = None, concurrency: int = 8,
                 image_min_pixels: int = 3136, image_max_pixels: int = 2_000_000,
                 image_factor: int = 28, extra_body: dict | None = None, role: str = "model server",
                 url_hint: str | None = None, model_hint: str | None = None,
                 warn: bool = True, **client_overrides: Any) -> None:
        """``client_overrides`` (``timeout_s``, ``max_retries``, ``backoff_s``, ``server`` ...)
        replace fields of ``client``. ``model`` None: the one model the server lists."""
        cfg = client or ClientConfig()
        if client_overrides:
            cfg = ClientConfig.model_validate({**cfg.model_dump(), **client_overrides})
        kwargs = {k: v for k, v in (("url_hint", url_hint), ("model_hint", model_hint)) if v}
        self.client = ChatClient(base_url, cfg, role=role, max_connections=concurrency,
                                 warn=warn, **kwargs)
        self.url = self.client.url
        self._model = model
        self._model_lock = threading.Lock()
        self.concurrency = concurrency
        self.min_pixels = image_min_pixels
        self.max_pixels = image_max_pixels
        self.factor = image_factor
        self.extra_body = dict(extra_body or {})
        self._pool = DaemonPool(concurrency, "policy")

    @property
    def model(self) -> str:
        """The served model's name (asked from the server once when none was given)."""
        if self._model is None:
            with self._model_lock:
                if self._model is None:
                    self._model = self.client.resolve_model(None)
        return self._model

    # -- conversation state --------------------------------------------------------------------

    def image_part(self, image: Any) -> dict:
        return {"type": "image_url", "image_url": {"url": image_data_url(image)}}

    def context_tokens(self, handle: _Chat) -> int:
        return handle.last_prompt_tokens + (handle.history[-1] if handle.history else 0)

    def token_counts(self, handle: _Chat) -> dict[str, int]:
        total = self.context_tokens(handle)
        return {"prompt": handle.prompt_tokens, "generated": handle.generated,
                "observation": max(0, total - handle.prompt_tokens - handle.generated),
                "visual": handle.visual}

    def request_usage(self, handle: _Chat) -> dict[str, float]:
        """What the server counted over the episode's requests (and its cost, where reported)."""
        out: dict[str, float] = {"requests": len(handle.history),
                                 "prompt_tokens": handle.billed_prompt,
                                 "completion_tokens": handle.billed_completion}
        if handle.cost is not None:
            out["cost"] = handle.cost
        return out

    def activity(self) -> str | None:
        """A short line while the server looks stalled (for progress displays)."""
        return self.client.activity()

    def close(self, drain_s: float = CLOSE_DRAIN_S) -> None:
        """Stop waiting for the server (requests in flight give up; see ``ChatClient.close``)."""
        self.client.close(drain_s)

    # -- generation ----------------------------------------------------------------------------

    def generate(self, handles: list[_Chat], sampling: Sampling) -> list[Generation]:
        model = self.model
        return wait_all([self._pool.submit(self._one, h, sampling, model) for h in handles])

    def _one(self, handle: _Chat, sampling: Sampling, model: str) -> Generation:
        body = {"model": model, "messages": handle.messages,
                "max_tokens": sampling.max_new_tokens, "temperature": sampling.temperature,
                "top_p": sampling.top_p, "stop": [CODE_STOP], **self.extra_body}
        reply = self.client.complete(body, parse=_read_choice)
        text, reason = reply["text"], reply["finish"]
        for marker in _END_MARKERS:
            text = text.removesuffix(marker)
        if reason == "stop" and CODE_STOP not in text and (
                reply["matched"] == CODE_STOP or stopped_inside_code(text)):
            text += CODE_STOP  # the server dropped the stop string
        usage = reply["usage"]
        completion = int(usage.get("completion_tokens") or len(text) // 4)
        prompt = int(usage.get("prompt_tokens") or 0)
        if not handle.history:
            handle.prompt_tokens = prompt
        handle.last_prompt_tokens = prompt
        handle.generated += completion
        handle.billed_prompt += prompt
        handle.billed_completion += completion
        if isinstance(reply["cost"], (int, float)):
            handle.cost = (handle.cost or 0.0) + float(reply["cost"])
        handle.history.append(completion)
        if CODE_STOP in text:
            text = truncate_at_code_stop(text)
            handle.messages.append({"role": "assistant", "content": text})
            return Generation(text, "code", completion)
        handle.messages.append({"role": "assistant", "content": text})
        return Generation(text, "length" if reason == "length" else "eos", completion)
