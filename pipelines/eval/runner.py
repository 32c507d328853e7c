"""Agentic evaluation: the one agent loop on every sample, official scoring, DuckDB tracking.

For each benchmark: load the tasks (official Hugging Face dataset, a local copy in the same layout,
or a synthetic held-out folder), skip the samples already stored for this run and model tag
(resume), run the rest through :func:`pipelines.agent.loop.run_episodes` (image prompts for image
benchmarks; on-demand video context for video ones, or uniform frames with
``agent.video_context: uniform``), store each trajectory with its per-sample scores as soon as it
finishes, and finally store the aggregate under the metric names lmms-eval uses, with the
benchmark version, prompt version and scorer.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable

from pipelines.config.recipe import Recipe
from pipelines.console import err
from pipelines.store import EvalRecord, Store


def run_eval(recipe: Recipe, *, model: str, model_tag: str, benchmarks: list[str], run_id: str,
             store: Store, data_dirs: dict[str, str | Path] | None = None,
             limit: int | None = None, engine: str | None = None, base_url: str | None = None,
             served_model: str | None = None, policy: Any = None,
             show_progress: bool = True,
             on_sample: Callable[[str, EvalRecord], None] | None = None) -> dict[str, dict[str, float]]:
    """Evaluate ``model`` (tagged ``model_tag`` in the store) on ``benchmarks``; return aggregates."""
    from benchmarks import get_benchmark
    from pipelines.agent.loop import run_episodes
    from pipelines.agent.policies import make_policy

    cfg = recipe.eval
    engine = engine or cfg.engine
    limit = limit if limit is not None else cfg.limit
    results: dict[str, dict[str, float]] = {}
    for name in benchmarks:
        bench = get_benchmark(name)
        data_dir = (data_dirs or {}).get(name) or cfg.data_dir
        tasks = bench.load(data_dir=data_dir, limit=limit)
        by_id = {t.id: t for t in tasks}
        done = store.eval_sample_ids(run_id, model_tag, name)
        pending = [t for t in tasks if t.id not in done]
        if pending and policy is None:
            target = base_url if engine == "openai" and base_url else model
            policy = make_policy(target, engine=engine, served_model=served_model,
                                 agent_cfg=recipe.agent, device=recipe.model.device,
                                 dtype=recipe.model.dtype, concurrency=cfg.concurrency)
        batch = cfg.concurrency if engine == "openai" else cfg.batch_size
        start = time.monotonic()
        progress = _Progress(show_progress, f"eval {model_tag} on {name}", len(tasks), len(done))
        for traj in run_episodes([(t, Path("/")) for t in pending], policy, recipe.agent,
                                 recipe.sandbox, mode="eval", batch_size=batch):
            task = by_id[traj.task_id]
            scores = bench.score(task, traj.final_answer)
            rec = EvalRecord(
                run_id=run_id, model=model_tag, benchmark=name, sample_id=task.id,
                benchmark_version=bench.version, prompt_version=traj.prompt_version,
                prompt_hash=traj.prompt_hash, scorer=bench.reference, prediction=traj.final_answer,
                stop_reason=traj.stop_reason, turns=traj.num_turns, tool_calls=traj.tool_calls,
                failed_calls=traj.failed_calls, visual_tokens=traj.visual_tokens,
                total_tokens=traj.prompt_tokens + traj.generated_tokens + traj.observation_tokens,
                duration_s=traj.total_s, trajectory=traj.to_json(), scores=scores)
            store.add_eval_record(rec)
            if on_sample is not None:
                on_sample(name, rec)
            progress.advance()
        progress.close()
        stored = store.eval_scores(run_id, model_tag, name)
        samples = [(by_id[sid], s) for sid, s in stored.items() if sid in by_id]
        aggregate = bench.aggregate(samples) if samples else {}
        prompt_versions = {r["prompt_version"] for r in store.eval_records(run_id, model_tag, name)}
        store.set_eval_aggregate(run_id, model_tag, name, aggregate, n=len(samples),
                                 benchmark_version=bench.version,
                                 prompt_version=",".join(sorted(prompt_versions)),
                                 scorer=bench.reference)
        results[name] = aggregate
        elapsed = time.monotonic() - start
        head = aggregate.get(bench.primary_metric)
        if show_progress:
            rate = len(pending) / elapsed if pending and elapsed > 0 else 0.0
            err.print(f"{model_tag} on {name}: {bench.primary_metric} = "
                      f"{'-' if head is None else f'{100 * head:.1f}%'} over {len(samples)} samples"
                      f" ({len(pending)} new, {rate:.2f} samples/s)")
    return results


class _Progress:
    def __init__(self, enabled: bool, label: str, total: int, done: int) -> None:
        self.enabled = enabled
        if enabled:
            from rich.progress import Progress

            self.bar = Progress(console=err, transient=True)
            self.task = self.bar.add_task(label, total=total, completed=done)
            self.bar.start()

    def advance(self) -> None:
        if self.enabled:
            self.bar.advance(self.task)

    def close(self) -> None:
        if self.enabled:
            self.bar.stop()
