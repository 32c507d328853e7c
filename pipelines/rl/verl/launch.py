"""``pyvision rl --engine verl``: export the data, write the launch files, run verl, stream metrics.

Everything is written into ``runs/<run-id>/rl/`` first, so the run can be read, repeated by hand
(``bash launch.sh``) or started from another machine. The files, ``--dry-run``, ``--resume`` and
how metrics reach the store: docs/verl-integration.md ("launch.py").
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import stat
import subprocess
import time
from pathlib import Path
from typing import Any

import yaml

from pipelines.config.recipe import Recipe
from pipelines.errors import UserError
from pipelines.fsutil import atomic_write_text
from pipelines.rl.validation import validation_sources
from pipelines.rl.verl.overrides import (
    AGENT_LOOP_CLASS,
    AGENT_LOOP_NAME,
    REPO_ROOT,
    VerlPaths,
    render_overrides,
)
from pipelines.rundir import StageDir
from pipelines.sft import llamafactory as lf

VERL_VERSION = "0.9.1"  # the overrides, sampler hook and agent-loop API are those of this release
BACKEND_MODULES = {"vllm": "vllm", "sglang": "sglang"}
# verl's names -> the local engine's, so `pyvision report` draws both engines' curves alike.
ALIASES = {"actor/pg_loss": "loss", "actor/grad_norm": "grad_norm", "actor/entropy": "entropy"}
_PROBE = """\
import importlib.metadata as m, importlib.util as u, json, sys
def version(name):
    try:
        return m.version(name)
    except m.PackageNotFoundError:
        return None
print(json.dumps({"python": sys.version.split()[0], "verl": version("verl"),
                  "backend": u.find_spec(sys.argv[1]) is not None,
                  "transfer_queue": u.find_spec("transfer_queue") is not None}))
"""
FIX = "install verl[vllm]==0.9.1 in a GPU environment and set rl.verl.python to its python"


def _env(recipe: Recipe, paths: VerlPaths) -> dict[str, str]:
    """Variables the launch needs (the same go to Ray workers through the overrides)."""
    env = {"PYTHONPATH": str(REPO_ROOT), "VERL_FILE_LOGGER_PATH": str(paths.metrics),
           "PYVISION_VERL_RECIPE": str(paths.recipe), "TOKENIZERS_PARALLELISM": "false"}
    if recipe.rl.verl.ray_address:
        env["RAY_ADDRESS"] = recipe.rl.verl.ray_address
    return env


def launch_script(command: list[str], env: dict[str, str], run_id: str) -> str:
    lines = ["#!/usr/bin/env bash",
             f"# Written by `pyvision rl --engine verl` for run {run_id}; run again with:",
             "#   bash launch.sh",
             "set -euo pipefail",
             'cd "$(dirname "$0")"']  # verl's own outputs (hydra, tensorboard) stay in the stage
    for key, value in env.items():
        if key == "PYTHONPATH":
            lines.append(f"export PYTHONPATH={shlex.quote(value)}${{PYTHONPATH:+:$PYTHONPATH}}")
        else:
            lines.append(f"export {key}={shlex.quote(value)}")
    lines.append(f"exec {shlex.quote(command[0])} -m verl.trainer.main_ppo \\")
    args = command[3:]
    lines += [f"    {shlex.quote(a)}" + (" \\" if i < len(args) - 1 else "")
              for i, a in enumerate(args)]
    return "\n".join(lines) + "\n"


def check_interpreter(python: str, backend: str) -> dict[str, Any]:
    """What ``python`` has, checked without importing verl or the backend (seconds, not minutes)."""
    module = BACKEND_MODULES[backend]
    try:
        proc = subprocess.run([python, "-c", _PROBE, module], capture_output=True, text=True,
                              timeout=120, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise UserError(f"cannot run the verl interpreter '{python}' (rl.verl.python): {exc}",
                        hint=FIX) from None
    try:
        info = json.loads(proc.stdout.strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        raise UserError(f"the verl interpreter '{python}' (rl.verl.python) did not answer "
                        f"(exit code {proc.returncode}: {proc.stderr.strip()[-200:]})",
                        hint=FIX) from None
    if info.get("verl") is None:
        raise UserError(f"verl is not installed for '{python}' (rl.verl.python)", hint=FIX)
    if info["verl"] != VERL_VERSION:
        raise UserError(f"'{python}' has verl {info['verl']}; this launcher targets verl "
                        f"{VERL_VERSION} (its config keys and sampler hook)", hint=FIX)
    if not info.get("backend"):
        raise UserError(f"verl at '{python}' has no {module} for rl.verl.rollout_name={backend}",
                        hint=FIX if backend == "vllm" else
                        "install verl[sglang]==0.9.1 in a GPU environment and set rl.verl.python")
    if not info.get("transfer_queue"):
        raise UserError(f"verl at '{python}' lacks TransferQueue, which its v1 trainer needs",
                        hint=FIX)
    return info


def _processor(model: str) -> Any:
    """The policy's processor when it is a local folder (to count prompt tokens at export), else
    None: the agent loop still drops an over-long prompt, counted, at rollout time."""
    from pipelines.core.modeldir import has_processor

    if not has_processor(model):
        from rich.markup import escape

        from pipelines.console import err

        err.print(f"[yellow]verl export: {escape(str(model))} is not a local model folder with a processor, "
                  "so prompts are not counted here; the agent loop drops any over "
                  "rl.max_prompt_tokens (stop reason prompt_too_long)[/]")
        return None
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(model)


def _export(recipe: Recipe, sd: StageDir, paths: VerlPaths, task_dirs: list[Path],
            resume: bool, model: str) -> bool:
    """Export (or, on resume, keep) the parquet files; True when there is a validation file."""
    from pipelines.data.export_verl import export_verl

    if resume and paths.train.is_file():
        return paths.val.is_file()
    info = export_verl(task_dirs, paths.data_dir, name=paths.train.stem, agent_cfg=recipe.agent,
                       val_sources=validation_sources(recipe, sd), strict=recipe.data.strict,
                       processor=_processor(model), max_prompt_tokens=recipe.rl.max_prompt_tokens)
    if info["skipped"]:
        from rich.markup import escape

        from pipelines.console import err
        from pipelines.data.validate import skipped_rows

        err.print(f"[yellow]warning:[/] verl export "
                  f"{escape(skipped_rows(info['skipped'], info['problems']))}",
                  soft_wrap=True, highlight=False)
    if info["val"] is None:
        paths.val.unlink(missing_ok=True)  # a stale file from an earlier export
    return info["val"] is not None


def write_launch_files(recipe: Recipe, sd: StageDir, *, model: str, task_dirs: list[Path],
                       resume: bool) -> tuple[list[str], list[str], dict[str, str]]:
    """Everything ``launch.sh`` needs, written into the stage; (command, overrides, env)."""
    paths = VerlPaths(sd.path)
    sd.path.mkdir(parents=True, exist_ok=True)
    if (sd.path / "environment.json").is_file():
        sd.check_same_config()  # a begun stage: its config.yaml is the record, never rewritten
    else:
        # A dry run does not begin the stage (StageDir.begin writes config.yaml), but the agent
        # loop and the reward named in the launch files read the recipe from there.
        atomic_write_text(paths.recipe, yaml.safe_dump(recipe.model_dump(mode="json"),
                                                       sort_keys=False))
    has_val = _export(recipe, sd, paths, task_dirs, resume, model)
    atomic_write_text(paths.agent_loop, yaml.safe_dump(
        [{"name": AGENT_LOOP_NAME, "_target_": AGENT_LOOP_CLASS, "recipe": str(paths.recipe)}],
        sort_keys=False))
    # verl runs in the stage directory: a relative model or interpreter path must not change
    # meaning (abspath, not resolve: a venv's python is a symlink that must stay one).
    if Path(model).exists():
        model = os.path.abspath(model)
    python = lf.python_for(recipe.rl.verl.python)
    if os.sep in python:
        python = os.path.abspath(python)
    overrides = render_overrides(recipe, model=model, paths=paths, has_val=has_val, resume=resume)
    command = [python, "-m", "verl.trainer.main_ppo", *overrides]
    env = _env(recipe, paths)
    atomic_write_text(paths.script, launch_script(command, env, sd.run_id))
    paths.script.chmod(paths.script.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return command, overrides, env


def latest_checkpoint_step(checkpoints: Path) -> int | None:
    """The step verl last finished saving (its own tracker file), or None."""
    tracker = checkpoints / "latest_checkpointed_iteration.txt"
    try:
        return int(tracker.read_text().strip())
    except (OSError, ValueError):
        return None


def launch_verl(recipe: Recipe, sd: StageDir, *, model: str, task_dirs: list[Path],
                resume: bool = False, dry_run: bool = False,
                show_progress: bool = True) -> dict[str, Any]:
    """Write the launch files and, unless ``dry_run``, run verl; docs/verl-integration.md."""
    paths = VerlPaths(sd.path)
    if not dry_run and not resume and paths.checkpoints.exists():
        shutil.rmtree(paths.checkpoints)  # a fresh run must not leave an older run's steps behind
    command, overrides, env = write_launch_files(recipe, sd, model=model,
                                                 task_dirs=[Path(t) for t in task_dirs],
                                                 resume=resume)
    if dry_run:
        return {"command": command, "overrides": overrides, "run_dir": str(sd.path)}
    check_interpreter(command[0], recipe.rl.verl.rollout_name)
    start_step = latest_checkpoint_step(paths.checkpoints) if resume else None
    if sd.store is not None:
        sd.store.delete_metrics_after(sd.run_id, "rl", start_step if start_step is not None else -1)
    paths.metrics.unlink(missing_ok=True)  # verl's file logger starts the file afresh
    summary = _run(command, env, sd, paths, show_progress=show_progress)
    step = latest_checkpoint_step(paths.checkpoints)
    if step is None or not (paths.checkpoints / f"global_step_{step}" / "actor").is_dir():
        raise UserError(f"verl finished but left no checkpoint in {paths.checkpoints}",
                        hint=f"read {paths.log}; rl.verl.save_freq must be >= 1")
    summary.update({"checkpoint_step": step, "resumed_from": start_step})
    outputs = {"checkpoints": str(paths.checkpoints),
               "checkpoint": str(paths.checkpoints / f"global_step_{step}" / "actor"),
               "base_model": model, "launch_script": str(paths.script), "log": str(paths.log),
               "metrics": str(paths.metrics), "train_data": str(paths.train),
               "val_data": str(paths.val) if paths.val.is_file() else None}
    sd.finish(outputs, summary)
    return summary


def step_metrics(entry: dict[str, Any]) -> tuple[int, dict[str, float]] | None:
    """(step, numeric metrics) of one line of verl's file logger, with the local engine's aliases."""
    step, data = entry.get("step"), entry.get("data")
    if not isinstance(step, int) or not isinstance(data, dict):
        return None
    metrics = {k: float(v) for k, v in data.items()
               if isinstance(v, (int, float)) and not isinstance(v, bool)}
    metrics.update({alias: metrics[name] for name, alias in ALIASES.items() if name in metrics})
    return step, metrics


def _run(command: list[str], env: dict[str, str], sd: StageDir, paths: VerlPaths, *,
         show_progress: bool) -> dict[str, Any]:
    from rich.progress import (
        BarColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    from pipelines.console import err

    full_env = dict(os.environ)
    full_env.update(env)
    full_env["PYTHONPATH"] = os.pathsep.join(
        p for p in (env["PYTHONPATH"], os.environ.get("PYTHONPATH")) if p)
    state: dict[str, Any] = {"step": None, "total": None, "last": {}}
    total_re = re.compile(r"Total training steps: (\d+)")
    progress = Progress(TextColumn("[bold]RL (verl)[/]"), BarColumn(),
                        TextColumn("{task.completed}/{task.total} steps"),
                        TextColumn("{task.fields[info]}"), TimeElapsedColumn(),
                        TimeRemainingColumn(), console=err, disable=not show_progress,
                        transient=False)
    task = progress.add_task("rl", total=None, info="starting verl (Ray, model load, vLLM) ...")

    def on_line(line: str) -> None:
        match = total_re.search(line)
        if match:
            state["total"] = int(match.group(1))
            progress.update(task, total=state["total"])

    def on_log(entry: dict[str, Any]) -> None:
        parsed = step_metrics(entry)
        if parsed is None:
            return
        step, metrics = parsed
        if sd.store is not None and metrics:
            sd.store.log_metrics(sd.run_id, "rl", step, metrics)
        state["step"], state["last"] = step, metrics
        info = " ".join(f"{k}={metrics[k]:.3g}" for k in ("reward/mean", "accuracy",
                                                          "tool_calls/mean") if k in metrics)
        progress.update(task, completed=step, info=info)

    start = time.monotonic()
    with progress:
        lf.run_streaming(command, name="verl", cwd=sd.path, log_path=paths.log, env=full_env,
                         follow=paths.metrics, on_log=on_log, on_line=on_line, poll_s=1.0,
                         missing_hint=FIX,
                         failure_hint="read the log tail above; fix the recipe, data or cluster "
                                      "and re-run with --resume to continue from the last "
                                      "checkpoint")
    last = state["last"]
    return {"steps": state["step"], "total_steps": state["total"],
            "seconds": round(time.monotonic() - start, 1),
            **{k: last[k] for k in ("reward/mean", "accuracy", "tool_calls/mean") if k in last}}
