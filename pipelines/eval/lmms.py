"""`pyvision eval --harness lmms-eval`: run lmms-eval with our agent as its model, store its results.

lmms-eval runs as a subprocess (``python -m lmms_eval --model pyvision_agent ...``), so its task
definitions and official scoring are used unchanged; its results JSON is then loaded into the store
as aggregates with ``scorer="lmms-eval"``, side by side with our own runner's numbers. The resolved
recipe is written next to lmms-eval's output and handed to the plugin, so ``--set agent.*``
overrides reach the agent inside lmms-eval too.

Scores are stored as fractions like every other score: lmms-eval's V* aggregation reports
percentages (``vstar_aggregate_results`` multiplies by 100), so ``vstar_*_acc`` values are divided
by 100; HR-Bench, MathVerse and VSI-Bench already report fractions.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pipelines.errors import SubprocessFailed, UserError

LMMS_TASKS = {"vstar": "vstar_bench", "hrbench4k": "hrbench4k", "hrbench8k": "hrbench8k",
              "mathverse": "mathverse_testmini", "vsibench": "vsibench"}
"""Our benchmark name -> lmms-eval task name (other names are passed through unchanged)."""

_PERCENT_METRICS = re.compile(r"^vstar_.*_acc$")
_ERROR_LINE = re.compile(r"^\w*(?:Error|Exception): .*$", re.MULTILINE)


def lmms_command(model: str, tasks: list[str], output: Path, *, limit: int | None = None,
                 batch_size: int = 8, include_path: str | Path | None = None,
                 recipe_file: str | Path | None = None, engine: str | None = None,
                 served_model: str | None = None, python: str | None = None) -> list[str]:
    """The lmms-eval command line that evaluates ``model`` with the ``pyvision_agent`` plugin."""
    model_args = {"pretrained": model, "recipe": recipe_file, "engine": engine,
                  "served_model": served_model}
    for key, value in model_args.items():
        # lmms-eval splits --model_args on "," and "=": such a value would be cut in two.
        if value is not None and ("," in str(value) or "=" in str(value)):
            raise UserError(f"lmms-eval cannot pass {key} '{value}' (it contains ',' or '=')",
                            hint="rename or link the path without those characters")
    # No batch_size in --model_args: lmms-eval hands --batch_size to the model's constructor
    # itself, and the keyword given twice is a TypeError.
    args = [python or sys.executable, "-m", "lmms_eval", "--model", "pyvision_agent",
            "--model_args", ",".join(f"{k}={v}" for k, v in model_args.items() if v is not None),
            "--tasks", ",".join(LMMS_TASKS.get(t, t) for t in tasks),
            "--batch_size", str(batch_size), "--output_path", str(output), "--log_samples"]
    if limit is not None:
        args += ["--limit", str(limit)]
    if include_path:
        args += ["--include_path", str(include_path)]
    return args


def parse_results(output: Path, newer_than: float = 0.0
                  ) -> tuple[dict[str, dict[str, float]], dict[str, int], dict[str, str]]:
    """From the newest lmms-eval results JSON under ``output`` (written after ``newer_than``):
    ``{task: {metric: value}}`` (fractions), ``{task: samples scored}``, ``{task: version}``."""
    files = sorted((p for p in output.rglob("*_results.json") if p.stat().st_mtime >= newer_than),
                   key=lambda p: p.stat().st_mtime)
    if not files:
        raise UserError(f"lmms-eval wrote no results JSON under {output}",
                        hint="read its log (lmms_eval.log next to the results) for the reason")
    data = json.loads(files[-1].read_text())
    results: dict[str, dict[str, float]] = {}
    for task, metrics in data.get("results", {}).items():
        for key, value in metrics.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool) and "stderr" not in key:
                metric = key.split(",")[0]
                scale = 100.0 if _PERCENT_METRICS.match(metric) else 1.0
                results.setdefault(task, {})[metric] = float(value) / scale
    counts = {task: int(n.get("effective", n.get("original", 0)))
              for task, n in data.get("n-samples", {}).items()}
    from importlib.metadata import version

    # Not the JSON's `lmms_eval_version`: lmms-eval fills it with the git sha of the working
    # directory it runs in, which is our repository, not lmms-eval.
    release = version("lmms_eval")
    versions = {task: f"lmms-eval {release}/{task} v{v}"
                for task, v in data.get("versions", {}).items()}
    return results, counts, versions


def _fresh_results(output: Path, since: float) -> bool:
    return any(p.stat().st_mtime >= since for p in output.rglob("*_results.json"))


def run_lmms_eval(model: str, benchmarks: list[str], *, run_id: str, model_tag: str, store: Any,
                  limit: int | None = None, recipe: Any = None,
                  include_path: str | Path | None = None, output: Path | None = None,
                  engine: str | None = None, served_model: str | None = None,
                  register_run: Mapping[str, Any] | None = None) -> dict[str, dict[str, float]]:
    """Run lmms-eval on ``benchmarks`` with our agent; store and return its aggregates.

    ``register_run`` upserts the run only after lmms-eval succeeded, so a failed run writes
    nothing to the store.
    """
    import yaml
    from rich.markup import escape

    from pipelines.console import err
    from pipelines.fsutil import atomic_write_text

    runs_dir = Path(recipe.runs_dir if recipe else "runs")
    out = output or runs_dir / run_id / "lmms-eval" / re.sub(r"[^A-Za-z0-9._-]+", "_", model_tag)
    out.mkdir(parents=True, exist_ok=True)
    recipe_file = None
    if recipe is not None:
        recipe_file = atomic_write_text(out / "recipe.yaml", yaml.safe_dump(
            recipe.model_dump(mode="json"), sort_keys=False)).resolve()
    batch = recipe.eval.batch_size if recipe is not None else 8
    argv = lmms_command(model, benchmarks, out, limit=limit, batch_size=batch,
                        include_path=include_path, recipe_file=recipe_file, engine=engine,
                        served_model=served_model)
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    log = out / "lmms_eval.log"
    start = time.time()
    with err.status(f"lmms-eval on {escape(', '.join(benchmarks))} (log: {escape(str(log))}) ..."), \
            open(log, "w") as fh:
        proc = subprocess.run(argv, stdout=fh, stderr=subprocess.STDOUT, env=env, check=False)
    if proc.returncode != 0 or not _fresh_results(out, start):
        # lmms-eval logs some failures (an unknown task, a model that does not load) and still
        # exits 0, so a run without a fresh results file is a failure too.
        text = log.read_text(errors="replace")
        err.print("[red]lmms-eval failed; last lines of its log:[/]")
        from rich.text import Text

        for line in text.strip().splitlines()[-15:]:  # lmms-eval colours its log (loguru)
            err.print(Text("  ") + Text.from_ansi(line))
        errors = _ERROR_LINE.findall(text)
        reason = errors[-1].strip()[:240] if errors else f"exit code {proc.returncode}"
        raise SubprocessFailed(f"lmms-eval wrote no results ({reason}); log: {log}",
                               hint="check the task names (`lmms-eval --tasks list`, "
                                    "--include-path for local tasks) and that the model loads")
    results, counts, versions = parse_results(out, newer_than=start)
    if register_run is not None:
        store.upsert_run(run_id, **register_run)
    names = {LMMS_TASKS.get(b, b): b for b in benchmarks}
    for task, metrics in results.items():
        store.set_eval_aggregate(run_id, model_tag, names.get(task, task), metrics,
                                 n=counts.get(task, 0),
                                 benchmark_version=versions.get(task, f"lmms-eval/{task}"),
                                 prompt_version="lmms-eval", scorer="lmms-eval")
    err.print(f"lmms-eval finished in {time.time() - start:.0f} s: {results}", markup=False)
    return results
