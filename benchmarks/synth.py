"""Held-out synthetic sets: the data stage's own tasks, scored by the RL verifiers.

A data-stage folder holds ``tasks.jsonl`` and its media (see :mod:`pipelines.core.records`).
``SynthImage`` keeps the tasks whose ``data_source`` starts with ``synth/image`` and
``SynthVideo`` those starting with ``synth/video``, in the ``heldout`` (or ``test``) split.
Scores come from :func:`benchmarks.scoring.verify`, the function the RL reward calls, so a
held-out accuracy is exactly the reward's accuracy term on unseen tasks.

Metrics: ``accuracy`` (binary correctness), ``<family>_accuracy`` per ``metadata["family"]``,
and ``mra`` (mean MRA over the tasks scored by mean relative accuracy) when there are any.
"""

from __future__ import annotations

import re
from collections import defaultdict
from pathlib import Path
from typing import Any

from benchmarks.base import Benchmark, Sample, mean
from benchmarks.scoring import verify
from pipelines.core.records import Task, read_tasks
from pipelines.errors import DataError, UserError

HELDOUT_SPLITS = ("heldout", "test")


def family_key(task: Task) -> str:
    """``<family>_accuracy`` with the family name reduced to ``[a-z0-9_]``."""
    family = str(task.metadata.get("family") or "other").lower()
    family = re.sub(r"[^a-z0-9]+", "_", family).strip("_")
    return f"{family or 'other'}_accuracy"


class _Synth(Benchmark):
    """Shared by the image and video synthetic sets."""

    version = "1"
    split = "heldout"
    metric_names = ("accuracy", "mra")
    primary_metric = "accuracy"
    reference = "benchmarks.scoring.verify (the RL reward's verifiers)"
    id_column = "id"
    required_columns = ("id", "data_source", "question", "answer", "answer_type")
    media_columns = ()
    source_prefix: str

    def __init__(self, number_rel_tol: float = 0.01, mra_threshold: float = 0.5) -> None:
        if not 0.0 <= number_rel_tol <= 1.0 or not 0.0 <= mra_threshold <= 1.0:
            raise UserError(f"number_rel_tol ({number_rel_tol}) and mra_threshold "
                            f"({mra_threshold}) must lie in [0, 1]", hint="use the reward's values")
        self.number_rel_tol = number_rel_tol
        self.mra_threshold = mra_threshold

    def load(self, data_dir: Path | str | None = None, limit: int | None = None,
             cache_dir: Path | str | None = None) -> list[Task]:
        """Held-out tasks of this modality from a data-stage folder (media paths made absolute)."""
        if data_dir is None:
            raise UserError(f"benchmark '{self.name}' reads a data-stage folder, not the hub",
                            hint="pass --data-dir DIR holding tasks.jsonl (made by `pyvision data "
                                 "synth`)")
        if limit is not None and limit < 1:
            raise UserError(f"limit must be at least 1, got {limit}", hint="pass --limit 1 or more")
        path = Path(data_dir).expanduser()
        tasks, _ = read_tasks(path, strict=True)
        root = (path if path.is_dir() else path.parent).resolve()
        kept = [t for t in tasks
                if t.data_source.startswith(self.source_prefix) and t.split in HELDOUT_SPLITS]
        if not kept:
            raise DataError(f"no held-out '{self.source_prefix}*' tasks in {path} "
                            f"({len(tasks)} tasks read)",
                            hint="generate a held-out split with `pyvision data synth`")
        out = []
        for task in kept[:limit]:
            video = task.video_path(root)
            out.append(task.model_copy(update={
                "images": [str(p.resolve()) for p in task.image_paths(root)],
                "video": str(video.resolve()) if video else None,
                "question": self.question_text(task)}))
        return out

    def prompt(self, row: dict[str, Any]) -> str:
        return self.question_text(self.task_from_row(row))

    def question_text(self, task: Task) -> str:
        """The stored question, with the options listed when the question does not list them."""
        question = task.question
        if task.answer_type != "choice" or not task.options:
            return question
        listed = all(re.search(rf"(?m)(?:\({chr(65 + i)}\)|^{chr(65 + i)}[.:)])", question)
                     for i in range(len(task.options)))
        if listed:
            return question
        lines = "\n".join(f"{chr(65 + i)}. {o}" for i, o in enumerate(task.options))
        return f"{question}\nOptions:\n{lines}"

    def task_from_row(self, values: dict[str, Any], *, images: list[str] | None = None,
                      video: str | None = None) -> Task:
        fields = {k: v for k, v in values.items() if k != "prediction"}
        try:
            task = Task.model_validate(fields)
        except ValueError as exc:
            first = str(exc).splitlines()[0]
            raise DataError(f"row {values.get('id')}: not a task record ({first})",
                            hint="use rows of a tasks.jsonl") from None
        if images is not None or video is not None:
            task = task.model_copy(update={"images": list(images or []), "video": video})
        return task

    def sample_score(self, task: Task, scores: dict[str, float]) -> float:
        """The MRA itself for MRA-scored numbers (what ``reward.accuracy_mode: mra`` trains on)."""
        return scores.get("mra", scores["accuracy"])

    def correct_threshold(self, task: Task) -> float:
        mra = task.answer_type == "number" and task.metadata.get("metric") == "mra"
        return self.mra_threshold if mra else 0.5

    def score(self, task: Task, prediction: str | None) -> dict[str, float]:
        verdict = verify(task, prediction, number_rel_tol=self.number_rel_tol,
                         mra_threshold=self.mra_threshold)
        correct = 1.0 if verdict.correct else 0.0
        out = {"accuracy": correct, family_key(task): correct}
        if task.answer_type == "number" and task.metadata.get("metric") == "mra":
            out["mra"] = verdict.score
        return out

    def aggregate(self, samples: list[Sample]) -> dict[str, float]:
        out = {"accuracy": mean(s["accuracy"] for _, s in samples)}
        by_family: dict[str, list[float]] = defaultdict(list)
        for task, scores in samples:
            by_family[family_key(task)].append(scores["accuracy"])
        out.update({k: mean(v) for k, v in sorted(by_family.items())})
        mra = [s["mra"] for _, s in samples if "mra" in s]
        if mra:
            out["mra"] = mean(mra)
        return out


class SynthImage(_Synth):
    """Held-out synthetic image tasks (``data_source`` ``synth/image-*``)."""

    name = "synth-image"
    source_prefix = "synth/image"


class SynthVideo(_Synth):
    """Held-out synthetic video tasks (``data_source`` ``synth/video*``)."""

    name = "synth-video"
    source_prefix = "synth/video"
