"""What the local RL engine did at each step, kept for people: rollouts and trackers.

:class:`RLObserver` is the local engine's one hook (``pipelines/rl/local.py`` calls ``step`` once
per step, after the strategy selected and the update ran, and ``close`` at the end). Per step it

- records every rollout's reward terms, advantage (against its whole group, as the strategy set
  it) and fate (kept, or dropped and why) in the store's ``rl_rollouts``, and the whole
  trajectories (with thumbnails) of a sample of groups: the ``report.rollout_groups`` highest
  ranked kept groups and as many dropped groups, in generation order (the other groups keep
  the thumbnail of their input image only). The report's "Training rollouts" tab shows them;
- sends the step's metrics to the recipe's trackers under verl's names (:mod:`pipelines.trackers`).

Recording costs a few milliseconds per trajectory kept whole (JSON and thumbnails) and one store
transaction per step.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from pipelines.core.media import thumbnail_file, trajectory_media
from pipelines.rl.strategy import Group, Rollout, broken_reason, select_groups
from pipelines.trackers import Trackers, open_trackers, rl_metrics


def _finite(x: float | None) -> float | None:
    return None if x is None or not math.isfinite(float(x)) else float(x)


def _groups(batch: Any) -> list[Group]:
    """The step's groups as the strategy saw them (rebuilt the way the engine builds them)."""
    reward_of = {id(t): r for t, r in zip(batch.trajectories, batch.rewards)}
    out = []
    for key in sorted(batch.groups):
        members = batch.groups[key]
        out.append(Group(prompt_index=key, task_id=members[0].task_id if members else "",
                         rollouts=[Rollout(reward_of[id(t)].total,
                                           broken_reason(t.stop_reason, t.final_answer),
                                           t.produced_image) for t in members]))
    return out


def classify(batch: Any, cfg: Any) -> dict[int, tuple[str, int | None, list[str]]]:
    """Group key -> (group status, rank among kept groups, each rollout's status).

    A kept group's rollouts are ``kept`` or dropped on their own (``broken:<reason>``,
    ``no_image``). A group the strategy did not keep is ``zero_variance`` or ``empty`` (every
    rollout filtered) when the filters alone drop it, else ``rank_cut`` (it passed the filters
    and lost the ranking). The filters are the strategy's own ``select_groups`` on that group."""
    kept = {g.prompt_index: (rank, set(keep)) for rank, (g, keep) in
            enumerate(batch.selection.kept)}
    out: dict[int, tuple[str, int | None, list[str]]] = {}
    for g in _groups(batch):
        if g.prompt_index in kept:
            rank, keep = kept[g.prompt_index]
            out[g.prompt_index] = ("kept", rank, [
                "kept" if i in keep else (f"broken:{r.broken}" if cfg.filter_broken and r.broken
                                          else "no_image") for i, r in enumerate(g.rollouts)])
            continue
        alone = select_groups([g], 1, cfg)
        status = "rank_cut" if alone.kept else next(
            (k for k in ("zero_variance", "empty") if alone.dropped.get(k)), "dropped")
        out[g.prompt_index] = (status, None, [status] * len(g.rollouts))
    return out


def rollout_rows(batch: Any, recipe: Any, tasks: dict[str, tuple[Any, Path]]
                 ) -> tuple[list[dict[str, Any]], list[Any]]:
    """The ``rl_rollouts`` rows of one step and the thumbnails they name."""
    cfg = recipe.rl.strategy
    fate = classify(batch, cfg)
    reward_of = {id(t): r for t, r in zip(batch.trajectories, batch.rewards)}
    groups = {g.prompt_index: g for g in _groups(batch)}
    k = recipe.report.rollout_groups
    kept_keys = [key for key, (status, _, _) in
                 sorted(fate.items(), key=lambda kv: (kv[1][1] is None, kv[1][1] or 0, kv[0]))
                 if status == "kept"][:k]
    dropped_keys = [key for key, (status, _, _) in sorted(fate.items()) if status != "kept"][:k]
    whole = set(kept_keys) | set(dropped_keys)
    rows: list[dict[str, Any]] = []
    blobs: dict[str, Any] = {}
    for key in sorted(batch.groups):
        g = groups[key]
        status, rank, each = fate[key]
        adv = g.advantages(recipe.rl.algorithm.norm_adv_by_std)
        task, root = tasks.get(g.task_id, (None, Path("/")))
        for i, t in enumerate(batch.groups[key]):
            r = reward_of[id(t)]
            row = {"group_index": key, "sample_index": i, "task_id": t.task_id,
                   "data_source": t.data_source, "group_status": status, "rank": rank,
                   "status": each[i], "reward": _finite(r.total), "accuracy": _finite(r.accuracy),
                   "tool": _finite(r.tool), "format": _finite(r.format),
                   "advantage": _finite(adv[i]), "group_mean": _finite(g.mean),
                   "group_std": _finite(g.std), "stop_reason": t.stop_reason,
                   "prediction": t.final_answer, "turns": t.num_turns,
                   "tool_calls": t.tool_calls, "visual_tokens": t.visual_tokens}
            if i == 0 and task is not None:
                row["task"] = task.model_dump(mode="json")
                if key not in whole and recipe.report.thumbnail_px > 0 and not task.video:
                    # The group's input image, for the list (each file is decoded once).
                    inputs = [thumbnail_file(p, recipe.report.thumbnail_px)
                              for p in task.image_paths(root)]
                    row["media"] = {"inputs": [b.sha256 if b else None for b in inputs],
                                    "images": []}
                    blobs.update((b.sha256, b) for b in inputs if b is not None)
            if key in whole:
                row["trajectory"] = t.to_json()
                if task is not None:
                    media, thumbs = trajectory_media(task, root, t, recipe.report.thumbnail_px)
                    row["media"] = media
                    blobs.update((b.sha256, b) for b in thumbs)
            rows.append(row)
    return rows, list(blobs.values())


class RLObserver:
    """The local engine's per-step hook: record rollouts, feed trackers (see the module)."""

    def __init__(self, recipe: Any, sd: Any, items: list[tuple[Any, Path]]) -> None:
        self.recipe, self.sd = recipe, sd
        self.tasks: dict[str, tuple[Any, Path]] = {}
        for task, root in items:
            self.tasks.setdefault(task.id, (task, Path(root)))
        self.trackers: Trackers = open_trackers(recipe, sd.run_id, "rl", runs_dir=sd.runs_dir)

    def step(self, step: int, batch: Any, metrics: dict[str, float]) -> None:
        if self.sd.store is not None:
            rows, blobs = rollout_rows(batch, self.recipe, self.tasks)
            self.sd.store.set_rollouts(self.sd.run_id, step, rows, blobs)
        if self.trackers:
            self.trackers.log(step + 1, rl_metrics(metrics, batch, self.recipe))

    def close(self) -> None:
        self.trackers.close()
