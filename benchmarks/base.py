"""What every benchmark provides: load, prompt, score, aggregate, validate.

A benchmark is one class. :class:`Benchmark` holds the parts all of them share (loading rows
from the hub or a local copy, caching media, checking columns, ``validate``); a concrete class
says how a raw row becomes a :class:`~pipelines.core.records.Task` (``task_from_row``), how the
agent is asked (``prompt``), and how its reference scorer scores and aggregates.

Every task keeps its raw row (all columns but the media) in ``metadata["row"]``, so the
official scorer can be re-run from stored tasks, and ``score_predictions`` can score a JSONL of
rows plus predictions made anywhere.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from benchmarks.sources import (
    MediaStore,
    Row,
    RowSource,
    clean_value,
    default_cache_dir,
    hub_rows,
    local_rows,
)
from pipelines.core.records import Task
from pipelines.errors import DataError, UserError

Judge = Callable[[str, str, str], "float | None"]
"""An optional LLM judge: ``judge(question, prediction, gold) -> score in [0, 1]`` or None when
it could not decide (the rule scorer is used then)."""

Sample = tuple[Task, dict[str, float]]


@dataclass(frozen=True)
class LoadContext:
    """What a benchmark's media hook may use while loading."""

    data_dir: Path | None
    cache_dir: Path
    media: MediaStore


class Benchmark(ABC):
    """One benchmark: its data, its prompt and its official scoring."""

    name: ClassVar[str]
    """Registry name (``vstar``, ``hrbench4k`` ...); also each task's ``data_source``."""
    version: ClassVar[str]
    """Bumped whenever loading, prompting or scoring changes what a score means."""
    hf_id: ClassVar[str | None] = None
    hf_config: ClassVar[str | None] = None
    split: ClassVar[str] = "test"
    metric_names: ClassVar[tuple[str, ...]]
    """The score metrics ``aggregate`` reports (lmms-eval's names), all fractions in [0, 1]."""
    primary_metric: ClassVar[str]
    """The headline number."""
    reference: ClassVar[str]
    """The scorer whose numbers ours reproduce (recorded with every stored score)."""
    diagnostic_names: ClassVar[tuple[str, ...]] = ()
    """Non-score values that per-sample dicts and ``aggregate`` may also carry (``judged``)."""
    id_column: ClassVar[str]
    required_columns: ClassVar[tuple[str, ...]]
    """Columns ``task_from_row`` needs (media columns excluded)."""
    media_columns: ClassVar[tuple[str, ...]] = ("image",)
    include_hints: ClassVar[tuple[str, ...]] = ()
    exclude_hints: ClassVar[tuple[str, ...]] = ()
    download_name: ClassVar[str | None] = None
    """The ``pyvision data download`` name of the dataset when it differs from ``name``."""

    # -- data ---------------------------------------------------------------------------------

    @property
    def source(self) -> RowSource:
        return RowSource(self.hf_id or self.name, self.hf_config, self.split,
                         self.include_hints or (self.split.lower(),), self.exclude_hints,
                         self.download_name or self.name)

    def load(self, data_dir: Path | str | None = None, limit: int | None = None,
             cache_dir: Path | str | None = None) -> list[Task]:
        """Tasks from the official hub dataset, or from ``data_dir`` (a local copy, see
        :mod:`benchmarks.sources` for the accepted layouts), first ``limit`` rows only.

        Inline images are written once under ``<cache_dir>/<name>/media``. Without
        ``data_dir`` and without a reachable hub this fails within seconds with a
        :class:`UserError` naming the dataset and the ``--data-dir`` route.
        """
        if limit is not None and limit < 1:
            raise UserError(f"limit must be at least 1, got {limit}", hint="pass --limit 1 or more")
        cache = Path(cache_dir).expanduser() if cache_dir else default_cache_dir()
        ctx = LoadContext(Path(data_dir).expanduser() if data_dir else None, cache,
                          MediaStore(cache / self.name / "media"))
        rows = self._rows(ctx, limit)
        tasks: list[Task] = []
        seen: set[str] = set()
        for row in rows:
            if limit is not None and len(tasks) >= limit:
                break
            self.check_columns(row.values, row.where)
            images, video = self.row_media(row, ctx)
            task = self.task_from_row(row.values, images=images, video=video)
            if task.id in seen:
                raise DataError(f"{row.where}: duplicate id '{task.id}' in {self.name}",
                                hint="the copy mixes two splits or files; keep one")
            seen.add(task.id)
            tasks.append(task)
        if not tasks:
            where = ctx.data_dir or f"{self.hf_id}:{self.split}"
            raise DataError(f"no rows for '{self.name}' in {where}",
                            hint=f"check that it is a copy of {self.hf_id} (split {self.split})")
        return tasks

    def _rows(self, ctx: LoadContext, limit: int | None) -> Iterator[Row]:
        if ctx.data_dir is not None:
            return local_rows(ctx.data_dir, self.source, self.name)
        return hub_rows(self.source, self.name, limit=limit)

    def check_columns(self, values: dict[str, Any], where: str) -> None:
        missing = [c for c in self.required_columns if c not in values]
        if missing:
            raise DataError(f"{where}: missing column '{missing[0]}' for benchmark '{self.name}' "
                            f"(needs {', '.join(self.required_columns)})",
                            hint=f"use rows with the columns of {self.hf_id}" if self.hf_id
                            else "use the rows this benchmark's tasks have (`pyvision data "
                                 "synth` writes them)")

    def row_media(self, row: Row, ctx: LoadContext) -> tuple[list[str], str | None]:
        """(image paths, video path) for a row; images from ``media_columns`` by default."""
        images = []
        for column in self.media_columns:
            path = ctx.media.image(row.values.get(column), row, column)
            if path is not None:
                images.append(path)
        return images, None

    def raw_row(self, values: dict[str, Any]) -> dict[str, Any]:
        """The JSON-safe row kept in ``metadata["row"]``: every column but the media."""
        return {k: clean_value(v) for k, v in values.items()
                if k not in self.media_columns and k != "prediction"}

    @abstractmethod
    def task_from_row(self, values: dict[str, Any], *, images: list[str] | None = None,
                      video: str | None = None) -> Task:
        """The canonical task for one raw row (media already resolved to paths)."""

    # -- prompt -------------------------------------------------------------------------------

    @abstractmethod
    def prompt(self, row: dict[str, Any]) -> str:
        """The question text the agent receives, from a raw row."""

    def question_text(self, task: Task) -> str:
        """The question as the agent receives it (also stored as ``task.question`` at load)."""
        return self.prompt(task.metadata["row"])

    # -- scoring ------------------------------------------------------------------------------

    @abstractmethod
    def score(self, task: Task, prediction: str | None) -> dict[str, float]:
        """Per-sample metric values in [0, 1] for one final answer (None scores 0)."""

    @abstractmethod
    def aggregate(self, samples: list[Sample]) -> dict[str, float]:
        """Benchmark-level metrics (lmms-eval's names; fractions) from per-sample scores."""

    def gold_prediction(self, task: Task) -> str:
        """A final answer that must score full marks."""
        return task.answer

    def sample_score(self, task: Task, scores: dict[str, float]) -> float:
        """One sample's value of the headline metric (from ``score``'s output)."""
        return scores[self.primary_metric]

    def verdict(self, task: Task, prediction: str | None) -> tuple[dict[str, float], float, bool]:
        """``score``'s metrics, the sample's headline value and whether it counts as right
        (value >= 0.5): the one answer to "is this right?" that the RL reward and the evaluation
        both use for this benchmark's tasks."""
        scores = self.score(task, prediction)
        value = self.sample_score(task, scores)
        return scores, value, value >= self.correct_threshold(task)

    def correct_threshold(self, task: Task) -> float:
        """The headline value from which a sample counts as right."""
        return 0.5

    def score_without_judge(self, task: Task, prediction: str | None) -> dict[str, float]:
        """``score`` with rules only; benchmarks with an LLM judge override it."""
        return self.score(task, prediction)

    def validate(self, tasks: Iterable[Task]) -> None:
        """Model-free check that every gold answer scores full marks through score + aggregate.

        Raises :class:`DataError` naming the failing task ids (first ten) and metrics.
        """
        samples = [(t, self.score_without_judge(t, self.gold_prediction(t))) for t in tasks]
        if not samples:
            raise DataError(f"nothing to validate for '{self.name}'", hint="load some tasks first")
        failing = [t.id for t, scores in samples
                   if any(v < 1.0 - 1e-9 for k, v in scores.items()
                          if k not in self.diagnostic_names)]
        totals = self.aggregate(samples)
        low = [f"{k}={v:.4f}" for k, v in totals.items()
               if k not in self.diagnostic_names and v < 1.0 - 1e-6]
        if failing or low:
            ids = ", ".join(failing[:10])
            if len(failing) > 10:
                ids += f" (+{len(failing) - 10} more)"
            raise DataError(
                f"{self.name}: gold answers do not score full marks"
                + (f"; failing ids: {ids}" if failing else "")
                + (f"; aggregate {', '.join(low)}" if low else ""),
                hint="the data or the scorer is wrong; compare those rows with the official data")

    def describe(self) -> dict[str, Any]:
        """Identity of this benchmark for stored results."""
        return {"name": self.name, "version": self.version, "hf_id": self.hf_id,
                "hf_config": self.hf_config, "split": self.split,
                "metrics": list(self.metric_names), "primary_metric": self.primary_metric,
                "reference": self.reference}


def mean(values: Iterable[float]) -> float:
    values = list(values)
    return sum(values) / len(values) if values else 0.0


def require_text(values: dict[str, Any], column: str, where: str = "row") -> str:
    """A column's value as a non-empty string, or a DataError naming it."""
    value = values.get(column)
    if value is None or not str(value).strip():
        raise DataError(f"{where}: column '{column}' is empty", hint="use the official rows")
    return str(value)
