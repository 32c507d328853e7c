"""Metrics to TensorBoard and Weights & Biases, under the names verl uses.

The store keeps every metric under the project's own names (``pyvision report`` reads them).
When a recipe names trackers (``report.trackers: [tensorboard, wandb]``), SFT, the local RL engine
and evaluation also send their metrics there, renamed to what verl logs for the same quantity, so
a local run and an at-scale verl run (whose own ``trainer.logger`` gets the same trackers) overlay
in the tools researchers already have open:

- TensorBoard: event files under ``<runs_dir>/<run-id>/tensorboard/<stage>`` (``rl``, ``sft``,
  ``eval-<model>``); ``tensorboard --logdir runs`` shows every run and stage. Written with
  TensorBoard's own writer (no torch or TensorFlow needed).
- Weights & Biases: one W&B run per stage (``<run-id>/<stage>``, grouped by run id) under
  ``<runs_dir>/<run-id>/wandb``, offline by default (``report.wandb_mode``): nothing leaves the
  machine until ``wandb sync``.

Names. RL (local engine), per step, with verl's step numbering (the first step is 1):

==============================================  =================================================
verl name                                       local engine source
==============================================  =================================================
``critic/score/{mean,max,min}``                 reward of the trajectories trained on (kept)
``critic/rewards/*``                            the same (no KL in the reward, as in the paper)
``critic/advantages/*``, ``critic/returns/*``   GRPO advantages of the kept trajectories, over
                                                their model tokens (returns equal advantages)
``response_length/{mean,max,min}``              kept trajectories: model and interpreter tokens
                                                after the prompt (verl's response)
``prompt_length/{mean,max,min}``                kept trajectories' prompt tokens
``num_turns/{mean,max,min}``                    messages: prompt, assistant and interpreter turns
``actor/pg_clipfrac``, ``actor/ppo_kl``,        ``train/*`` (verl's own loss functions)
``actor/pg_clipfrac_lower``
``actor/pg_loss``                               ``train/loss`` when it is the policy loss alone
                                                (no KL or entropy term), else not sent
``actor/kl_loss``, ``actor/grad_norm``,         ``train/kl``, ``grad_norm``, ``entropy``,
``actor/entropy``, ``actor/lr``                 ``rl.learning_rate``
``timing_s/gen``, ``timing_s/reward``,          ``time/generation_s``, ``time/reward_s``,
``timing_s/update_actor``, ``timing_s/step``    ``time/train_s``, rollout + update
``perf/total_num_tokens``                       ``train/tokens``
==============================================  =================================================

The local engine's other metrics (``reward/*``, ``accuracy``, ``strategy/*``, ``stop/*``,
``tool_calls/mean``, ...) go under their own names, as verl runs log them through our sampler and
reward. Its own ``response_length/mean`` (model tokens of every trajectory) is not sent: verl's
name means something else.

SFT: ``train/loss``, ``train/lr``, ``train/grad_norm``, ``train/epoch`` (verl's SFT trainer's
names), at LLaMA-Factory's step. Evaluation: ``val-core/<benchmark>/acc/mean@1`` (the primary
metric) and ``val-aux/<benchmark>/<metric>/mean@1`` (the others), as verl's validation names
them, at step 0, or for the RL model at the number of RL steps (verl validates the trained model
at its last step).
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from pipelines.errors import UserError

RL_RENAMES = {
    "train/pg_clipfrac": "actor/pg_clipfrac",
    "train/ppo_kl": "actor/ppo_kl",
    "train/pg_clipfrac_lower": "actor/pg_clipfrac_lower",
    "train/kl": "actor/kl_loss",
    "grad_norm": "actor/grad_norm",
    "entropy": "actor/entropy",
    "time/generation_s": "timing_s/gen",
    "time/reward_s": "timing_s/reward",
    "time/train_s": "timing_s/update_actor",
    "train/tokens": "perf/total_num_tokens",
}
RL_NOT_SENT = {"response_length/mean", "train/loss"}
SFT_RENAMES = {"loss": "train/loss", "lr": "train/lr", "grad_norm": "train/grad_norm",
               "epoch": "train/epoch"}


def _stats(prefix: str, values: list[float], weights: list[float] | None = None
           ) -> dict[str, float]:
    if not values:
        return {}
    if weights is not None and sum(weights) > 0:
        mean = sum(v * w for v, w in zip(values, weights)) / sum(weights)
    else:
        mean = sum(values) / len(values)
    return {f"{prefix}/mean": mean, f"{prefix}/max": max(values), f"{prefix}/min": min(values)}


def rl_metrics(metrics: Mapping[str, float], batch: Any, recipe: Any) -> dict[str, float]:
    """One local RL step's metrics under verl's names (see the module docstring)."""
    alg = recipe.rl.algorithm
    out: dict[str, float] = {}
    for name, value in metrics.items():
        if name in RL_NOT_SENT:
            continue
        out[RL_RENAMES.get(name, name)] = value
    if "train/loss" in metrics and alg.kl_coef == 0 and alg.entropy_coef == 0:
        out["actor/pg_loss"] = metrics["train/loss"]
    out["actor/lr"] = recipe.rl.learning_rate
    out["timing_s/step"] = metrics.get("time/rollout_s", 0.0) + metrics.get("time/train_s", 0.0)
    reward_of = {id(t): r.total for t, r in zip(batch.trajectories, batch.rewards)}
    kept: list[tuple[Any, float]] = []
    for group, keep in batch.selection.kept:
        adv = group.advantages(alg.norm_adv_by_std)
        members = batch.groups[group.prompt_index]
        kept += [(members[i], adv[i]) for i in keep]
    if kept:
        trajs = [t for t, _ in kept]
        scores = [reward_of[id(t)] for t in trajs]
        out.update(_stats("critic/score", scores))
        out.update(_stats("critic/rewards", scores))
        tokens = [float(t.generated_tokens) for t in trajs]
        advs = [a for _, a in kept]
        out.update(_stats("critic/advantages", advs, tokens))
        out.update(_stats("critic/returns", advs, tokens))
        out.update(_stats("response_length", [float(t.generated_tokens + t.observation_tokens)
                                              for t in trajs]))
        out.update(_stats("prompt_length", [float(t.prompt_tokens) for t in trajs]))
        out.update(_stats("num_turns", [float(1 + t.num_turns + sum(
            turn.observation is not None for turn in t.turns)) for t in trajs]))
    return out


def sft_metrics(metrics: Mapping[str, float]) -> dict[str, float]:
    """LLaMA-Factory's log entries under verl's SFT names (others keep theirs under train/)."""
    return {SFT_RENAMES.get(k, f"train/{k}"): v for k, v in metrics.items()}


def eval_metrics(results: Mapping[str, Mapping[str, float]],
                 primary: Mapping[str, str]) -> dict[str, float]:
    """Per-benchmark aggregates as verl's validation metrics (``primary``: benchmark -> its
    primary metric)."""
    out: dict[str, float] = {}
    for bench, agg in results.items():
        for metric, value in agg.items():
            if metric == primary.get(bench):
                out[f"val-core/{bench}/acc/mean@1"] = value
            else:
                out[f"val-aux/{bench}/{metric}/mean@1"] = value
    return out


class _TensorBoard:
    def __init__(self, logdir: Path) -> None:
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        logdir.mkdir(parents=True, exist_ok=True)
        self.writer = EventFileWriter(str(logdir))

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        from tensorboard.compat.proto.event_pb2 import Event
        from tensorboard.compat.proto.summary_pb2 import Summary

        values = [Summary.Value(tag=k, simple_value=float(v)) for k, v in sorted(metrics.items())]
        self.writer.add_event(Event(step=int(step), wall_time=time.time(),
                                    summary=Summary(value=values)))
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class _WandB:
    def __init__(self, directory: Path, *, project: str, name: str, group: str, job_type: str,
                 mode: str, config: Mapping[str, Any] | None) -> None:
        import os

        import wandb

        directory.mkdir(parents=True, exist_ok=True)
        # WANDB_MODE=disabled (the test suite's setting, or a user's) still wins over the recipe.
        if os.environ.get("WANDB_MODE") == "disabled":
            mode = "disabled"
        try:
            self.run = wandb.init(project=project, name=name, group=group, job_type=job_type,
                                  dir=str(directory.parent), mode=mode, config=dict(config or {}),
                                  reinit="create_new")
        except Exception as exc:  # noqa: BLE001 - wandb raises its own types (login, network)
            raise UserError(f"Weights & Biases did not start ({type(exc).__name__}: "
                            f"{str(exc).splitlines()[0] if str(exc) else ''})",
                            hint="use report.wandb_mode=offline (the default), log in with "
                                 "`wandb login`, or drop wandb from report.trackers") from None

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        self.run.log(dict(metrics), step=int(step))

    def close(self) -> None:
        import wandb

        self.run.finish()
        # finish() can return before W&B's service has written the run file; tearing the
        # service down flushes it, so a finished stage leaves complete files (measured: 10 ms).
        # Stages open and close their trackers one after the other, never two at once.
        wandb.teardown()


class Trackers:
    """The trackers a recipe names, for one stage of one run; ``log`` and ``close`` do nothing
    when it names none. Non-finite values are left out (TensorBoard and W&B plot them as gaps
    anyway, and the store keeps them as NULL)."""

    def __init__(self, backends: Iterable[Any] = ()) -> None:
        self.backends = list(backends)
        self.last_step: int | None = None

    def __bool__(self) -> bool:
        return bool(self.backends)

    def log(self, step: int, metrics: Mapping[str, float | int | None]) -> None:
        clean = {k: float(v) for k, v in metrics.items()
                 if v is not None and not isinstance(v, bool) and math.isfinite(float(v))}
        if not self.backends or not clean:
            return
        # W&B refuses a step lower than one it has seen (a resumed stage re-logs some steps).
        if self.last_step is not None and step < self.last_step:
            return
        self.last_step = step
        for b in self.backends:
            b.log(step, clean)

    def close(self) -> None:
        for b in self.backends:
            b.close()
        self.backends = []


def tracker_dir(runs_dir: str | Path, run_id: str) -> Path:
    return Path(runs_dir).resolve() / run_id


def open_trackers(recipe: Any, run_id: str, stage: str, *, runs_dir: str | Path | None = None
                  ) -> Trackers:
    """The trackers of ``recipe.report.trackers`` for ``stage`` (e.g. ``rl``, ``eval-sft``)."""
    cfg = recipe.report
    if not cfg.trackers:
        return Trackers()
    root = tracker_dir(runs_dir if runs_dir is not None else recipe.runs_dir, run_id)
    backends: list[Any] = []
    try:
        if "tensorboard" in cfg.trackers:
            backends.append(_TensorBoard(root / "tensorboard" / stage))
        if "wandb" in cfg.trackers:
            backends.append(_WandB(root / "wandb", project=cfg.wandb_project, name=f"{run_id}/{stage}",
                                   group=run_id, job_type=stage, mode=cfg.wandb_mode,
                                   config=recipe.model_dump(mode="json")))
    except BaseException:
        for b in backends:
            b.close()
        raise
    return Trackers(backends)


def verl_tracker_env(recipe: Any, run_id: str, runs_dir: str | Path) -> dict[str, str]:
    """Environment for verl's own trackers (its ``trainer.logger`` gets the same names): the same
    folders as the local engine's."""
    cfg = recipe.report
    root = tracker_dir(runs_dir, run_id)
    env: dict[str, str] = {}
    if "tensorboard" in cfg.trackers:
        env["TENSORBOARD_DIR"] = str(root / "tensorboard" / "rl")
    if "wandb" in cfg.trackers:
        env.update({"WANDB_MODE": cfg.wandb_mode, "WANDB_DIR": str(root)})
    return env
