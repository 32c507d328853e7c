"""Agentic evaluation: the one agent loop on every sample, official scoring, DuckDB tracking.

For each benchmark: load the tasks (official Hugging Face dataset, a local copy in the same layout,
or a synthetic held-out folder), skip the samples already stored for this run and model tag
(resume), run the rest through :func:`pipelines.agent.loop.run_episodes` (image prompts for image
benchmarks; on-demand video context for video ones, or uniform frames with
``agent.video_context: uniform``), store each trajectory with its per-sample scores as soon as it
finishes, and finally store the aggregate under the metric names lmms-eval uses, with the
benchmark version, prompt version and scorer. With ``reward.judge.base_url`` set, benchmarks whose
official scorer asks an LLM (MathVerse; HR-Bench where its rules fail) ask that judge and fall back
to their rules when it does not answer; each sample records which scorer decided it, and results
built on fallbacks are marked and can be scored again later (:mod:`pipelines.eval.judging`).

Everything a user can get wrong (a missing data file, an undecodable image or video, a model
folder that does not load, a server that does not answer) is checked for every benchmark before
the first write, so such a run fails with one line and leaves the store as it was. A failure
after that point (an image that is truncated past its header, a server that dies mid-run) keeps
the samples already stored, each complete in its own transaction, and a re-run resumes from them.
"""

from __future__ import annotations

import functools
import time
from collections import deque
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.markup import escape

from pipelines.config.recipe import Recipe
from pipelines.console import StatusProgress, err
from pipelines.core.media import trajectory_media
from pipelines.core.records import Task
from pipelines.errors import DataError, EndpointError, UserError
from pipelines.eval.judging import Scoring, fallback_warning, scoring_for, store_aggregate
from pipelines.fsutil import weights_fingerprint
from pipelines.store import EvalRecord, Store

if TYPE_CHECKING:
    from benchmarks.base import Benchmark


@dataclass
class _Plan:
    name: str
    bench: Benchmark
    tasks: list[Task]
    done: set[str]
    scoring: Scoring
    stale: int = 0
    """Stored samples of this benchmark that other weights produced (evaluated again)."""

    @property
    def pending(self) -> list[Task]:
        return [t for t in self.tasks if t.id not in self.done]


def resolve_data_dir(root: str | Path, name: str) -> Path:
    """The copy of benchmark ``name`` under ``root``.

    ``root/<name>`` or ``root/<download name>`` when that folder exists (one folder holding every
    benchmark, as ``pyvision data download NAME`` lays them out under ``data/``), else ``root``
    itself (a folder holding a single benchmark).
    """
    from benchmarks import benchmark_class

    root = Path(root).expanduser()
    cls = benchmark_class(name)
    for sub in (name, cls.download_name or name):
        if (root / sub).is_dir():
            return root / sub
    return root


def check_media(name: str, tasks: list[Task]) -> None:
    """Every image and video of ``tasks`` opens (headers only; each file once), else DataError."""
    from PIL import Image

    from pipelines.agent.prompts import video_info

    seen: set[Path] = set()
    for task in tasks:
        for path in task.image_paths(Path("/")):
            if path in seen:
                continue
            seen.add(path)
            try:
                with Image.open(path) as img:
                    img.verify()
            except (Image.DecompressionBombError, OSError, SyntaxError, ValueError) as exc:
                raise DataError(f"{name} sample {task.id}: image {path} cannot be read "
                                f"({type(exc).__name__}: {exc})",
                                hint="download the benchmark again or fix that file") from None
        video = task.video_path(Path("/"))
        if video is not None and video not in seen:
            seen.add(video)
            if not video.is_file():
                raise DataError(f"{name} sample {task.id}: video {video} not found",
                                hint="copy the benchmark's videos next to its data")
            try:
                video_info(video, quiet=True)
            except DataError as exc:
                raise DataError(f"{name} sample {task.id}: {exc.message}", hint=exc.hint) from None


ENDPOINT_HINT = ("start it (e.g. `vllm serve MODEL --port 8000`) and pass its URL to --model, or "
                 "pass a local model folder")


def check_endpoint(url: str, timeout_s: float = 10.0, *, what: str = "model server",
                   hint: str = ENDPOINT_HINT,
                   not_url_hint: str = "pass the server's URL; a local model folder runs "
                                       "in-process with --engine hf") -> None:
    """Any HTTP answer from ``url`` counts as reachable; no answer at all is an EndpointError
    naming ``what`` with ``hint`` (``not_url_hint`` where ``url`` is no http(s) URL)."""
    import httpx

    if not url.startswith(("http://", "https://")):
        raise EndpointError(f"{what} {url} is not a server URL (http://HOST:PORT/v1)",
                            hint=not_url_hint)
    base = url.rstrip("/")
    if not base.endswith("/v1"):
        base += "/v1"
    try:
        httpx.get(f"{base}/models", timeout=timeout_s)
    except (httpx.HTTPError, httpx.InvalidURL) as exc:
        raise EndpointError(f"{what} {url} does not answer ({type(exc).__name__}: "
                            f"{str(exc)[:160]})", hint=hint) from None


# Recipe keys that decide what an evaluated sample is (and so its score), by section. Samples made
# with other values must not be mixed with these under one run id.
_ROLLOUT_ONLY = {"agent.max_turns_train", "agent.temperature", "agent.top_p",
                 "sandbox.isolation"}
# Keys that change how fast samples are made, and at most their float rounding as
# `eval.batch_size` does, not what is evaluated: a run may be resumed with another value.
_SPEED_ONLY = {"agent.draft_tokens", "agent.cpu_threads", "agent.share_prefixes"}


def eval_settings(config: Mapping[str, Any]) -> dict[str, Any]:
    """The evaluation-deciding keys of a resolved recipe (``agent.*`` and ``sandbox.*`` but for
    the rollout-only and speed-only ones), flattened."""
    out: dict[str, Any] = {}
    for section in ("agent", "sandbox"):
        for key, value in (config.get(section) or {}).items():
            if f"{section}.{key}" not in _ROLLOUT_ONLY | _SPEED_ONLY:
                out[f"{section}.{key}"] = value
    return out


def check_same_eval_settings(store: Store, run_id: str, recipe: Recipe) -> None:
    """Refuse to add samples to a run whose stored samples were made with other agent or
    sandbox settings (turn limit, temperature, image sizes ...): the run's results would mix
    two evaluations, and its stored config would describe only the last one."""
    if not store.eval_sample_count(run_id):
        return
    stored = store.run_config(run_id)
    if stored is None:
        return
    old = eval_settings(stored)
    new = eval_settings(recipe.model_dump(mode="json"))
    # A key added by a newer pyvision is absent from older configs; at its default it is the same.
    defaults = eval_settings(Recipe().model_dump(mode="json"))
    changed = [k for k in sorted(new) if old.get(k, defaults.get(k)) != new[k]]
    if changed:
        shown = ", ".join(f"{k} {old.get(k, defaults.get(k))!r} -> {new[k]!r}"
                          for k in changed[:3]) + (" ..." if len(changed) > 3 else "")
        raise UserError(f"run '{run_id}' holds samples evaluated with other settings ({shown})",
                        hint="pass --run-id NEW for a separate evaluation, or --force to drop "
                             "the run's stored samples and evaluate again")


def seed_eval_sampling(recipe: Recipe, engine: str | None) -> None:
    """Seed the in-process engine's sampling with ``recipe.seed`` when evaluation samples
    (``agent.eval_temperature`` > 0), so that the same seed gives the same trajectories; greedy
    decoding draws nothing, and a server samples with its own generator."""
    if recipe.agent.eval_temperature > 0 and engine != "openai":
        import torch

        torch.manual_seed(recipe.seed)


def _record(task: Task, traj: Any, scores: Any, scored_by: Any, media: Any, blobs: Any, *,
            run_id: str, model_tag: str, name: str, bench: Any, scoring: Scoring,
            fingerprint: str | None) -> EvalRecord:
    return EvalRecord(
        run_id=run_id, model=model_tag, benchmark=name, sample_id=task.id,
        benchmark_version=bench.version, prompt_version=traj.prompt_version,
        prompt_hash=traj.prompt_hash, scorer=scoring.sample_scorer(scored_by),
        scored_by=scored_by, task=task.model_dump(mode="json"),
        prediction=traj.final_answer, stop_reason=traj.stop_reason,
        turns=traj.num_turns, tool_calls=traj.tool_calls,
        failed_calls=traj.failed_calls, visual_tokens=traj.visual_tokens,
        total_tokens=(traj.prompt_tokens + traj.generated_tokens + traj.observation_tokens),
        duration_s=traj.total_s, trajectory=traj.to_json(), scores=scores,
        model_fingerprint=fingerprint, media=media, blobs=blobs)


def _write_finished(unwritten: deque, wait: bool, scoring: Scoring,
                    make: Callable[..., EvalRecord], writer: Any,
                    on_sample: Callable[[str, EvalRecord], None] | None, progress: Any) -> int:
    """Score and write the oldest samples whose thumbnails are made (all of them when
    ``wait``), in order; how many. A sample is scored just before it is written, so every
    ``on_sample`` call still comes before the next sample is scored."""
    n = 0
    while unwritten and (wait or unwritten[0][-1].done()):
        task, traj, made = unwritten.popleft()
        scores, scored_by = scoring.score(task, traj.final_answer)
        rec = make(task, traj, scores, scored_by, *made.result())
        writer.add(rec)
        n += 1
        if on_sample is not None:
            on_sample(rec.benchmark, rec)
        progress.advance()
    return n


def run_eval(recipe: Recipe, *, model: str, model_tag: str, benchmarks: list[str], run_id: str,
             store: Store, data_dirs: Mapping[str, str | Path] | None = None,
             limit: int | None = None, engine: str | None = None, base_url: str | None = None,
             served_model: str | None = None, policy: Any = None,
             show_progress: bool = True,
             on_sample: Callable[[str, EvalRecord], None] | None = None,
             register_run: Mapping[str, Any] | None = None, force: bool = False,
             on_checked: Callable[[], None] | None = None) -> dict[str, dict[str, float]]:
    """Evaluate ``model`` (tagged ``model_tag`` in the store) on ``benchmarks``; return aggregates.

    ``register_run`` (``name``, ``recipe_path``, ``config``) upserts the run in the store once
    every input has been checked, so a run that fails its checks writes nothing; it also
    refuses a run whose stored samples were made with other settings
    (:func:`check_same_eval_settings`), unless ``force``, which first forgets every evaluated
    sample of the run. ``on_checked`` is called once every input has been checked.
    """
    from pipelines.agent.loop import run_episodes
    from pipelines.agent.policies import make_policy
    from pipelines.inputs import check_model

    if not benchmarks:
        raise UserError("no benchmark to evaluate",
                        hint="pass --benchmarks NAME[,NAME...] or set eval.benchmarks")
    if register_run is not None and not force:
        check_same_eval_settings(store, run_id, recipe)
    cfg = recipe.eval
    engine = engine or cfg.engine
    limit = limit if limit is not None else cfg.limit
    judge = _judge(recipe, store)
    # Stored samples count as done only if these same weights produced them: a model folder
    # retrained in place (`pyvision rl --force`) is evaluated again, not read from the store.
    fingerprint = weights_fingerprint(model) if policy is None and engine != "openai" else None
    plans: list[_Plan] = []
    for name in dict.fromkeys(benchmarks):  # a name given twice runs once
        # The judge is part of the scorer: its model is stored with every score it decided.
        scoring = scoring_for(name, judge, recipe.reward.judge.model, recipe.reward)
        bench = scoring.bench
        data_dir = (data_dirs or {}).get(name) or cfg.data_dir
        tasks = bench.load(data_dir=data_dir, limit=limit)
        done = (set() if force else
                store.eval_sample_ids(run_id, model_tag, name, fingerprint=fingerprint))
        any_weights = (set() if force else
                       store.eval_sample_ids(run_id, model_tag, name) & {t.id for t in tasks})
        plan = _Plan(name, bench, tasks, done, scoring, stale=len(any_weights - done))
        check_media(name, plan.pending)
        plans.append(plan)
    if policy is None and any(p.pending for p in plans):
        target = base_url if engine == "openai" and base_url else model
        if engine == "openai":
            check_endpoint(target)
        else:
            check_model(target)  # one line for a folder that cannot load, before loading it
        policy = make_policy(target, engine=engine, served_model=served_model,
                             agent_cfg=recipe.agent, device=recipe.model.device,
                             dtype=recipe.model.dtype, concurrency=cfg.concurrency,
                             client=cfg.client, url_hint=ENDPOINT_HINT,
                             model_hint="pass --served-model NAME")
        if engine == "openai":
            _ = policy.model  # a server listing several models needs a name: say so before writing
    if on_checked is not None:
        on_checked()
    if force:
        store.forget_stage(run_id, "eval")
    if register_run is not None:
        store.upsert_run(run_id, **register_run)

    batch = cfg.concurrency if engine == "openai" else cfg.batch_size
    results: dict[str, dict[str, float]] = {}
    for plan in plans:
        name, bench, pending, scoring = plan.name, plan.bench, plan.pending, plan.scoring
        by_id = {t.id: t for t in plan.tasks}
        if plan.stale:
            store.forget_eval_aggregate(run_id, model_tag, name)
            err.print(f"{model_tag} on {name}: {plan.stale} stored samples came from other "
                      f"weights than {model}; evaluating them again", markup=False)
        start = time.monotonic()
        progress = StatusProgress(show_progress, f"eval {model_tag} on {name}", len(plan.tasks),
                                  len(plan.tasks) - len(pending),
                                  status=getattr(policy, "activity", None))
        writer = store.eval_writer(cfg.commit_interval_s)
        stored = 0
        # Thumbnails are made on a worker thread while the loop goes on (PIL releases the GIL);
        # records are still written in the order the trajectories finished.
        unwritten: deque[tuple[Task, Any, Future]] = deque()
        media_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="eval-media")
        make = functools.partial(_record, run_id=run_id, model_tag=model_tag, name=name,
                                 bench=bench, scoring=scoring, fingerprint=fingerprint)
        sink = (scoring, make, writer, on_sample, progress)
        seed_eval_sampling(recipe, engine)
        try:
            for traj in run_episodes([(t, Path("/")) for t in pending], policy,
                                     recipe.agent, recipe.sandbox, mode="eval", batch_size=batch):
                task = by_id[traj.task_id]
                unwritten.append((task, traj, media_pool.submit(
                    trajectory_media, task, Path("/"), traj, recipe.report.thumbnail_px)))
                stored += _write_finished(unwritten, False, *sink)
            stored += _write_finished(unwritten, True, *sink)
        except KeyboardInterrupt:  # the samples that finished are kept
            stored += _write_finished(unwritten, True, *sink)
            writer.flush()
            progress.close()
            close = getattr(policy, "close", None)
            if close is not None:
                close()
            err.print(f"[yellow]interrupted:[/] {escape(model_tag)} on {escape(name)}: kept the {stored} samples "
                      f"finished in this run; run the same command again to resume", soft_wrap=True)
            raise
        finally:
            media_pool.shutdown(wait=True)
            writer.flush()
            progress.close()
        aggregate, n_samples, scored_by = store_aggregate(store, run_id, model_tag, scoring, by_id)
        results[name] = aggregate
        elapsed = time.monotonic() - start
        head = aggregate.get(bench.primary_metric)
        if show_progress:
            rate = len(pending) / elapsed if pending and elapsed > 0 else 0.0
            judged = (f"; judge {scored_by['judge']}, rule fallback {scored_by['rule_fallback']}"
                      if scoring.probe else "")
            err.print(f"{model_tag} on {name}: {bench.primary_metric} = "
                      f"{'-' if head is None else f'{100 * head:.1f}%'} over {n_samples} samples"
                      f" ({len(pending)} new, {rate:.2f} samples/s{judged})", markup=False)
        if warning := fallback_warning(run_id, model_tag, name, scored_by):
            err.print(f"[yellow]warning:[/] {escape(warning)}", soft_wrap=True, highlight=False)
    _track(recipe, store, run_id, model_tag, results, {p.name: p.bench.primary_metric
                                                       for p in plans})
    return results


def _track(recipe: Recipe, store: Store, run_id: str, model_tag: str,
           results: dict[str, dict[str, float]], primary: dict[str, str]) -> None:
    """The aggregates to the recipe's trackers (pipelines/trackers.py), as verl's validation
    metrics: at step 0, or for the RL model at the number of RL steps the store recorded."""
    from pipelines.trackers import eval_metrics, open_trackers

    if not recipe.report.trackers or not results:
        return
    last = store.last_step(run_id, "rl") if model_tag == "rl" else None
    trackers = open_trackers(recipe, run_id, f"eval-{model_tag}")
    try:
        trackers.log(0 if last is None else last + 1, eval_metrics(results, primary))
    finally:
        trackers.close()


def _judge(recipe: Recipe, store: Store) -> Any:
    """The LLM judge of ``reward.judge`` (cached in the store), or None when none is configured."""
    if not recipe.reward.judge.base_url:
        return None
    from pipelines.scoring.judge import Judge

    return Judge(recipe.reward.judge, store=store)
