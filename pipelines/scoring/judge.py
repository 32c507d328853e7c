"""An LLM judge behind any OpenAI-compatible endpoint (the paper served Qwen2.5-72B with vLLM).

The judge is asked whether a prediction and a gold answer are consistent, with few-shot examples
for the task's family, and replies ``Judgement: 1`` or ``Judgement: 0``. Requests go through the
shared client (:mod:`pipelines.agent.policies.endpoint`): a timeout, a few retries with exponential
backoff for an outage (a request the server rejects is not retried, and the server's own words
are shown once as a warning), a concurrency limit. A reply that cannot be read counts as
unavailable. When the judge is unavailable the caller falls back to the rule verifier
(``judge()`` returns None) and the fallback is counted; a judge outage never stalls training:
once a request has failed all its retries, the judge is considered down for
:data:`OUTAGE_COOLDOWN_S` and calls fall back at once (counted as ``skipped``) instead of each
paying the full retry schedule; the first call after the cool-down tries the endpoint again.
Answers are cached in the store, keyed by model and prompt. The API key is read from the
environment variable named in the config and is never logged or stored.
"""

from __future__ import annotations

import re
import threading
import time
from typing import Any

from pipelines.agent.policies.endpoint import ChatClient, v1_url
from pipelines.config.client import ClientConfig
from pipelines.config.reward import JudgeConfig
from pipelines.errors import EndpointError

FAMILY_BY_SOURCE = (
    (("vsi", "vsibench", "synth/video"), "vsi"),
    (("longvila", "long_video", "video"), "long_video"),
    (("wemath", "mathverse", "math", "geo", "mmk12", "dynamath"), "math"),
    (("chart", "ecd", "infovqa", "cosyn"), "chart"),
    (("vstar", "v*", "deepeyes", "visual_search", "mini-o3", "hrbench", "synth/image"), "visual_search"),
)

FEW_SHOT: dict[str, list[tuple[str, str, str, int]]] = {
    "visual_search": [
        ("What is the colour of the cup?\n(A) red\n(B) blue", "B", "(B) blue", 1),
        ("What is the colour of the cup?\n(A) red\n(B) blue", "red", "B", 0),
    ],
    "math": [
        ("Find x.", "x = 1/2", "\\frac{1}{2}", 1),
        ("Find the area.", "12 cm^2", "24", 0),
    ],
    "chart": [
        ("What is the value for 2019?", "about 35%", "35", 1),
        ("Which year is highest?", "2018", "2020", 0),
    ],
    "vsi": [
        ("How many chairs are in the room?", "four", "4", 1),
        ("What is the distance between the bed and the door in metres?", "3.1", "1.2", 0),
    ],
    "long_video": [
        ("What does the man do after opening the door?", "He sits down.", "sits on the sofa", 1),
        ("What colour is the car at the end?", "white", "black", 0),
    ],
    "generic": [
        ("Who is on the left?", "the dog", "a dog", 1),
        ("How many apples?", "3", "5", 0),
    ],
}

# How long a judge whose request failed every retry is left alone (see the module docstring).
OUTAGE_COOLDOWN_S = 30.0

_VERDICT_RE = re.compile(r"Judgement:\s*([01])\b", re.IGNORECASE)


def family_of(data_source: str) -> str:
    src = data_source.lower()
    for keys, family in FAMILY_BY_SOURCE:
        if any(k in src for k in keys):
            return family
    return "generic"


def judge_prompt(question: str, prediction: str, gold: str, data_source: str) -> str:
    shots = "\n\n".join(
        f"Question: {q}\nModel answer: {p}\nGround truth: {g}\nJudgement: {v}"
        for q, p, g, v in FEW_SHOT[family_of(data_source)])
    return ("Decide whether the model answer is consistent with the ground truth for the question "
            "(same meaning; equivalent numbers, units or option letters count as consistent). "
            "Reply with 'Judgement: 1' if consistent and 'Judgement: 0' otherwise.\n\n"
            f"{shots}\n\nQuestion: {question}\nModel answer: {prediction}\nGround truth: {gold}\n"
            "Judgement:")


class Judge:
    """Thread-safe judge client with a store-backed cache and fallback accounting."""

    def __init__(self, cfg: JudgeConfig, store: Any = None) -> None:
        if not cfg.base_url:
            raise ValueError("a Judge needs reward.judge.base_url")
        self.cfg = cfg
        self.model = cfg.model
        self.store = store
        self._slots = threading.Semaphore(cfg.concurrency)
        self._lock = threading.Lock()
        # The store opens one DuckDB connection per call, and DuckDB refuses to attach the same
        # file from two threads at the same moment: cache reads and writes take turns (they are
        # milliseconds; the requests themselves still run concurrently).
        self._store_lock = threading.Lock()
        self._stats = {"requests": 0, "cache_hits": 0, "failures": 0, "unreadable": 0,
                       "fallbacks": 0, "judged": 0, "skipped": 0}
        self._down_until = 0.0
        self._memory: dict[str, float] = {}
        self.last_error: str | None = None
        self._told: set[str] = set()
        self._client = ChatClient(
            cfg.base_url, ClientConfig(server="openai", timeout_s=cfg.timeout_s,
                                       max_retries=cfg.max_retries, backoff_s=cfg.backoff_s,
                                       api_key_env=cfg.api_key_env),
            role="judge", url_hint="start it (e.g. `vllm serve Qwen/Qwen2.5-72B-Instruct --port "
            "8000`) and set --set reward.judge.base_url=URL", model_hint="set --set "
            "reward.judge.model=NAME", max_connections=cfg.concurrency, warn=False,
            on_attempt=self._attempt)

    @property
    def url(self) -> str:
        return self._client.url

    @url.setter
    def url(self, value: str) -> None:
        self._client.url = v1_url(value)

    def stats(self) -> dict[str, int]:
        with self._lock:
            return dict(self._stats)

    def _count(self, key: str) -> None:
        with self._lock:
            self._stats[key] += 1

    def _attempt(self, ok: bool) -> None:
        self._count("requests")
        if not ok:
            self._count("failures")

    def judge(self, question: str, prediction: str, gold: str, data_source: str) -> float | None:
        """1.0 / 0.0 from the judge, or None when it is unavailable (caller falls back)."""
        prompt = judge_prompt(question, prediction, gold, data_source)
        key = _cache_key(self.model, prompt)
        if key in self._memory:
            self._count("cache_hits")
            return self._memory[key]
        if self.store is not None:
            with self._store_lock:
                row = self.store.judge_get(key)
            if row is not None and row["verdict"] is not None:
                self._count("cache_hits")
                self._memory[key] = row["verdict"]
                return row["verdict"]
        if time.monotonic() < self._down_until:
            self._count("skipped")
            self._count("fallbacks")
            return None
        reply = self._ask(prompt)
        if reply is None:
            self._count("fallbacks")
            return None
        match = _VERDICT_RE.search(reply)
        if not match:
            self._count("unreadable")
            self._count("fallbacks")
            return None
        verdict = float(match.group(1))
        self._count("judged")
        self._memory[key] = verdict
        if self.store is not None:
            with self._store_lock:
                self.store.judge_put(key, self.model, reply, verdict)
        return verdict

    def _ask(self, prompt: str) -> str | None:
        from pipelines.agent.policies.endpoint import Cancelled

        body = {"model": self.model, "messages": [{"role": "user", "content": prompt}],
                "temperature": self.cfg.temperature, "max_tokens": 16}
        with self._slots:
            try:
                text = self._client.complete(body, parse=_reply_text)
            except EndpointError as exc:
                self._note_failure(exc.message, exc.hint)
                self._down_until = time.monotonic() + OUTAGE_COOLDOWN_S
                return None
            except Cancelled as exc:
                self._note_failure(str(exc), None)
                self._down_until = time.monotonic() + OUTAGE_COOLDOWN_S
                return None
        self._down_until = 0.0
        return text

    def _note_failure(self, reason: str, hint: str | None) -> None:
        """Say once per distinct reason why the judge did not answer (the fallbacks are counted
        either way): an outage and a rejected request need different fixes."""
        with self._lock:
            self.last_error = reason
            if reason in self._told:
                return
            self._told.add(reason)
        from rich.markup import escape

        from pipelines.console import err

        fix = f" (fix: {hint.rstrip('. ')})" if hint else ""
        err.print(f"[yellow]warning:[/] {escape(reason.rstrip('. '))}; the rule verifiers decide "
                  f"meanwhile{escape(fix)}", soft_wrap=True, highlight=False)


def _reply_text(data: dict[str, Any]) -> str:
    text = data["choices"][0]["message"]["content"]
    if text is not None and not isinstance(text, str):
        raise TypeError("message content is not text")
    return text or ""


def _cache_key(model: str, prompt: str) -> str:
    from pipelines.store import Store

    return Store.judge_key(model, prompt)
