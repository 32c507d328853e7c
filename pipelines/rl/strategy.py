"""The PyVision rollout strategy: oversample, filter, rank.

Per training step the engine generates more groups than it trains on (``oversample_factor`` x
``prompts_per_step`` prompts, ``n`` rollouts each), then:

1. **Advantages on whole groups.** Each group's mean and std are computed over *all* its
   rollouts before any filtering (as the original does), so a surviving rollout keeps the
   advantage it earned against its whole group.
2. **Filter.** Groups whose rewards all agree carry no GRPO signal and are dropped
   (``zero_variance``); ``zero_variance_basis: accuracy`` compares whether each answer was right
   instead, so a group that differs only in tool or format terms is dropped too. Every selection
   counts the groups each basis would keep (``groups_varying_reward`` /
   ``groups_varying_accuracy``), whichever decides. Broken rollouts (``context_overflow``, ``image_limit``, ``malformed``)
   are dropped one by one (``broken:<reason>``), and optionally rollouts that never produced an
   image (``no_image``). A group left with no rollout is dropped (``empty``); one left with a single
   rollout is kept, because its advantage was set against the whole group and still says
   whether that answer beat the group's average.
3. **Rank.** The remaining groups are ordered by reward std (highest first; ties by prompt index,
   so the order is deterministic) and the batch is filled with the first ``prompts_per_step``
   **whole** groups: a group is never split at the cut (the original sorted trajectories, not
   groups, and unstably). Groups past the cut are counted as ``rank_cut``.

Each filter and the ranking can be switched off (:class:`StrategyConfig`) for ablations; with
ranking off, groups are taken in generation order. When too few groups survive, the engine may
generate another round (:class:`Selector`), up to a bound.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

from pipelines.config.rl import StrategyConfig

BROKEN_STOP_REASONS = {"context_overflow": "context_overflow", "image_limit": "image_limit",
                       "no_code_nor_answer": "malformed", "prompt_too_long": "prompt_too_long"}
# Broken rollouts dropped whatever ``filter_broken`` says: they have no tokens to train on.
ALWAYS_DROPPED = frozenset({"prompt_too_long"})


def stop_rates(reasons: Sequence[str | None]) -> dict[str, float]:
    """``stop/<reason>``: the fraction of trajectories that stopped for each reason, every known
    reason included (0 when none did), so each is a continuous training curve."""
    from pipelines.agent.trajectory import STOP_REASONS

    n = max(1, len(reasons))
    counts = Counter(r or "unknown" for r in reasons)
    out = {f"stop/{r}": counts.pop(r, 0) / n for r in STOP_REASONS}
    out.update({f"stop/{r}": c / n for r, c in counts.items()})
    return out


def broken_reason(stop_reason: str | None, final_answer: str | None) -> str | None:
    """Map an agent-loop stop reason to a broken-trajectory reason (None: not broken).

    Like the original, trajectories that ran out of turns or hit a tool error are not broken:
    they are legitimate (if unrewarded) behaviour.
    """
    if stop_reason in BROKEN_STOP_REASONS:
        return BROKEN_STOP_REASONS[stop_reason]
    if stop_reason == "answered" and not final_answer:
        return "malformed"
    return None


@dataclass(frozen=True)
class Rollout:
    reward: float
    broken: str | None = None
    produced_image: bool = True
    correct: float | None = None  # accuracy term (None: unknown, the reward stands in)


@dataclass
class Group:
    prompt_index: int
    task_id: str
    rollouts: list[Rollout]

    @property
    def rewards(self) -> list[float]:
        return [r.reward for r in self.rollouts]

    def varies(self, basis: str) -> bool:
        """Whether the group's rollouts differ in ``basis`` (``reward`` or ``accuracy``)."""
        values = [r.reward if basis == "reward" or r.correct is None else r.correct
                  for r in self.rollouts]
        return len(self.rollouts) > 1 and max(values) != min(values)

    @property
    def mean(self) -> float:
        return sum(self.rewards) / len(self.rollouts)

    @property
    def std(self) -> float:
        """Unbiased std (as GRPO's normalisation uses); 0 for a single rollout."""
        n = len(self.rollouts)
        if n < 2:
            return 0.0
        m = self.mean
        return math.sqrt(sum((r - m) ** 2 for r in self.rewards) / (n - 1))

    def advantages(self, norm_by_std: bool, eps: float = 1e-6) -> list[float]:
        """GRPO outcome advantages over the whole group: r - mean (divided by std + eps)."""
        m, s = self.mean, self.std
        return [(r - m) / (s + eps) if norm_by_std else r - m for r in self.rewards]


@dataclass
class Selection:
    """Kept groups with the indices of their kept rollouts, and what was dropped and why."""

    kept: list[tuple[Group, list[int]]]
    dropped: Counter = field(default_factory=Counter)
    generated_groups: int = 0
    varying: dict[str, int] = field(default_factory=dict)  # basis -> groups that vary in it

    @property
    def trajectories(self) -> int:
        return sum(len(idx) for _, idx in self.kept)

    def metrics(self, prefix: str = "strategy/") -> dict[str, float]:
        out = {f"{prefix}generated_groups": float(self.generated_groups),
               f"{prefix}kept_groups": float(len(self.kept)),
               f"{prefix}kept_trajectories": float(self.trajectories),
               f"{prefix}mean_kept_std": (sum(g.std for g, _ in self.kept) / len(self.kept)
                                          if self.kept else 0.0)}
        for reason in ("zero_variance", "empty", "rank_cut", "no_image"):
            out[f"{prefix}dropped_{reason}"] = float(self.dropped.get(reason, 0))
        for basis, count in self.varying.items():
            out[f"{prefix}groups_varying_{basis}"] = float(count)
        for reason, count in self.dropped.items():
            if reason.startswith("broken:"):
                out[f"{prefix}dropped_{reason.replace(':', '_')}"] = float(count)
        return out


def select_groups(groups: Sequence[Group], target: int, cfg: StrategyConfig) -> Selection:
    """Filter and rank ``groups``; keep at most ``target`` whole groups."""
    dropped: Counter = Counter()
    candidates: list[tuple[Group, list[int]]] = []
    for g in groups:
        if cfg.filter_zero_variance and not g.varies(cfg.zero_variance_basis):
            dropped["zero_variance"] += 1
            continue
        keep = []
        for i, r in enumerate(g.rollouts):
            if r.broken and (cfg.filter_broken or r.broken in ALWAYS_DROPPED):
                dropped[f"broken:{r.broken}"] += 1
            elif cfg.filter_no_image and not r.produced_image:
                dropped["no_image"] += 1
            else:
                keep.append(i)
        if not keep:
            dropped["empty"] += 1
            continue
        candidates.append((g, keep))
    if cfg.rank_by_std:
        candidates.sort(key=lambda c: (-c[0].std, c[0].prompt_index))
    kept = candidates[:target]
    if len(candidates) > target:
        dropped["rank_cut"] += len(candidates) - target
    varying = {basis: sum(1 for g in groups if g.varies(basis)) for basis in ("reward", "accuracy")}
    return Selection(kept=kept, dropped=dropped, generated_groups=len(groups), varying=varying)


class Selector:
    """Accumulates generated groups over rounds until enough survive the filters."""

    def __init__(self, target: int, cfg: StrategyConfig) -> None:
        self.target, self.cfg, self.max_rounds = target, cfg, cfg.max_rounds
        self.groups: list[Group] = []
        self.rounds = 0

    def add(self, groups: Sequence[Group]) -> None:
        self.groups.extend(groups)
        self.rounds += 1

    @property
    def ready(self) -> bool:
        """Enough groups survive the filters, or no more rounds are allowed."""
        if self.rounds >= self.max_rounds:
            return True
        return len(select_groups(self.groups, self.target, self.cfg).kept) >= self.target

    def select(self) -> Selection:
        return select_groups(self.groups, self.target, self.cfg)
