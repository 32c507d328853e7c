"""The SFT stage: inputs from the data stage, LLaMA-Factory training, metrics into the store.

Inputs come from the run's data-stage manifest (``base_model``, ``sft_dataset_dir``,
``sft_dataset_name``) unless given explicitly. Output: ``runs/<run-id>/sft/output`` (the full model,
or the LoRA adapter for ``finetuning_type: lora``; ``pyvision merge`` turns an adapter into a
model).
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Any

from pipelines.config.recipe import Recipe
from pipelines.console import err
from pipelines.errors import DataError, UserError, malformed_json
from pipelines.manifest import DataOutputs
from pipelines.rundir import StageDir, earlier_stages_hint
from pipelines.sft import llamafactory as lf

METRIC_KEYS = ("loss", "lr", "epoch", "grad_norm", "throughput", "total_tokens", "percentage")


def resolve_sft_inputs(recipe: Recipe, sd: StageDir, *, model: str | None = None,
                       dataset_dir: str | None = None, dataset: str | None = None,
                       in_run: bool = False) -> tuple[str, str, str]:
    """(model path, dataset dir, dataset name), explicit arguments first, then the data stage.
    ``in_run``: called by `pyvision run`, whose missing inputs come from its earlier stages
    (it has no --model or --dataset-dir to pass)."""
    data = sd.outputs_of(DataOutputs)
    if data is not None:
        model = model or data.base_model
        dataset_dir = dataset_dir or data.sft_dataset_dir
        dataset = dataset or data.sft_dataset_name
    model = model or (None if recipe.model.tiny else recipe.model.base)
    if not model:
        raise UserError(f"no base model for run '{sd.run_id}': the recipe builds a tiny model in "
                        "the data stage, which has not run",
                        hint=earlier_stages_hint(sd.run_id) if in_run else
                        f"run `pyvision data prepare --run-id {sd.run_id}` first, or pass "
                        "--model PATH")
    if not dataset_dir or not dataset:
        raise UserError(f"no SFT dataset for run '{sd.run_id}' (the data stage has not finished)",
                        hint=earlier_stages_hint(sd.run_id) if in_run else
                        "run the data stage first, or pass --dataset-dir DIR --dataset NAME "
                        "(a LLaMA-Factory folder with dataset_info.json)")
    from pipelines.inputs import read_json

    sd.check_model(model, "the base model")
    info = Path(dataset_dir) / "dataset_info.json"
    if not info.is_file():
        raise UserError(f"{info} {'is a folder' if info.is_dir() else 'not found'}",
                        hint="export the data with `pyvision data export --format llamafactory` "
                             "or pass the folder that holds dataset_info.json")
    names = read_json(info, "dataset index", hint="export the data again with `pyvision data "
                      "export --format llamafactory`")
    if not isinstance(names, dict):
        raise UserError(f"{info} is not a JSON object of datasets",
                        hint="export the data again with `pyvision data export --format "
                             "llamafactory`")
    if dataset not in names:
        raise UserError(f"dataset '{dataset}' is not in {info} (it has: {', '.join(names)})",
                        hint="pass --dataset with one of those names")
    _check_dataset_entry(info, dataset, names[dataset])
    # LLaMA-Factory runs in the stage's folder: a relative local path would point elsewhere
    # there (and a relative model folder would be read as a hub id).
    local = Path(model).expanduser()
    if local.exists():
        model = str(local.resolve())
    return model, str(Path(dataset_dir).expanduser().resolve()), dataset


# Where LLaMA-Factory's dataset_info.json says a dataset's rows come from.
_REMOTE_SOURCES = ("hf_hub_url", "ms_hub_url", "om_hub_url", "script_url", "cloud_file_name")


def _check_dataset_entry(info: Path, name: str, entry: object) -> None:
    """The entry names its rows' source: a ``file_name`` that exists beside ``info`` (a file or
    a folder of files), or one of LLaMA-Factory's remote sources. Checked before the stage starts,
    so a wrong name is one line, not LLaMA-Factory's error after the model has loaded."""
    fix = "export the data again with `pyvision data export --format llamafactory`"
    if not isinstance(entry, dict):
        raise UserError(f"{info}: dataset '{name}' is not an object", hint=fix)
    file_name = entry.get("file_name")
    if file_name is None:
        if not any(isinstance(entry.get(k), str) for k in _REMOTE_SOURCES):
            raise UserError(f"{info}: dataset '{name}' names no file_name (nor a hub or script "
                            "source)", hint=fix)
        return
    if not isinstance(file_name, str) or not file_name:
        raise UserError(f"{info}: dataset '{name}' has file_name {file_name!r}, not a path",
                        hint=fix)
    if not (info.parent / file_name).exists():
        raise UserError(f"{info}: dataset '{name}' names {file_name}, which is not in "
                        f"{info.parent}", hint=fix)
    if (info.parent / file_name).suffix == ".jsonl":
        _check_rows_media(info.parent / file_name, info.parent, entry.get("columns") or {})


def _check_rows_media(rows: Path, media_dir: Path, columns: dict) -> None:
    """Every image and video a JSONL dataset's rows name is in ``media_dir`` (LLaMA-Factory's
    ``media_dir``: the dataset's folder), and every row parses: an export copied without the
    trajectories it points to is one line here, not LLaMA-Factory's traceback after the model
    has loaded, with a stage folder left behind."""
    from pipelines.core.records import iter_jsonl

    keys = [columns.get(k, k) for k in ("images", "videos")]
    for number, row in iter_jsonl(rows):
        if isinstance(row, Exception):
            raise DataError(f"{rows}:{number}: {malformed_json(row)}",
                            hint="export the data again with `pyvision data export --format "
                                 "llamafactory`")
        for key in keys:
            for media in (row.get(key) or []) if isinstance(row, dict) else []:
                if isinstance(media, str) and not (media_dir / media).exists():
                    raise DataError(f"{rows}:{number} names {media}, which is not in {media_dir}",
                                    hint="copy the media it names along with the export (an "
                                         "export and the trajectories it points to move "
                                         "together), or export the data again")


def run_sft(recipe: Recipe, sd: StageDir, *, model: str, dataset_dir: str, dataset: str,
            resume: bool = False, show_progress: bool = True) -> dict[str, Any]:
    """Train with LLaMA-Factory; returns the stage summary (and writes the manifest)."""
    output_dir = sd.path / "output"
    if not resume and output_dir.exists():
        shutil.rmtree(output_dir)  # a fresh run starts clean; --resume keeps checkpoints
    ckpt = lf.last_checkpoint(output_dir) if resume and output_dir.exists() else None
    if resume and ckpt is None:
        err.print("[yellow]--resume: no checkpoint found; starting from the beginning[/]")
    elif ckpt is not None:
        err.print(f"resuming SFT from {ckpt}", markup=False)
    if sd.store is not None:
        # The steps after the checkpoint are logged again (every step when starting afresh).
        sd.store.delete_metrics_after(sd.run_id, "sft",
                                      int(ckpt.name.split("-")[-1]) if ckpt is not None else -1)
    # A full fine-tune resumes from the checkpoint's weights through from_pretrained: the
    # Trainer's own reload of them matches no tensor name under transformers 5 (a checkpoint
    # keeps the saved names) and, being lenient, went on from the base model's weights.
    weights = str(ckpt) if ckpt is not None and recipe.sft.finetuning_type == "full" else model
    yaml_path = lf.write_train_files(recipe.sft, sd.path, model_path=weights,
                                     dataset_dir=dataset_dir, dataset=dataset, resume=resume)
    trainer_log = output_dir / lf.TRAINER_LOG
    losses: list[float] = []
    state = {"step": 0, "total": 0}

    from rich.progress import (
        BarColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    progress = Progress(TextColumn("[bold]SFT[/]"), BarColumn(), TextColumn("{task.completed}/{task.total} steps"),
                        TextColumn("{task.fields[info]}"), TimeElapsedColumn(), TimeRemainingColumn(),
                        console=err, disable=not show_progress, transient=False)
    task = progress.add_task("sft", total=None, info="starting LLaMA-Factory ...")

    from pipelines.trackers import open_trackers, sft_metrics

    trackers = open_trackers(recipe, sd.run_id, "sft", runs_dir=sd.runs_dir)

    def on_log(entry: dict[str, Any]) -> None:
        step = int(entry.get("current_steps", 0))
        state["step"], state["total"] = step, int(entry.get("total_steps", 0))
        metrics = {k: entry[k] for k in METRIC_KEYS if isinstance(entry.get(k), (int, float))}
        if "loss" in metrics:
            losses.append(float(metrics["loss"]))
        if sd.store is not None and metrics:
            sd.store.log_metrics(sd.run_id, "sft", step, metrics)
        trackers.log(step, sft_metrics(metrics))
        info = " ".join(f"{k}={metrics[k]:.4g}" for k in ("loss", "lr") if k in metrics)
        progress.update(task, completed=step, total=state["total"] or None, info=info)

    start = time.monotonic()
    try:
        with progress:
            lf.run_llamafactory("train", yaml_path, python=lf.python_for(recipe.sft.python),
                                log_path=sd.path / lf.LOG_FILE, on_log=on_log,
                                trainer_log=trainer_log, skip_existing_log=resume)
    finally:
        trackers.close()
    seconds = time.monotonic() - start
    if not (output_dir / "config.json").is_file() and not (output_dir / "adapter_config.json").is_file():
        raise UserError(f"LLaMA-Factory finished but wrote no model into {output_dir}",
                        hint=f"read {sd.path / lf.LOG_FILE}")
    outputs: dict[str, Any] = {"base_model": model, "train_yaml": str(yaml_path),
                               "log": str(sd.path / lf.LOG_FILE)}
    if (output_dir / "adapter_config.json").is_file():
        # Later stages need a model, not an adapter: merge it here with LLaMA-Factory's export.
        from pipelines.sft.lora import merge_lora

        outputs["adapter"] = str(output_dir)
        outputs["model"] = merge_lora(output_dir, model, sd.path / "merged",
                                      python=recipe.sft.python, template=recipe.sft.template,
                                      force=True)["path"]
    else:
        outputs["model"] = str(output_dir)
    summary = {"steps": state["step"], "total_steps": state["total"],
               "first_loss": losses[0] if losses else None,
               "last_loss": losses[-1] if losses else None, "seconds": round(seconds, 1),
               "finetuning_type": recipe.sft.finetuning_type}
    sd.finish(outputs, summary)
    return summary
