"""Any OpenAI-compatible chat endpoint (`vllm serve`, SGLang, hosted APIs) as a policy.

Images travel as base64 PNG data URLs. Generation stops at ``</code>``: servers strip the stop
string from the text (vLLM reports it as ``stop_reason``), so it is put back. Requests run
concurrently up to ``concurrency``; each is retried with exponential backoff on connection errors,
timeouts, 429 and 5xx, and an endpoint that stays down raises :class:`EndpointError` after a
bounded number of tries, never a hang.
"""

from __future__ import annotations

import base64
import io
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from pipelines.agent.policies.base import Generation, Sampling
from pipelines.agent.policies.chat import ChatMessages
from pipelines.agent.protocol import CODE_STOP, truncate_at_code_stop
from pipelines.errors import EndpointError

RETRY_STATUS = {408, 409, 425, 429, 500, 502, 503, 504}


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


class OpenAIPolicy(ChatMessages):
    name = "openai"
    Chat = _Chat

    def __init__(self, base_url: str, model: str, *, api_key_env: str = "OPENAI_API_KEY",
                 concurrency: int = 8, timeout_s: float = 300.0, max_retries: int = 3,
                 backoff_s: float = 1.0, image_min_pixels: int = 3136,
                 image_max_pixels: int = 2_000_000, extra_body: dict | None = None) -> None:
        self.url = base_url.rstrip("/")
        if not self.url.endswith("/v1"):
            self.url += "/v1"
        self.model = model
        self.api_key = os.environ.get(api_key_env, "EMPTY")
        self.concurrency = concurrency
        self.timeout_s = timeout_s
        self.max_retries = max_retries
        self.backoff_s = backoff_s
        self.min_pixels = image_min_pixels
        self.max_pixels = image_max_pixels
        # vLLM keeps the stop string when asked; other servers ignore the extra field.
        self.extra_body = {"include_stop_str_in_output": True, "skip_special_tokens": False,
                           **(extra_body or {})}
        self._pool = ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="policy")

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

    # -- generation ----------------------------------------------------------------------------

    def generate(self, handles: list[_Chat], sampling: Sampling) -> list[Generation]:
        futures = [self._pool.submit(self._one, h, sampling) for h in handles]
        return [f.result() for f in futures]

    def _post(self, body: dict) -> dict:
        import httpx

        last = ""
        for attempt in range(self.max_retries + 1):
            try:
                resp = httpx.post(f"{self.url}/chat/completions", json=body,
                                  headers={"Authorization": f"Bearer {self.api_key}"},
                                  timeout=self.timeout_s)
                if resp.status_code == 200:
                    return resp.json()
                last = f"HTTP {resp.status_code}: {resp.text[:200]}"
                if resp.status_code not in RETRY_STATUS:
                    break
            except (httpx.HTTPError, ValueError) as exc:
                last = f"{type(exc).__name__}: {str(exc)[:200]}"
            if attempt < self.max_retries:
                time.sleep(self.backoff_s * (2 ** attempt))
        raise EndpointError(f"policy endpoint {self.url} did not answer after "
                            f"{self.max_retries + 1} tries: {last}",
                            hint="check that the server is running and --base-url / --model "
                                 "point at it (e.g. `vllm serve MODEL --port 8000`)")

    def _one(self, handle: _Chat, sampling: Sampling) -> Generation:
        body = {"model": self.model, "messages": handle.messages,
                "max_tokens": sampling.max_new_tokens, "temperature": sampling.temperature,
                "top_p": sampling.top_p, "stop": [CODE_STOP], **self.extra_body}
        data = self._post(body)
        try:
            choice = data["choices"][0]
            text = choice["message"]["content"] or ""
        except (KeyError, IndexError, TypeError):
            raise EndpointError(f"policy endpoint {self.url} returned an unexpected body: "
                                f"{str(data)[:200]}", hint="is it an OpenAI-compatible chat "
                                "completions endpoint?") from None
        reason = choice.get("finish_reason")
        stop_reason = choice.get("stop_reason")
        if reason == "stop" and (stop_reason == CODE_STOP or (
                "<code>" in text and CODE_STOP not in text and "<answer>" not in text)):
            text += CODE_STOP
        usage = data.get("usage") or {}
        completion = int(usage.get("completion_tokens", len(text) // 4))
        prompt = int(usage.get("prompt_tokens", 0))
        if not handle.history:
            handle.prompt_tokens = prompt
        handle.last_prompt_tokens = prompt
        handle.generated += completion
        handle.history.append(completion)
        handle.messages.append({"role": "assistant", "content": text})
        if text.endswith(CODE_STOP) or CODE_STOP in text:
            return Generation(truncate_at_code_stop(text), "code", completion)
        return Generation(text, "length" if reason == "length" else "eos", completion)
