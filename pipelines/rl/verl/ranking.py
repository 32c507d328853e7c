"""The PyVision rollout strategy inside verl 0.9.1: oversample, filter, rank, as the v1 trainer's
custom sampler (``trainer.v1.sampler.custom_sampler``).

Why the v1 trainer's ``ReplayBuffer``, one training step round by round, the metrics, and the one
difference from the local engine (advantages over a kept group's survivors):
docs/verl-integration.md ("ranking.py").
"""

from __future__ import annotations

import math
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Any

from verl.trainer.ppo.v1.replay_buffer import ReplayBuffer

from pipelines.config.rl import StrategyConfig
from pipelines.rl.strategy import (
    Group,
    Rollout,
    Selection,
    broken_reason,
    select_groups,
    stop_rates,
)

STRATEGY_KEYS = tuple(StrategyConfig.model_fields)  # the sampler_kwargs the launcher sets from it


@dataclass
class Session:
    """One rollout of a group: its TransferQueue keys (every output of the agent loop) and what the
    strategy and the metrics need from its final output."""

    keys: list[str]
    reward: float
    extra: dict[str, Any]

    def rollout(self) -> Rollout:
        final = self.extra.get("final_answer") or None
        terms = self.extra.get("reward_extra_info") or {}
        correct = terms.get("correct")
        return Rollout(self.reward, broken_reason(self.extra.get("stop_reason") or None, final),
                       bool(self.extra.get("produced_image", True)),
                       float(correct) if correct is not None else None)


@dataclass
class GroupData:
    uid: str
    index: int
    sessions: list[Session]


@dataclass
class Choice:
    """What to train on (keys), what to remove, and the step's strategy metrics."""

    keys: list[str]
    kept_uids: list[str]
    drop_uids: set[str]
    drop_keys: list[str]
    selection: Selection
    single_rollout: int = 0
    metrics: dict[str, float] = field(default_factory=dict)


def _plain(value: Any) -> Any:
    """A python value from what TransferQueue hands back (NonTensorData, 0-d tensors, ...)."""
    value = getattr(value, "data", value)
    if hasattr(value, "numel") and value.numel() == 1:
        return value.item()
    return value


def build_groups(trajectories: dict[str, dict[str, Any]]) -> list[GroupData]:
    """Group trajectory records ``{key: {"reward", "extra_fields", "index"}}`` by uid and session.

    A session that produced several outputs is one rollout; its final output (highest index)
    carries the reward and the loop's fields, as in verl's GRPO. Groups come out ordered by
    (dataset index, uid), sessions by session id.
    """
    by_uid: dict[str, dict[int, list[tuple[int, str]]]] = defaultdict(lambda: defaultdict(list))
    for key in trajectories:
        uid, session, index = key.rsplit("_", 2)
        by_uid[uid][int(session)].append((int(index), key))
    groups = []
    for uid, sessions in by_uid.items():
        out = []
        for session in sorted(sessions):
            outputs = sorted(sessions[session])
            final = trajectories[outputs[-1][1]]
            out.append(Session([k for _, k in outputs], float(final["reward"]),
                               dict(final.get("extra_fields") or {})))
        index = int(trajectories[sessions[min(sessions)][0][1]].get("index", 0))
        groups.append(GroupData(uid, index, out))
    return sorted(groups, key=lambda g: (g.index, g.uid))


def choose(groups: list[GroupData], target: int, cfg: StrategyConfig) -> Choice:
    """Filter and rank ``groups`` with :func:`select_groups`; keep at most ``target`` groups.

    Groups that the filters would leave with a single rollout are set aside before the ranking
    (docs/verl-integration.md, "ranking.py"), so they never take a place in the batch from a
    usable group.
    """
    strategy_groups = [Group(prompt_index=i, task_id=g.uid, rollouts=[s.rollout() for s in g.sessions])
                       for i, g in enumerate(groups)]
    # First pass without a cut: what the filters leave of every group.
    filtered = select_groups(strategy_groups, len(strategy_groups), cfg)
    singles = {g.task_id for g, kept in filtered.kept if len(kept) < 2}
    ranked = select_groups([g for g in strategy_groups if g.task_id not in singles], target, cfg)
    dropped = Counter(filtered.dropped)
    dropped["rank_cut"] = ranked.dropped.get("rank_cut", 0)
    dropped["single_rollout"] = len(singles)
    selection = Selection(kept=ranked.kept, dropped=dropped, generated_groups=len(groups),
                          varying=filtered.varying)
    by_uid = {g.uid: g for g in groups}
    keys: list[str] = []
    drop_keys: list[str] = []
    kept_uids = [g.task_id for g, _ in selection.kept]
    for group, kept in selection.kept:
        for i, session in enumerate(by_uid[group.task_id].sessions):
            (keys if i in kept else drop_keys).extend(session.keys)
    metrics = selection.metrics()
    metrics["strategy/dropped_single_rollout"] = float(len(singles))
    metrics.update(rollout_metrics(groups))
    return Choice(keys, kept_uids, set(by_uid) - set(kept_uids), drop_keys, selection,
                  len(singles), metrics)


def rollout_metrics(groups: list[GroupData]) -> dict[str, float]:
    """The local engine's rollout statistics over every trajectory generated in the step."""
    sessions = [s for g in groups for s in g.sessions]
    n = max(1, len(sessions))

    def mean(values: list[float]) -> float:
        return sum(values) / n

    def term(s: Session, name: str) -> float:
        return float((s.extra.get("reward_extra_info") or {}).get(name, 0.0))

    m = {"reward/mean": mean([s.reward for s in sessions]),
         "reward/accuracy": mean([term(s, "accuracy") for s in sessions]),
         "reward/tool": mean([term(s, "tool") for s in sessions]),
         "reward/format": mean([term(s, "format") for s in sessions]),
         "accuracy": mean([term(s, "correct") for s in sessions]),
         "tool_calls/mean": mean([float(s.extra.get("tool_calls") or 0) for s in sessions]),
         "successful_calls/mean": mean([float(s.extra.get("successful_calls") or 0)
                                        for s in sessions]),
         "turns/mean": mean([float(s.extra.get("assistant_turns", s.extra.get("num_turns")) or 0)
                             for s in sessions]),
         "trajectories": float(len(sessions))}
    m.update(stop_rates([s.extra.get("stop_reason") or "unknown" for s in sessions]))
    return m


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


class PyVisionReplayBuffer(ReplayBuffer):
    """verl's sync ``ReplayBuffer`` with the PyVision strategy on the training partition.

    ``sampler_kwargs``: the :class:`~pipelines.config.rl.StrategyConfig` fields, ``gen_batch_size``
    (the dataloader fetch size, ``data.gen_batch_size``), ``max_rounds`` and ``poll_s``. The
    launcher sets them from the recipe (``pipelines/rl/verl/overrides.py``).
    """

    def __init__(self, **kwargs: Any) -> None:
        sampler_kwargs = dict(kwargs.get("sampler_kwargs") or {})
        kwargs.setdefault("poll_interval", float(sampler_kwargs.get("poll_s", 2.0)))
        super().__init__(**kwargs)
        if self.trainer_mode != "sync":
            raise ValueError(f"the PyVision sampler ranks a whole step's generation and needs "
                             f"trainer.v1.trainer_mode=sync, not {self.trainer_mode}")
        if self.refill_fn is None:
            raise ValueError("the PyVision sampler needs the trainer's refill_fn to oversample")
        self.strategy = StrategyConfig(**{k: sampler_kwargs[k] for k in STRATEGY_KEYS
                                          if k in sampler_kwargs})
        self.gen_batch_size = int(sampler_kwargs.get("gen_batch_size", 1))
        self.max_rounds = self.strategy.max_rounds
        self._cache: dict[str, GroupData] = {}
        self._step: int | None = None
        self._rounds = 0

    def _extra_prompts(self, missing: int) -> int:
        return round_up(math.ceil(self.strategy.oversample_factor * missing), self.gen_batch_size)

    def _read_groups(self, partition_id: str, uids: set[str]) -> list[GroupData]:
        """Finished groups are immutable: each is read from TransferQueue once."""
        import transfer_queue as tq

        new = uids - self._cache.keys()
        keys = [k for k in self.partitions[partition_id] if k.rsplit("_", 2)[0] in new]
        if keys:
            data = tq.kv_batch_get(keys=keys, partition_id=partition_id,
                                   select_fields=["rm_scores", "extra_fields", "index"])
            records = {
                key: {"reward": float(score.sum().item()), "extra_fields": _plain(extra),
                      "index": _plain(index)}
                for key, score, extra, index in zip(keys, list(data["rm_scores"]),
                                                    list(data["extra_fields"]),
                                                    list(data["index"]), strict=True)}
            for group in build_groups(records):
                self._cache[group.uid] = group
        return sorted((self._cache[u] for u in uids if u in self._cache),
                      key=lambda g: (g.index, g.uid))

    def sample(self, global_steps: int, partition_id: str, batch_size: int) -> tuple[Any, dict]:
        if partition_id != "train":
            return super().sample(global_steps, partition_id, batch_size)
        import transfer_queue as tq
        from transfer_queue import KVBatchMeta

        if self._step != global_steps:
            self._step, self._rounds = global_steps, 1
            extra = self._extra_prompts(batch_size) - batch_size
            if extra > 0:
                self.refill_fn(extra)
        last_debug = time.time()
        while True:
            self._sync_metadata_from_transfer_queue()
            if self.pending_keys[partition_id] or self.running_keys[partition_id]:
                last_debug = self._wait_for_next_poll(partition_id, last_debug)
                continue
            failed = set(self.failure_keys[partition_id])
            finished = set(self.finished_keys[partition_id])
            choice = choose(self._read_groups(partition_id, finished), batch_size, self.strategy)
            if len(choice.kept_uids) < batch_size and self._rounds < self.max_rounds:
                self._rounds += 1
                self.refill_fn(self._extra_prompts(batch_size - len(choice.kept_uids)))
                continue
            break
        if not choice.kept_uids:
            raise RuntimeError(
                f"step {global_steps}: no group survived the PyVision filters after "
                f"{self._rounds} generation rounds ({dict(choice.selection.dropped)}, "
                f"{choice.single_rollout} left with one rollout)",
            )
        snapshot = dict(self.partitions[partition_id])
        tq.kv_clear(partition_id=partition_id, keys=choice.kept_uids)
        self._clear_groups(partition_id, choice.drop_uids | failed)
        if choice.drop_keys:
            tq.kv_clear(partition_id=partition_id, keys=choice.drop_keys)
        for uid in [*choice.kept_uids, *choice.drop_uids, *failed]:
            self._cache.pop(uid, None)
        metrics = dict(choice.metrics)
        metrics["strategy/rounds"] = float(self._rounds)
        metrics["strategy/dropped_failed"] = float(len(failed))
        batch = KVBatchMeta(partition_id=partition_id, keys=list(choice.keys),
                            tags=[snapshot[k] for k in choice.keys])
        return batch, metrics
