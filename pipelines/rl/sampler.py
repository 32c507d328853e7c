"""The local RL engine's prompt stream: deterministic and resumable.

A new permutation per epoch, derived from the seed and the epoch number, so a resumed run draws
the same prompts. Checkpoints (weights, optimizer, sampler, RNG state) are
:mod:`pipelines.core.checkpoints`.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field


@dataclass
class TaskSampler:
    """Draws prompts without replacement within an epoch, in a seeded order."""

    n_items: int
    seed: int
    epoch: int = 0
    position: int = 0
    _order: list[int] = field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        if self.n_items <= 0:
            raise ValueError("TaskSampler needs at least one item")
        self._order = self._permutation(self.epoch)

    def _permutation(self, epoch: int) -> list[int]:
        order = list(range(self.n_items))
        random.Random(f"{self.seed}:{epoch}").shuffle(order)
        return order

    def draw(self, k: int) -> list[int]:
        out = []
        while len(out) < k:
            if self.position >= self.n_items:
                self.epoch += 1
                self.position = 0
                self._order = self._permutation(self.epoch)
            out.append(self._order[self.position])
            self.position += 1
        return out

    def state_dict(self) -> dict[str, int]:
        return {"n_items": self.n_items, "seed": self.seed, "epoch": self.epoch,
                "position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        if state["n_items"] != self.n_items:
            raise ValueError(f"checkpoint sampled {state['n_items']} prompts, this run has "
                             f"{self.n_items}")
        self.seed, self.epoch, self.position = state["seed"], state["epoch"], state["position"]
        self._order = self._permutation(self.epoch)
