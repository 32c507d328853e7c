"""An LLM judge behind any OpenAI-compatible endpoint (the paper served Qwen2.5-72B with vLLM).

The judge is asked whether a prediction and a gold answer are consistent, with few-shot examples
for the task's family, and replies ``Judgement: 1`` or ``Judgement: 0``. Requests are bounded:
a timeout, a few retries with exponential backoff, a concurrency limit. A reply that cannot be read
counts as unavailable. When the judge is unavailable the caller falls back to the rule verifier
(``judge()`` returns None) and the fallback is counted; a judge outage never stalls training:
once a request has failed all its retries, the judge is considered down for
:data:`OUTAGE_COOLDOWN_S` and calls fall back at once (counted as ``skipped``) instead of each
paying the full retry schedule; the first call after the cool-down tries the endpoint again.
Answers are cached in the store, keyed by model and prompt. The API key is read from the
environment variable named in the config and is never logged or stored.
"""

from __future__ import annotations

import os
import re
import threading
import time
from typing import Any

from pipelines.config.reward import JudgeConfig

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
        self.url = cfg.base_url.rstrip("/")
        if not self.url.endswith("/v1"):
            self.url += "/v1"
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

    def stats(self) -> dict[str, int]:
        with self._lock:
            return dict(self._stats)

    def _count(self, key: str) -> None:
        with self._lock:
            self._stats[key] += 1

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
        import httpx

        body = {"model": self.model, "messages": [{"role": "user", "content": prompt}],
                "temperature": self.cfg.temperature, "max_tokens": 16}
        headers = {"Authorization": f"Bearer {os.environ.get(self.cfg.api_key_env, 'EMPTY')}"}
        with self._slots:
            for attempt in range(self.cfg.max_retries + 1):
                self._count("requests")
                try:
                    resp = httpx.post(f"{self.url}/chat/completions", json=body, headers=headers,
                                      timeout=self.cfg.timeout_s)
                    if resp.status_code == 200:
                        text = str(resp.json()["choices"][0]["message"]["content"] or "")
                        self._down_until = 0.0
                        return text
                except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError):
                    pass
                self._count("failures")
                if attempt < self.cfg.max_retries:
                    time.sleep(self.cfg.backoff_s * (2 ** attempt))
        self._down_until = time.monotonic() + OUTAGE_COOLDOWN_S
        return None


def _cache_key(model: str, prompt: str) -> str:
    from pipelines.store import Store

    return Store.judge_key(model, prompt)
