"""`pyvision run`: a recipe end to end under one run id.

Stages run in order: ``data -> sft -> rl -> merge -> eval -> report``. A stage whose manifest exists
is skipped (``--force`` redoes the stages in the selected range); ``--from`` / ``--until`` select a
range. An interrupted SFT or RL stage continues from its last checkpoint when run again.

- ``merge`` settles the final model: the RL model (a verl checkpoint is merged with verl's
  merger, its LoRA adapter too when it has one; the local engine writes a Hugging Face model, or
  with ``rl.lora`` an adapter that is merged into its base here).
- ``eval`` evaluates the base, SFT and RL models (tags ``base``, ``sft``, ``rl``) on the recipe's
  benchmarks; the synthetic held-out sets come from the data stage.
- ``report`` writes the report for this run into ``runs/<run-id>/report``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from rich.markup import escape

from pipelines.config.recipe import Recipe
from pipelines.console import err
from pipelines.errors import ConfigChanged, UserError
from pipelines.manifest import DataOutputs, MergeOutputs, RLOutputs, SFTOutputs
from pipelines.rundir import STAGES, StageDir, earlier_stages_hint, stage_dir

# Each stage is (prepare, run). ``prepare`` resolves and checks the stage's inputs before the
# stage writes anything (a missing earlier stage or a bad input is one line, with no stage folder
# or store row left behind); ``run`` does the work with what ``prepare`` returned.


def _inputs_data(recipe: Recipe, sd: StageDir) -> None:
    from pipelines.data_stage import check_data_inputs

    check_data_inputs(recipe)


def _stage_data(recipe: Recipe, sd: StageDir, show: bool, _: Any) -> dict[str, Any]:
    from pipelines.data_stage import run_data_stage

    return run_data_stage(recipe, sd, show_progress=show)["summary"]


def _inputs_sft(recipe: Recipe, sd: StageDir) -> tuple[str, str, str]:
    from pipelines.sft.stage import resolve_sft_inputs

    return resolve_sft_inputs(recipe, sd, in_run=True)


def _stage_sft(recipe: Recipe, sd: StageDir, show: bool,
               inputs: tuple[str, str, str]) -> dict[str, Any]:
    from pipelines.sft.stage import run_sft

    model, ds_dir, ds_name = inputs
    resume = (sd.path / "output").is_dir() and any((sd.path / "output").glob("checkpoint-*"))
    return run_sft(recipe, sd, model=model, dataset_dir=ds_dir, dataset=ds_name, resume=resume,
                   show_progress=show)


def _inputs_rl(recipe: Recipe, sd: StageDir) -> tuple[str, list[str]]:
    from pipelines.rl.stage import resolve_rl_inputs

    return resolve_rl_inputs(recipe, sd, in_run=True)


def _stage_rl(recipe: Recipe, sd: StageDir, show: bool,
              inputs: tuple[str, list[str]]) -> dict[str, Any]:
    from pipelines.core.checkpoints import list_checkpoints
    from pipelines.rl.stage import run_rl

    model, tasks = inputs
    # verl tracks its own checkpoints (global_step_N/ and this file) in the same folder.
    resume = bool(list_checkpoints(sd.path / "checkpoints")) or \
        (sd.path / "checkpoints" / "latest_checkpointed_iteration.txt").is_file()
    return run_rl(recipe, sd, model=model, task_dirs=tasks, resume=resume, show_progress=show)


def _inputs_merge(recipe: Recipe, sd: StageDir) -> RLOutputs:
    rl = sd.outputs_of(RLOutputs)
    if rl is None or (recipe.rl.engine != "verl" and rl.adapter is None and rl.model is None):
        raise UserError(f"run '{sd.run_id}' has no RL model to merge",
                        hint="run the rl stage first (or --from rl)")
    return rl


def _stage_merge(recipe: Recipe, sd: StageDir, show: bool, rl: RLOutputs) -> dict[str, Any]:
    if recipe.rl.engine == "verl":
        from pipelines.merge import merge_verl

        info = merge_verl(rl.checkpoints, sd.path / "model", python=recipe.rl.verl.python,
                          force=True)
        final = info["path"]
    elif rl.adapter is not None:
        from pipelines.sft.lora import merge_lora

        final = merge_lora(rl.adapter, rl.base_model, sd.path / "model", force=True)["path"]
    else:
        final = rl.model
    sd.finish({"model": final}, {"model": final})
    return {"model": final}


def models_to_evaluate(sd: StageDir) -> dict[str, str]:
    """Model tag -> path for every model the run produced (base, sft, rl)."""
    out = {}
    data = sd.outputs_of(DataOutputs)
    if data is not None and data.base_model:
        out["base"] = data.base_model
    sft = sd.outputs_of(SFTOutputs)
    if sft is not None and sft.model:
        out["sft"] = sft.model
    merged = sd.outputs_of(MergeOutputs)
    if merged is not None:
        out["rl"] = merged.model
    elif (rl := sd.outputs_of(RLOutputs)) is not None and rl.model:
        out["rl"] = rl.model
    return out


def _inputs_eval(recipe: Recipe, sd: StageDir) -> dict[str, str]:
    models = models_to_evaluate(sd)
    if not models:  # else the stage would finish having evaluated nothing, and be skipped after
        raise UserError(f"run '{sd.run_id}' has no model to evaluate: none of its data, sft, rl "
                        "or merge stages has finished",
                        hint=f"{earlier_stages_hint(sd.run_id)}, or evaluate a model folder "
                             "with `pyvision eval --model PATH`")
    for tag, path in models.items():  # all of them, before the first is evaluated
        sd.check_model(path, f"the {tag} model")
    return models


def _stage_eval(recipe: Recipe, sd: StageDir, show: bool, models: dict[str, str]) -> dict[str, Any]:
    from pipelines.eval.runner import run_eval

    data = sd.outputs_of(DataOutputs)
    data_dirs = data.heldout if data is not None else {}
    summary: dict[str, Any] = {}
    for tag, path in models.items():
        results = run_eval(recipe, model=path, model_tag=tag, benchmarks=list(recipe.eval.benchmarks),
                           run_id=sd.run_id, store=sd.store, data_dirs=data_dirs,
                           show_progress=show)
        for bench, agg in results.items():
            for metric in ("accuracy", "overall", "average"):
                if metric in agg:
                    summary[f"{tag}/{bench}/{metric}"] = agg[metric]
                    break
    sd.finish({"models": models}, summary)
    return summary


def _inputs_report(recipe: Recipe, sd: StageDir) -> None:
    store = sd.store
    if store is not None and not any(st["status"] == "done" for st in store.stages(sd.run_id)) \
            and not store.eval_sample_count(sd.run_id):
        raise UserError(f"run '{sd.run_id}' has nothing to report: none of its stages has "
                        "finished", hint=f"run the recipe first (pyvision run RECIPE --run-id "
                                         f"{sd.run_id})")


def _stage_report(recipe: Recipe, sd: StageDir, show: bool, _: Any) -> dict[str, Any]:
    from pipelines.report import write_report

    formats = [f for f in recipe.report.formats if f != "table"]
    written = write_report(sd.store, [sd.run_id], formats, sd.run_path / "report")
    sd.finish(written, {"html": written.get("html")})
    return written


STAGE_STEPS: dict[str, tuple[Callable[[Recipe, StageDir], Any], Callable[..., dict[str, Any]]]] = {
    "data": (_inputs_data, _stage_data), "sft": (_inputs_sft, _stage_sft),
    "rl": (_inputs_rl, _stage_rl), "merge": (_inputs_merge, _stage_merge),
    "eval": (_inputs_eval, _stage_eval), "report": (_inputs_report, _stage_report)}


def run_pipeline(recipe: Recipe, *, store: Any, run_id: str | None = None,
                 recipe_path: str | None = None, from_stage: str | None = None,
                 until_stage: str | None = None, force: bool = False,
                 show_progress: bool = True) -> dict[str, Any]:
    """Run the selected stages; return a summary per stage (status, seconds, key numbers)."""
    for name, value in (("--from", from_stage), ("--until", until_stage)):
        if value is not None and value not in STAGES:
            raise UserError(f"unknown stage '{value}' for {name}", hint=f"use one of {', '.join(STAGES)}")
    lo = STAGES.index(from_stage) if from_stage else 0
    hi = STAGES.index(until_stage) if until_stage else len(STAGES) - 1
    if lo > hi:
        raise UserError(f"--from {from_stage} comes after --until {until_stage}",
                        hint=f"stages run in the order {' -> '.join(STAGES)}")
    summary: dict[str, Any] = {}
    selected = STAGES[lo: hi + 1]
    if "eval" in selected:
        _check_eval_benchmarks(recipe)
    for i, stage in enumerate(selected, start=1):
        sd = stage_dir(recipe, stage, run_id, runs_dir=None, store=store, recipe_path=recipe_path)
        done = sd.finished(redo=force)
        if done is not None:
            stale = _config_drift(sd)
            note = f" (its config differs in {stale}; pass --from {stage} --force to redo)" if stale else ""
            err.print(f"[dim][{i}/{len(selected)}] {stage}: already done, skipped{escape(note)}[/]")
            summary[stage] = {"status": "skipped", **done.summary}
            continue
        prepare, run = STAGE_STEPS[stage]
        inputs = prepare(recipe, sd)
        err.rule(f"[{i}/{len(selected)}] {stage}")
        start = time.monotonic()
        with sd.running(force=force, config_hint=f"pass --from {stage} --force to redo the stage "
                        "with the new config, or --run-id NEW for a separate run"):
            result = run(recipe, sd, show_progress, inputs)
        summary[stage] = {"status": "done", "seconds": round(time.monotonic() - start, 1),
                          **{k: v for k, v in (result or {}).items()
                             if isinstance(v, (int, float, str)) and not isinstance(v, bool)}}
    return summary


def _check_eval_benchmarks(recipe: Recipe) -> None:
    """The eval stage's benchmarks, checked before the first stage: an empty or misspelt
    ``eval.benchmarks`` otherwise surfaced only once data, SFT and RL had run."""
    from benchmarks import check_benchmark_name

    if not recipe.eval.benchmarks:
        raise UserError("eval.benchmarks is empty: the eval stage has no benchmark to evaluate",
                        hint="set some, e.g. --set eval.benchmarks=[synth-image,synth-video]")
    for name in recipe.eval.benchmarks:
        try:
            check_benchmark_name(name)
        except UserError as exc:
            raise UserError(f"eval.benchmarks: {exc.message}", hint=exc.hint) from None


def _config_drift(sd: StageDir) -> str:
    """Keys whose value in the stage's stored config differs from the current recipe."""
    try:
        sd.check_same_config()
    except ConfigChanged as exc:
        return exc.shown()
    return ""
