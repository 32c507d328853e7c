"""A policy that replays given assistant turns: exact trajectories for tests and demos."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from pipelines.agent.policies.base import Generation, Sampling
from pipelines.agent.protocol import CODE_STOP, truncate_at_code_stop


@dataclass
class _Script:
    messages: list[dict]
    turn: int = 0
    generated: int = 0
    observed: int = 0
    observations: list[list[dict]] = field(default_factory=list)


class ScriptedPolicy:
    """Turn ``i`` of every episode is ``turns[i]`` (or ``turns(state)`` when callable).

    Token counts are whitespace-separated words: deterministic and good enough for tests.
    """

    name = "scripted"

    def __init__(self, turns: Sequence[str] | Callable[[_Script], str]) -> None:
        self.turns = turns

    def begin(self, messages: list[dict]) -> _Script:
        return _Script(messages=messages)

    def generate(self, handles: list[_Script], sampling: Sampling) -> list[Generation]:
        out = []
        for h in handles:
            if callable(self.turns):
                text = self.turns(h)
            else:
                text = self.turns[h.turn] if h.turn < len(self.turns) else ""
            h.turn += 1
            words = text.split()
            if len(words) > sampling.max_new_tokens:
                text = " ".join(words[: sampling.max_new_tokens])
                finish = "length"
            elif CODE_STOP in text:
                text, finish = truncate_at_code_stop(text), "code"
            else:
                finish = "eos"
            n = len(text.split())
            h.generated += n
            out.append(Generation(text=text, finish=finish, n_tokens=n))
        return out

    def observe(self, handle: _Script, parts: list[dict], images: list[Any]) -> None:
        handle.observations.append(parts)
        handle.observed += sum(len(p["text"].split()) for p in parts if p.get("type") == "text")

    def context_tokens(self, handle: _Script) -> int:
        prompt = sum(len(p["text"].split()) for m in handle.messages
                     for p in (m["content"] if isinstance(m["content"], list) else
                               [{"type": "text", "text": m["content"]}]) if p.get("type") == "text")
        return prompt + handle.generated + handle.observed

    def token_counts(self, handle: _Script) -> dict[str, int]:
        total = self.context_tokens(handle)
        return {"prompt": total - handle.generated - handle.observed,
                "generated": handle.generated, "observation": handle.observed, "visual": 0}

    def trace(self, handle: _Script) -> None:
        return None

    def end(self, handle: _Script) -> None:
        handle.observations.clear()
