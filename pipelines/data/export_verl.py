"""Export task folders to verl's RL parquet (the rows ``verl.utils.dataset.rl_dataset.RLHFDataset``
reads), with the prompt text of our versioned templates.

Layout written to ``out``::

    out/<name>.parquet          training rows
    out/<name>_val.parquet      validation rows (only when validation sources are given)
    out/<name>_frames/<i>/*.png context frames of the uniform video baseline (only when used)

One row per task::

    agent_name    "pyvision_agent" (the loop the launcher registers; see pipelines/rl/verl)
    data_source   the task's data_source (the reward and judge pick few-shot examples by it)
    prompt        [{"role": "user", "content": text}]: the first user turn built by
                  pipelines.agent.prompts for the task, with one "<image>" per context image
    images        [{"image": abs path, "min_pixels", "max_pixels"}]: the context images in
                  placeholder order; verl resizes each with these bounds, the same Qwen rule the
                  local engine applies (agent.image_min_pixels / image_max_pixels)
    reward_model  {"style": "rule", "ground_truth": answer}
    extra_info    {"index", "split", "task": Task JSON, "media_root": abs folder,
                   "prompt_version": "image@v1"}

There is no ``videos`` column: in the PyVision protocol a video never enters the model's context
as a video. On-demand tasks (the paper) put no frames in the context at all (the video lives only
in the sandbox, reached through ``extra_info``); the uniform baseline puts sampled frames in the
context as images, which are written as PNG files here because verl's dataset reads files.

Every row is validated: the read itself (schema, answer, media present; reported with file and
line), then the prompt build (media that open) and the placeholder count, and, when the model's
processor is given (``pyvision rl --engine verl`` passes the policy's), the prompt's length in
tokens, image tokens included: a prompt over ``max_prompt_tokens`` is dropped and counted
(``prompt_too_long``) rather than left for verl, whose padding would fail the step. ``strict``
fails on the first bad row; otherwise it is skipped and counted. Files appear complete or not at
all.
"""

from __future__ import annotations

import os
import tempfile
from collections import Counter
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from pipelines.agent.prompts import build_initial_messages, variant_for
from pipelines.config.agent import AgentConfig
from pipelines.core.records import (
    IMAGE_PLACEHOLDER,
    VIDEO_PLACEHOLDER,
    ReadReport,
    Task,
    read_tasks,
)
from pipelines.data.validate import skipped_rows
from pipelines.errors import DataError
from pipelines.fsutil import atomic_dir, new_file_mode

AGENT_NAME = "pyvision_agent"


# Why a row was skipped, as counted in the export's "skipped" (see ReadReport.skip); a DataError of
# no more specific kind counts as bad_media.
PROMPT_TOO_LONG = "prompt_too_long"
PLACEHOLDER_MISMATCH = "placeholder_mismatch"
BAD_MEDIA = "bad_media"


class PromptTooLong(DataError):
    """A task whose first turn does not fit the prompt budget."""


class PlaceholderMismatch(DataError):
    """A task whose prompt text does not hold one ``<image>`` per context image (a question that
    contains a literal ``<image>``, ``<video>`` or ``<audio>``)."""


def task_row(task: Task, root: Path, agent_cfg: AgentConfig, *, index: int, split: str,
             frames_dir: Path | None = None, frames_final: Path | None = None,
             count_tokens: Any = None, max_prompt_tokens: int | None = None) -> dict[str, Any]:
    """The verl row of one task (raises DataError when its media cannot be used, PromptTooLong
    when ``count_tokens(messages)`` exceeds ``max_prompt_tokens``, PlaceholderMismatch when the
    prompt's placeholders do not match its context images).

    Context frames of the uniform video baseline are saved into ``frames_dir`` and referenced at
    ``frames_final`` (where the folder will be once the export is complete).
    """
    variant = variant_for(task, agent_cfg)
    messages, info, _runtime = build_initial_messages(task, root, variant, agent_cfg)
    if count_tokens is not None and max_prompt_tokens is not None:
        n = count_tokens(messages)
        if n > max_prompt_tokens:
            raise PromptTooLong(f"task {task.id}: the prompt has {n} tokens (image tokens "
                                f"included), more than {max_prompt_tokens}",
                                hint="raise rl.max_prompt_tokens, lower "
                                     "agent.image_max_pixels, or drop the task")
    parts = messages[0]["content"]
    text = "".join(p["text"] if p["type"] == "text" else IMAGE_PLACEHOLDER for p in parts)
    n_context = sum(1 for p in parts if p["type"] == "image")
    bounds = {"min_pixels": agent_cfg.image_min_pixels, "max_pixels": agent_cfg.image_max_pixels}
    if variant == "image":
        images = [{"image": str(p.resolve()), **bounds} for p in task.image_paths(root)]
    elif n_context:
        if frames_dir is None or frames_final is None:
            raise DataError(f"task {task.id}: its prompt has context frames but no frames folder "
                            "was given", hint="export through export_verl")
        (frames_dir / str(index)).mkdir(parents=True, exist_ok=True)
        images = []
        for k, part in enumerate(p for p in parts if p["type"] == "image"):
            part["image"].save(frames_dir / str(index) / f"{k}.png")
            images.append({"image": str(frames_final / str(index) / f"{k}.png"), **bounds})
    else:
        images = []
    # verl's dataset splits the text on these exact placeholders: a question that contains one
    # would shift every image after it.
    if text.count(IMAGE_PLACEHOLDER) != len(images) or VIDEO_PLACEHOLDER in text \
            or "<audio>" in text:
        raise PlaceholderMismatch(f"task {task.id}: {text.count(IMAGE_PLACEHOLDER)} "
                                  f"{IMAGE_PLACEHOLDER} placeholders in the prompt but "
                                  f"{len(images)} context images",
                                  hint="remove literal <image>/<video>/<audio> from the question "
                                       "text")
    return {
        "agent_name": AGENT_NAME,
        "data_source": task.data_source,
        "prompt": [{"role": "user", "content": text}],
        "images": images,
        "reward_model": {"style": "rule", "ground_truth": task.answer},
        "extra_info": {"index": index, "split": split, "task": task.model_dump_json(),
                       "media_root": str(root.resolve()), "prompt_version": info.version},
    }


def _schema() -> Any:
    import pyarrow as pa

    # Explicit, so a file whose rows all lack context images still has a typed `images` column.
    return pa.schema([
        ("agent_name", pa.string()),
        ("data_source", pa.string()),
        ("prompt", pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))),
        ("images", pa.list_(pa.struct([("image", pa.string()), ("min_pixels", pa.int64()),
                                       ("max_pixels", pa.int64())]))),
        ("reward_model", pa.struct([("style", pa.string()), ("ground_truth", pa.string())])),
        ("extra_info", pa.struct([("index", pa.int64()), ("split", pa.string()),
                                  ("task", pa.string()), ("media_root", pa.string()),
                                  ("prompt_version", pa.string())])),
    ])


def _write_parquet(rows: list[dict[str, Any]], path: Path) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.Table.from_pylist(rows, schema=_schema())
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        os.chmod(tmp, new_file_mode(path))
        pq.write_table(table, tmp)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


# Each row opens its images (the prompt states their size) and resizes them as the local engine
# does, about 50 ms per image task: large exports use every core, small ones skip the pool's start-up.
PARALLEL_MIN_ROWS = 64


# Counts a prompt's tokens with the model's processor (set by export_verl for the duration of an
# export; forked workers inherit it rather than unpickling a processor per row).
_COUNTER: tuple[Any, int] | None = None


def _try_row(job: tuple) -> tuple[dict[str, Any] | None, str | None, str | None, str | None]:
    """``(row, None, None, None)``, or ``(None, skip reason, message, hint)`` for a bad task (plain
    values: in a parallel export they come back from a worker process)."""
    task, root, agent_cfg, index, split, frames_dir, frames_final = job
    count, limit = _COUNTER if _COUNTER is not None else (None, None)
    try:
        return task_row(task, root, agent_cfg, index=index, split=split, frames_dir=frames_dir,
                        frames_final=frames_final, count_tokens=count,
                        max_prompt_tokens=limit), None, None, None
    except PromptTooLong as exc:
        return None, PROMPT_TOO_LONG, exc.message, exc.hint
    except PlaceholderMismatch as exc:
        return None, PLACEHOLDER_MISMATCH, exc.message, exc.hint
    except DataError as exc:
        return None, BAD_MEDIA, exc.message, exc.hint


def _rows(sources: Iterable[str | Path], agent_cfg: AgentConfig, *, split: str, strict: bool,
          frames_dir: Path, frames_final: Path, counts: Counter,
          reports: list[ReadReport]) -> list[dict[str, Any]]:
    jobs, owners = [], []
    for src in sources:
        tasks, report = read_tasks(src, strict=strict)
        reports.append(report)
        root = Path(report.path).parent
        for task in tasks:
            jobs.append((task, root, agent_cfg, len(jobs), split, frames_dir, frames_final))
            owners.append(report)
    # Counting prompt tokens runs the processor (torch): never in forked children.
    workers = min(os.cpu_count() or 1, 16) if _COUNTER is None else 1
    if len(jobs) < PARALLEL_MIN_ROWS or workers == 1:
        results = map(_try_row, jobs)
    else:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        # fork: the children only decode and resize images (no torch, no OpenMP), and unlike
        # spawn it does not re-run the caller's script (a script without a __main__ guard).
        pool = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork"))
        results = pool.map(_try_row, jobs, chunksize=16)
    rows: list[dict[str, Any]] = []
    try:
        for job, report, (row, reason, message, hint) in zip(jobs, owners, results):
            if row is None:
                where = f"{report.path}: row '{job[0].id}'"
                if strict:
                    said = f"{PROMPT_TOO_LONG}: {message}" if reason == PROMPT_TOO_LONG else message
                    raise DataError(f"{where}: {said}", hint=hint)
                report.skip(reason, where, message)
                report.kept -= 1
                continue
            row["extra_info"]["index"] = len(rows)  # contiguous after skipped rows
            counts[row["extra_info"]["prompt_version"]] += 1
            rows.append(row)
    finally:
        if len(jobs) >= PARALLEL_MIN_ROWS and workers > 1:
            pool.shutdown(cancel_futures=True)
    return rows


def prompt_counter(processor: Any, agent_cfg: AgentConfig) -> Any:
    """``messages -> prompt tokens`` as the agent loop will render them with ``processor``."""
    from pipelines.agent.policies.tokens import ChatTokens

    tokens = ChatTokens(processor, image_min_pixels=agent_cfg.image_min_pixels,
                        image_max_pixels=agent_cfg.image_max_pixels, keep_pixels=False,
                        image_factor=agent_cfg.image_factor)
    return lambda messages: tokens.begin(messages).prompt_len


def export_verl(sources: Sequence[str | Path], out: str | Path, *, name: str = "pyvision_rl",
                agent_cfg: AgentConfig | None = None, val_sources: Sequence[str | Path] = (),
                strict: bool = False, processor: Any = None,
                max_prompt_tokens: int | None = None) -> dict[str, Any]:
    """Write ``out/<name>.parquet`` (and ``out/<name>_val.parquet`` when ``val_sources``).

    ``sources`` are task folders (or ``tasks.jsonl`` files). With ``processor`` and
    ``max_prompt_tokens``, tasks whose prompt is longer are dropped (``prompt_too_long``).
    Returns the paths, row counts, rows skipped by reason and the first problems (file and line
    or row id).
    """
    global _COUNTER
    agent_cfg = agent_cfg or AgentConfig()
    if processor is not None and max_prompt_tokens is not None:
        _COUNTER = (prompt_counter(processor, agent_cfg), max_prompt_tokens)
    try:
        return _export(sources, out, name=name, agent_cfg=agent_cfg, val_sources=val_sources,
                       strict=strict)
    finally:
        _COUNTER = None


def _export(sources: Sequence[str | Path], out: str | Path, *, name: str,
            agent_cfg: AgentConfig, val_sources: Sequence[str | Path],
            strict: bool) -> dict[str, Any]:
    out = Path(out).resolve()
    if not sources:
        raise DataError("no task folders to export", hint="pass --source DIR (a tasks.jsonl folder)")
    frames_final = out / f"{name}_frames"
    counts: Counter = Counter()
    reports: list[ReadReport] = []
    with atomic_dir(frames_final, overwrite=True) as frames_tmp:
        train = _rows(sources, agent_cfg, split="train", strict=strict, frames_dir=frames_tmp,
                      frames_final=frames_final, counts=counts, reports=reports)
        val = _rows(val_sources, agent_cfg, split="val", strict=strict, frames_dir=frames_tmp / "val",
                    frames_final=frames_final / "val", counts=counts, reports=reports)
        skipped: Counter = Counter()
        for r in reports:
            skipped.update(r.skipped)
        problems = [p for r in reports for p in r.problems]
        if not train:
            raise DataError(f"no usable task in {', '.join(str(s) for s in sources)}"
                            + (f" ({skipped_rows(skipped, problems)})" if skipped else ""),
                            hint="check the folders with `pyvision data validate DIR`")
        train_path = _write_parquet(train, out / f"{name}.parquet")
        val_path = _write_parquet(val, out / f"{name}_val.parquet") if val else None
    if not any(frames_final.iterdir()):
        frames_final.rmdir()
    return {"train": str(train_path), "val": str(val_path) if val_path else None,
            "rows": len(train), "val_rows": len(val), "prompts": dict(counts),
            "read": sum(r.read for r in reports), "skipped": dict(skipped),
            "problems": problems[:20]}
