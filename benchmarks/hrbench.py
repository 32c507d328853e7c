"""HR-Bench 4K and 8K: multiple-choice questions on 4K / 8K images.

Data: ``DreamMr/HR-Bench``, config ``hrbench_version_split``, splits ``hrbench_4k`` and
``hrbench_8k``; columns ``index``, ``question``, ``A``..``D``, ``answer`` (letter), ``category``
(``single`` = fine-grained single-instance, ``cross`` = cross-instance), ``cycle_category``
and ``image`` (base64). The VLMEvalKit files ``hr_bench_4k.tsv`` / ``hr_bench_8k.tsv`` have the
same columns and load too.

Cycles: each question appears once per option rotation, and ``cycle_category`` names the
rotation. The official score (HR-Bench's own ``HRBenchDataset.evaluate`` and lmms-eval 0.7.3's
``hrbench_aggregate_results``) is the accuracy within each cycle, averaged over cycles; it is
*not* a circular "all rotations correct" rule. ``single``, ``cross`` and ``average`` are each
computed that way over their rows.

Per-sample: lmms-eval's ``can_infer`` rules (an option letter standing alone as a token, else
exactly one option's text inside the answer) map the answer to a letter; when they cannot and a
``judge`` is given, the judge decides (lmms-eval asks GPT to map the answer to a letter and
crashes without network); without a judge the sample scores 0. ``judged`` records which.
"""

from __future__ import annotations

import math
import string
from collections import defaultdict
from typing import Any

from benchmarks.base import Benchmark, Judge, Sample, mean, require_text
from benchmarks.scoring import extract_final_answer
from pipelines.core.records import Task

POST_PROMPT = "Answer the option letter directly."
_REJECTIONS = ("Sorry, I can't help with images of people yet.", "I can't process this file.",
               "I'm sorry, but without the image provided", "Cannot determine the answer")
_SPLIT_CHARS = ".()[],:;!*#{}"


def row_options(row: dict[str, Any]) -> dict[str, str]:
    """The non-empty option columns, letter -> text, in letter order (lmms-eval's rule)."""
    out = {}
    for letter in string.ascii_uppercase:
        value = row.get(letter)
        if value is None or (isinstance(value, float) and math.isnan(value)):
            continue
        out[letter] = value
    return out


def infer_option(answer: str, options: dict[str, Any]) -> str | None:
    """lmms-eval's ``can_infer``: the letter (``Z`` for a refusal) read from ``answer``, or None."""
    answer = str(answer)
    letter = _infer_letter(answer, options)
    return letter if letter else _infer_text(answer, options)


def _infer_letter(answer: str, options: dict[str, Any]) -> str | None:
    if "Failed to obtain answer via API" in answer:
        return None
    if any(r in answer for r in _REJECTIONS):
        return "Z"
    for ch in _SPLIT_CHARS:
        answer = answer.replace(ch, " ")
    tokens = [t.strip() for t in answer.split()]
    hits = [c for c in options if c in tokens]
    if len(hits) == 1:
        return hits[0]
    if not hits and "Z" in tokens:
        return "Z"  # the reference's "none of the options" letter; never a gold answer
    return None


def _infer_text(answer: str, options: dict[str, Any]) -> str | None:
    lowered = answer.lower()
    hits = [k for k, v in options.items() if str(v).lower() in lowered]
    return hits[0] if len(hits) == 1 else None


def cycle_average(samples: list[tuple[str, float]]) -> float:
    """Mean over cycles of the mean score within each cycle (HR-Bench's aggregation)."""
    by_cycle: dict[str, list[float]] = defaultdict(list)
    for cycle, value in samples:
        by_cycle[cycle].append(value)
    return mean(mean(v) for v in by_cycle.values())


class _HRBench(Benchmark):
    """Shared by the 4K and 8K splits."""

    version = "1"
    hf_id = "DreamMr/HR-Bench"
    hf_config = "hrbench_version_split"
    metric_names = ("average", "single", "cross")
    primary_metric = "average"
    reference = "lmms-eval 0.7.3 tasks/hrbench (rules; judge only where they fail)"
    diagnostic_names = ("judged",)
    id_column = "index"
    download_name = "hrbench"
    required_columns = ("index", "question", "answer", "category", "cycle_category")

    def __init__(self, judge: Judge | None = None) -> None:
        self.judge = judge

    def prompt(self, row: dict[str, Any]) -> str:
        options = "".join(f"{k}. {v}\n" for k, v in row_options(row).items())
        return f"{str(row['question']).strip()}\n{options}{POST_PROMPT}"

    def task_from_row(self, values: dict[str, Any], *, images: list[str] | None = None,
                      video: str | None = None) -> Task:
        row = self.raw_row(values)
        answer = require_text(row, "answer").strip()
        options = row_options(row)
        return Task(id=str(row["index"]), data_source=self.name, question=self.prompt(row),
                    images=list(images or []), answer=answer, answer_type="choice",
                    options=[str(v) for v in options.values()],
                    metadata={"benchmark": self.name, "benchmark_version": self.version,
                              "category": str(row["category"]),
                              "cycle_category": str(row["cycle_category"]), "row": row},
                    split="test")

    def _score(self, task: Task, prediction: str | None, judge: Judge | None) -> dict[str, float]:
        row = task.metadata["row"]
        answer = extract_final_answer(prediction)
        gold = str(row["answer"])
        letter = infer_option(answer, row_options(row)) if answer else None
        judged = 0.0
        if letter is not None:
            value = 1.0 if letter.lower() == gold.lower() else 0.0
        elif judge is not None and answer:
            verdict = judge(self.prompt(row), answer, f"{gold}. {row_options(row).get(gold, '')}")
            judged = 1.0 if verdict is not None else 0.0
            value = 1.0 if verdict is not None and verdict >= 0.5 else 0.0
        else:
            value = 0.0
        return {task.metadata["category"]: value, "average": value, "judged": judged}

    def score(self, task: Task, prediction: str | None) -> dict[str, float]:
        return self._score(task, prediction, self.judge)

    def score_without_judge(self, task: Task, prediction: str | None) -> dict[str, float]:
        return self._score(task, prediction, None)

    def aggregate(self, samples: list[Sample]) -> dict[str, float]:
        out = {"average": cycle_average([(t.metadata["cycle_category"], s["average"])
                                         for t, s in samples])}
        for category in ("single", "cross"):
            part = [(t.metadata["cycle_category"], s["average"]) for t, s in samples
                    if t.metadata["category"] == category]
            if part:
                out[category] = cycle_average(part)
        out["judged"] = mean(s.get("judged", 0.0) for _, s in samples)
        return out


class HRBench4K(_HRBench):
    """HR-Bench 4K (lmms-eval task ``hrbench4k``)."""

    name = "hrbench4k"
    split = "hrbench_4k"
    include_hints = ("hrbench_4k", "hr_bench_4k", "4k")
    exclude_hints = ("8k",)


class HRBench8K(_HRBench):
    """HR-Bench 8K (lmms-eval task ``hrbench8k``)."""

    name = "hrbench8k"
    split = "hrbench_8k"
    include_hints = ("hrbench_8k", "hr_bench_8k", "8k")
    exclude_hints = ("4k",)
