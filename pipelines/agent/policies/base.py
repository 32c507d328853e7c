"""What the agent loop needs from a model: begin an episode, generate the next turn, observe."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, Protocol

from pipelines.agent.trajectory import TokenTrace

Finish = Literal["code", "eos", "length"]


@dataclass(frozen=True)
class Sampling:
    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    # Temperature of the tokens inside a ``<code>`` block (None: ``temperature``); only
    # token-level in-process policies honour it (``decode.py``).
    code_temperature: float | None = None


@dataclass
class Generation:
    """One assistant turn."""

    text: str                      # truncated after ``</code>`` when generation stopped there
    finish: Finish                 # code: stopped at </code>; eos: end of turn; length: cut off
    n_tokens: int                  # tokens the model generated for this turn


class Policy(Protocol):
    """A model behind the agent loop. Handles are opaque per-episode states."""

    name: str

    def begin(self, messages: list[dict]) -> Any:
        """Start an episode from the first user turn (content parts; images as PIL)."""

    def generate(self, handles: list[Any], sampling: Sampling) -> list[Generation]:
        """The next assistant turn of every episode (appended to each episode's context).

        A policy may also accept ``on_done(i, generation)``, called as soon as episode ``i``'s
        turn is finished while others are still generating (the agent loop then starts that
        episode's code early); it returns the same list either way."""

    def observe(self, handle: Any, parts: list[dict], images: list[Any]) -> None:
        """Append the environment's turn (``parts`` with one image part per entry of ``images``)."""

    def context_tokens(self, handle: Any) -> int:
        """Tokens in the episode's context now."""

    def token_counts(self, handle: Any) -> dict[str, int]:
        """``prompt``, ``generated``, ``observation`` and ``visual`` token counts so far."""

    def trace(self, handle: Any) -> TokenTrace | None:
        """The exact token record (in-process policies), or None."""

    def end(self, handle: Any) -> None:
        """Release the episode's resources."""


def message_image_count(messages: list[dict]) -> int:
    return sum(1 for m in messages if isinstance(m.get("content"), list)
               for p in m["content"] if p.get("type") == "image")
