"""SFT through LLaMA-Factory, run as a subprocess under a configurable interpreter.

We render LLaMA-Factory's own training YAML from the recipe and call
``<python> -m llamafactory.cli train <yaml>``, so a GPU cluster can keep LLaMA-Factory in its own
environment (``sft.python``) and several GPUs go through LLaMA-Factory's launcher (torchrun),
exactly as ``llamafactory-cli train`` would. The rendered YAML stays in the run directory: the run
can be repeated by hand with ``llamafactory-cli train <run>/sft/llamafactory_train.yaml``.

Progress comes from LLaMA-Factory's ``trainer_log.jsonl`` (one JSON line per logging step), which
is tailed while the subprocess runs; every numeric field of every line goes into the store.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from pipelines.config.sft import SFTConfig
from pipelines.errors import SubprocessFailed, UserError
from pipelines.fsutil import atomic_write_json, atomic_write_text

TRAIN_YAML = "llamafactory_train.yaml"
EXPORT_YAML = "llamafactory_export.yaml"
LOG_FILE = "llamafactory.log"
TRAINER_LOG = "trainer_log.jsonl"
LOG_TAIL_LINES = 25

# ZeRO configs equivalent to LLaMA-Factory's examples/deepspeed/*.json (its pip package does not
# ship them); "auto" values are filled in by the HF trainer integration.
_DS_BASE: dict[str, Any] = {
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "zero_allow_untested_optimizer": True,
    "fp16": {"enabled": "auto", "loss_scale": 0, "loss_scale_window": 1000,
             "initial_scale_power": 16, "hysteresis": 2, "min_loss_scale": 1},
    "bf16": {"enabled": "auto"},
}
_DS_ZERO: dict[str, dict[str, Any]] = {
    "z2": {"stage": 2, "allgather_partitions": True, "allgather_bucket_size": 5e8,
           "overlap_comm": False, "reduce_scatter": True, "reduce_bucket_size": 5e8,
           "contiguous_gradients": True, "round_robin_gradients": True},
    "z3": {"stage": 3, "overlap_comm": False, "contiguous_gradients": True, "sub_group_size": 1e9,
           "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
           "stage3_param_persistence_threshold": "auto", "stage3_max_live_parameters": 1e9,
           "stage3_max_reuse_distance": 1e9, "stage3_gather_16bit_weights_on_model_save": True},
}
_DS_ZERO["z3_offload"] = {**_DS_ZERO["z3"],
                          "offload_optimizer": {"device": "cpu", "pin_memory": True},
                          "offload_param": {"device": "cpu", "pin_memory": True}}


def deepspeed_config(kind: str) -> dict[str, Any]:
    """The DeepSpeed JSON for ``z2`` / ``z3`` / ``z3_offload``."""
    return {**_DS_BASE, "zero_optimization": dict(_DS_ZERO[kind])}


def render_train_config(cfg: SFTConfig, *, model_path: str, dataset_dir: str, dataset: str,
                        output_dir: str, media_dir: str | None = None,
                        deepspeed_path: str | None = None, resume: bool = False) -> dict[str, Any]:
    """LLaMA-Factory's training arguments for this recipe (the YAML's content, in order)."""
    out: dict[str, Any] = {
        "### model": None,
        "model_name_or_path": model_path,
        "trust_remote_code": True,
        "image_max_pixels": cfg.image_max_pixels,
        "image_min_pixels": cfg.image_min_pixels,
        "video_max_pixels": cfg.video_max_pixels,
        "video_fps": cfg.video_fps,
        "video_maxlen": cfg.video_maxlen,
        "### method": None,
        "stage": "sft",
        "do_train": True,
        "finetuning_type": cfg.finetuning_type,
        "freeze_vision_tower": cfg.freeze_vision_tower,
        "freeze_multi_modal_projector": cfg.freeze_multi_modal_projector,
    }
    if cfg.finetuning_type == "lora":
        out.update({"lora_rank": cfg.lora.rank, "lora_alpha": cfg.lora.alpha,
                    "lora_dropout": cfg.lora.dropout, "lora_target": cfg.lora.target})
    if deepspeed_path:
        out["deepspeed"] = deepspeed_path
    out.update({
        "### dataset": None,
        "dataset": dataset,
        "dataset_dir": dataset_dir,
        "media_dir": media_dir or dataset_dir,
        "template": cfg.template,
        "cutoff_len": cfg.cutoff_len,
        "overwrite_cache": True,
        "preprocessing_num_workers": 1 if cfg.use_cpu else 16,
        "dataloader_num_workers": 0 if cfg.use_cpu else 4,
        "### output": None,
        "output_dir": output_dir,
        "logging_steps": cfg.logging_steps,
        "save_steps": cfg.save_steps,
        "plot_loss": False,
        # False lets LLaMA-Factory pick up the last checkpoint-N in output_dir (our --resume).
        "overwrite_output_dir": not resume,
        "save_only_model": False,
        "report_to": "none",
        "### train": None,
        "per_device_train_batch_size": cfg.per_device_train_batch_size,
        "gradient_accumulation_steps": cfg.gradient_accumulation_steps,
        "learning_rate": cfg.learning_rate,
        "num_train_epochs": cfg.num_train_epochs,
        "lr_scheduler_type": cfg.lr_scheduler_type,
        "warmup_ratio": cfg.warmup_ratio,
        "bf16": cfg.precision == "bf16",
        "fp16": cfg.precision == "fp16",
        "seed": cfg.seed,
        "ddp_timeout": 180000000,
    })
    if cfg.max_steps > 0:
        out["max_steps"] = cfg.max_steps
    if cfg.use_cpu:
        out["use_cpu"] = True
    if not cfg.gradient_checkpointing:
        out["disable_gradient_checkpointing"] = True
    for key, value in cfg.extra.items():
        out[key] = value
    return out


def config_to_yaml(config: Mapping[str, Any]) -> str:
    """YAML with the ``### section`` markers LLaMA-Factory's examples use, as comments."""
    lines = ["# Rendered by `pyvision sft` from the recipe; run again by hand with:",
             f"#   llamafactory-cli train {TRAIN_YAML}"]
    for key, value in config.items():
        if key.startswith("###"):
            lines.append("")
            lines.append(key)
            continue
        lines.append(yaml.safe_dump({key: value}, default_flow_style=True, width=10_000).strip()
                     .removeprefix("{").removesuffix("}"))
    return "\n".join(lines) + "\n"


def python_for(cfg_python: str) -> str:
    """The interpreter for a stage: ``python`` means the one running pyvision."""
    return sys.executable if cfg_python in ("python", "") else cfg_python


@dataclass
class TrainResult:
    steps: int
    total_steps: int
    first_loss: float | None
    last_loss: float | None
    seconds: float
    output_dir: Path


def last_checkpoint(output_dir: Path) -> Path | None:
    """The highest ``checkpoint-N`` folder under ``output_dir``, if any."""
    ckpts = [p for p in output_dir.glob("checkpoint-*") if p.is_dir() and p.name.split("-")[-1].isdigit()]
    return max(ckpts, key=lambda p: int(p.name.split("-")[-1])) if ckpts else None


class _LogTail:
    """Follows trainer_log.jsonl as LLaMA-Factory appends to it."""

    def __init__(self, path: Path, *, skip_existing: bool = False) -> None:
        self.path = path
        # A resumed run appends to the old log: lines already ingested are not read again.
        self.offset = path.stat().st_size if skip_existing and path.exists() else 0
        self.buffer = ""

    def read_new(self) -> list[dict[str, Any]]:
        if not self.path.exists():
            return []
        with open(self.path, encoding="utf-8") as fh:
            fh.seek(self.offset)
            chunk = fh.read()
            self.offset = fh.tell()
        self.buffer += chunk
        *complete, self.buffer = self.buffer.split("\n")
        out = []
        for line in complete:
            if line.strip():
                try:
                    out.append(json.loads(line))
                except json.JSONDecodeError:
                    continue
        return out


# ``python -m llamafactory.cli``, except that wandb stays unimported. LLaMA-Factory reports to
# nothing here (``report_to: none``: a run's trackers are this project's own), yet importing its
# trainers imports wandb wherever it is installed (trl asks transformers' ``is_wandb_available``,
# which imports it to check): 8 of the 24-27 s that the import took on a two-core machine. With
# None in ``sys.modules``, ``find_spec`` reports it absent.
_LAUNCH = ("import runpy, sys; sys.modules['wandb'] = None; "
           "runpy.run_module('llamafactory.cli', run_name='__main__', alter_sys=True)")


def run_llamafactory(command: str, config_path: Path, *, python: str, log_path: Path,
                     on_log: Callable[[dict[str, Any]], None] | None = None,
                     trainer_log: Path | None = None, env: Mapping[str, str] | None = None,
                     poll_s: float = 0.5, skip_existing_log: bool = False) -> None:
    """Run ``python -m llamafactory.cli COMMAND CONFIG`` (without wandb: :data:`_LAUNCH`),
    teeing output to ``log_path``.

    ``on_log`` is called with each new trainer_log.jsonl line while the process runs. A non-zero
    exit prints the log's tail to stderr and raises :class:`SubprocessFailed` naming the log.
    """
    full_env = dict(os.environ)
    full_env.update({"WANDB_DISABLED": "true", "WANDB_MODE": "disabled",
                     "DISABLE_VERSION_CHECK": "1", "TOKENIZERS_PARALLELISM": "false"})
    full_env.update(env or {})
    run_streaming([python, "-c", _LAUNCH, command, str(config_path)],
                  name=f"LLaMA-Factory {command}", cwd=config_path.parent, log_path=log_path,
                  env=full_env, follow=trainer_log, on_log=on_log, poll_s=poll_s,
                  skip_existing_log=skip_existing_log,
                  missing_hint="set sft.python to a Python that has llamafactory installed",
                  failure_hint="read the log tail above; fix the recipe or data and re-run (add "
                               "--resume to continue from the last checkpoint)")


def run_streaming(argv: list[str], *, name: str, cwd: Path, log_path: Path,
                  env: Mapping[str, str] | None = None, follow: Path | None = None,
                  on_log: Callable[[dict[str, Any]], None] | None = None,
                  on_line: Callable[[str], None] | None = None, poll_s: float = 0.5,
                  skip_existing_log: bool = False, missing_hint: str, failure_hint: str) -> None:
    """Run an external engine, teeing its output to ``log_path`` (shared by SFT and verl RL).

    ``on_log`` gets each new line of the JSONL file ``follow`` while the process runs, ``on_line``
    each line of its output. Interrupting the caller terminates the process. A non-zero exit
    prints the log's tail to stderr and raises :class:`SubprocessFailed` naming the full log.
    """
    tail: deque[str] = deque(maxlen=LOG_TAIL_LINES)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    try:
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                env=dict(env) if env is not None else None, cwd=cwd, bufsize=1,
                                errors="replace")
    except OSError as exc:
        raise UserError(f"cannot start {name} with interpreter '{argv[0]}': {exc}",
                        hint=missing_hint) from None

    with open(log_path, "a", encoding="utf-8") as log:
        log.write(f"$ {' '.join(argv)}\n")

        def pump() -> None:
            assert proc.stdout is not None
            for line in proc.stdout:
                if log.closed:  # left running past the join below: the log is the caller's no more
                    return
                log.write(line)
                log.flush()
                tail.append(line.rstrip("\n"))
                if on_line is not None:
                    on_line(line.rstrip("\n"))

        reader = threading.Thread(target=pump, daemon=True)
        reader.start()
        follower = (_LogTail(follow, skip_existing=skip_existing_log)
                    if follow is not None else None)
        try:
            while proc.poll() is None:
                if follower is not None and on_log is not None:
                    for entry in follower.read_new():
                        on_log(entry)
                time.sleep(poll_s)
        except BaseException:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
            reader.join(timeout=10)  # its last lines (the shutdown's) reach the log first
            raise
        reader.join(timeout=10)
        if follower is not None and on_log is not None:
            for entry in follower.read_new():
                on_log(entry)

    if proc.returncode != 0:
        from pipelines.console import err

        err.print(f"[red]{name} exited with code {proc.returncode}; "
                  f"last {len(tail)} lines of its log:[/]")
        for line in list(tail):  # a copy: a reader still draining a grandchild's pipe appends
            err.print(f"  {line}", markup=False, highlight=False)
        raise SubprocessFailed(
            f"{name} failed with exit code {proc.returncode}; full log: {log_path}",
            hint=failure_hint)


def write_train_files(cfg: SFTConfig, stage_path: Path, *, model_path: str, dataset_dir: str,
                      dataset: str, media_dir: str | None = None, resume: bool = False) -> Path:
    """Render the training YAML (and the DeepSpeed JSON when asked) into the stage directory."""
    ds_path = None
    if cfg.deepspeed != "none":
        ds_path = str(atomic_write_json(stage_path / f"ds_{cfg.deepspeed}.json",
                                        deepspeed_config(cfg.deepspeed)))
    config = render_train_config(cfg, model_path=model_path, dataset_dir=dataset_dir,
                                 dataset=dataset, output_dir=str(stage_path / "output"),
                                 media_dir=media_dir, deepspeed_path=ds_path, resume=resume)
    return atomic_write_text(stage_path / TRAIN_YAML, config_to_yaml(config))
