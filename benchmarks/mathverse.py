"""MathVerse testmini: diagram maths in six versions (text-dominant ... vision-only).

Data: ``CaraJ/MathVerse-lmmseval``, config ``testmini``, split ``testmini``; columns
``sample_index``, ``problem_index``, ``problem_version``, ``question``, ``image``, ``answer``,
``question_type`` (``multi-choice`` / ``free-form``), ``metadata``, ``query_wo``, ``query_cot``,
``question_for_eval``.

Prompt: lmms-eval's "format-prompt" query, i.e. the row's ``query_wo`` or ``query_cot`` as is.
lmms-eval 0.7.3 uses ``query_wo`` ("directly answer"); ours defaults to ``query_cot`` because the
agent reasons and runs code before answering. Both are version-appropriate (the vision-only
rows put the question in the image).

Score: lmms-eval's metric ``gpt_eval_score`` is an LLM judge's 0/1 verdict on
(``question_for_eval``, ``answer``, response), averaged. Pass ``judge`` to do the same; when it
is None or returns None, a rule decides (``score_choice`` for multi-choice with the options
read from the question, ``score_math`` for free-form) and ``judged`` is 0 for that sample.
Per-version metrics are named after lmms-eval's per-version tasks (``vision_only`` for
``mathverse_testmini_vision_only``).
"""

from __future__ import annotations

import re
from collections import defaultdict
from typing import Any, Literal

from benchmarks.base import Benchmark, Judge, Sample, mean, require_text
from benchmarks.scoring import extract_final_answer, score_choice, score_math
from pipelines.core.records import Task
from pipelines.errors import UserError

VERSIONS = ("Text Dominant", "Text Lite", "Text Only", "Vision Intensive", "Vision Dominant",
            "Vision Only")
_CHOICES_RE = re.compile(r"choices\s*:?", re.IGNORECASE)
_OPTION_LINE_RE = re.compile(r"^\s*\(?([A-H])\)?\s*[:.)：]\s*(.+?)\s*$", re.MULTILINE)


def version_slug(problem_version: str) -> str:
    """``"Vision Only"`` -> ``"vision_only"`` (lmms-eval's per-version task suffix)."""
    return re.sub(r"[^a-z0-9]+", "_", str(problem_version).strip().lower()).strip("_") or "unknown"


def question_options(question: str) -> list[str]:
    """Option texts listed after "Choices" in a MathVerse question (A, B, ... in order)."""
    found = _CHOICES_RE.search(question or "")
    if not found:
        return []
    options: list[str] = []
    for match in _OPTION_LINE_RE.finditer(question[found.end():]):
        if ord(match.group(1)) - 65 != len(options):
            break
        options.append(match.group(2))
    return options


class MathVerse(Benchmark):
    """MathVerse testmini (lmms-eval task ``mathverse_testmini``)."""

    name = "mathverse"
    version = "1"
    hf_id = "CaraJ/MathVerse-lmmseval"
    hf_config = "testmini"
    split = "testmini"
    metric_names = ("gpt_eval_score",) + tuple(version_slug(v) for v in VERSIONS)
    primary_metric = "gpt_eval_score"
    reference = "lmms-eval 0.7.3 tasks/mathverse (LLM judge; rule fallback)"
    diagnostic_names = ("judged",)
    id_column = "sample_index"
    required_columns = ("sample_index", "problem_version", "question", "answer", "question_type",
                        "question_for_eval")
    include_hints = ("testmini",)
    exclude_hints = ("version_split", "testmini_text", "testmini_vision")

    def __init__(self, judge: Judge | None = None,
                 query_type: Literal["query_cot", "query_wo"] = "query_cot") -> None:
        if query_type not in ("query_cot", "query_wo"):
            raise UserError(f"unknown MathVerse query_type '{query_type}'",
                            hint="use query_cot or query_wo")
        self.judge = judge
        self.query_type = query_type

    def prompt(self, row: dict[str, Any]) -> str:
        query = row.get(self.query_type)
        if query is None or not str(query).strip():
            query = row.get("question")
        return str(query).strip()

    def task_from_row(self, values: dict[str, Any], *, images: list[str] | None = None,
                      video: str | None = None) -> Task:
        row = self.raw_row(values)
        answer = require_text(row, "answer").strip()
        is_choice = row.get("question_type") == "multi-choice" and len(answer.strip("()")) == 1
        options = question_options(str(row.get("question") or "")) if is_choice else []
        if options and not 0 <= ord(answer.strip("()").upper()) - 65 < len(options):
            options = []
        return Task(id=str(row["sample_index"]), data_source=self.name, question=self.prompt(row),
                    images=list(images or []), answer=answer,
                    answer_type="choice" if is_choice else "math", options=options,
                    metadata={"benchmark": self.name, "benchmark_version": self.version,
                              "category": version_slug(row["problem_version"]),
                              "question_type": row.get("question_type"), "row": row},
                    split="test")

    def _rule(self, task: Task, prediction: str | None) -> float:
        if task.answer_type == "choice":
            return score_choice(prediction, task.answer, task.options).score
        return score_math(prediction, task.answer).score

    def _score(self, task: Task, prediction: str | None, judge: Judge | None) -> dict[str, float]:
        row = task.metadata["row"]
        text = (prediction or "").strip()
        verdict = None
        if judge is not None and text:
            verdict = judge(str(row["question_for_eval"]), text, str(row["answer"]))
        if verdict is not None:
            value, judged = (1.0 if verdict >= 0.5 else 0.0), 1.0
        else:
            value, judged = (self._rule(task, extract_final_answer(text)) if text else 0.0), 0.0
        return {"gpt_eval_score": value, task.metadata["category"]: value, "judged": judged}

    def score(self, task: Task, prediction: str | None) -> dict[str, float]:
        return self._score(task, prediction, self.judge)

    def score_without_judge(self, task: Task, prediction: str | None) -> dict[str, float]:
        return self._score(task, prediction, None)

    def aggregate(self, samples: list[Sample]) -> dict[str, float]:
        by_version: dict[str, list[float]] = defaultdict(list)
        for task, scores in samples:
            by_version[task.metadata["category"]].append(scores["gpt_eval_score"])
        out = {"gpt_eval_score": mean(s["gpt_eval_score"] for _, s in samples)}
        for slug, values in sorted(by_version.items()):
            out[slug] = mean(values)
        out["judged"] = mean(s.get("judged", 0.0) for _, s in samples)
        return out
