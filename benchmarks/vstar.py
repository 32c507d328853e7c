"""V* Bench: 191 multiple-choice visual-search questions on high-resolution images.

Data: ``lmms-lab-encoder/vstar-bench``, split ``test``; columns ``image``, ``text`` (the question
with ``(A) .. (D)`` options inline), ``label`` (the letter), ``question_id``, ``category``
(``direct_attributes`` or ``relative_position``).

Prompt and score follow lmms-eval 0.7.3 (``tasks/vstar_bench/utils.py``): the options are
re-laid one per line as ``A. text`` and the post-prompt asks for the letter; the score reads a
letter with lmms-eval's ``extract_answer_letter`` rules (first matching pattern wins, so a reply
that starts with "B..." reads as B) after our final-answer extraction (``<answer>``, ``\\boxed{}``).
Metrics: ``vstar_overall_acc`` and ``vstar_<category>_acc`` as fractions (lmms-eval logs
percentages).
"""

from __future__ import annotations

import re
from collections import defaultdict
from typing import Any

from benchmarks.base import Benchmark, Sample, mean, require_text
from benchmarks.scoring import extract_final_answer
from pipelines.core.records import Task

POST_PROMPT = "\nAnswer with the option's letter from the given choices directly."
CATEGORIES = ("direct_attributes", "relative_position")

# lmms-eval's option pattern: "(A) text" up to the next "(B)" or the end of the text.
_OPTION_RE = re.compile(r"\([A-D]\)\s*([^()]+?)(?=\s*\([A-D]\)|$)")
_LETTER_PATTERNS = [
    re.compile(r"^([A-D])\s*[\.)\]]*", re.IGNORECASE),
    re.compile(r"(?:THE\s+)?(?:ANSWER|CHOICE|OPTION)(?:\s+IS)?[\s:]+([A-D])", re.IGNORECASE),
    re.compile(r"\(([A-D])\)", re.IGNORECASE),
    re.compile(r"([A-D])\s*(?:\.|\)|])", re.IGNORECASE),
    re.compile(r"(?:^|\s)([A-D])(?:\s|$)", re.IGNORECASE),
]


def reference_letter(response: str) -> str | None:
    """The letter lmms-eval's V* scorer reads from a response (its rules, in its order)."""
    text = response.strip().upper()
    for pattern in _LETTER_PATTERNS:
        match = pattern.search(text)
        if match:
            return match.group(1).upper()
    letters = re.findall(r"[A-D]", text)
    if len(letters) == 1:
        return letters[0]
    if text and text[0] in "ABCD":
        return text[0]
    return None


def split_options(text: str) -> tuple[str, list[str]]:
    """(question stem, option texts) from V*'s ``text`` column."""
    options = [o.strip() for o in _OPTION_RE.findall(text)][:4]
    stem = text.split("(A)")[0].strip() if options else text.strip()
    return stem, options


class VStar(Benchmark):
    """V* Bench (lmms-eval task ``vstar_bench``)."""

    name = "vstar"
    version = "1"
    hf_id = "lmms-lab-encoder/vstar-bench"
    split = "test"
    metric_names = ("vstar_overall_acc",) + tuple(f"vstar_{c}_acc" for c in CATEGORIES)
    primary_metric = "vstar_overall_acc"
    reference = "lmms-eval 0.7.3 tasks/vstar_bench"
    id_column = "question_id"
    required_columns = ("text", "label", "question_id", "category")

    def prompt(self, row: dict[str, Any]) -> str:
        stem, options = split_options(str(row["text"]))
        if not options:
            return f"{row['text']}{POST_PROMPT}"
        lines = [f"{chr(65 + i)}. {o}" for i, o in enumerate(options)]
        return f"{stem}\n" + "\n".join(lines) + POST_PROMPT

    def task_from_row(self, values: dict[str, Any], *, images: list[str] | None = None,
                      video: str | None = None) -> Task:
        row = self.raw_row(values)
        label = require_text(row, "label").strip().upper()
        _, options = split_options(require_text(row, "text"))
        return Task(id=str(row["question_id"]), data_source=self.name, question=self.prompt(row),
                    images=list(images or []), answer=label, answer_type="choice",
                    options=options if len(label) == 1 and ord(label) - 65 < len(options) else [],
                    metadata={"benchmark": self.name, "benchmark_version": self.version,
                              "category": str(row.get("category") or "unknown"), "row": row},
                    split="test")

    def score(self, task: Task, prediction: str | None) -> dict[str, float]:
        letter = reference_letter(extract_final_answer(prediction))
        gold = str(task.metadata["row"]["label"]).strip().upper()
        value = 1.0 if letter == gold else 0.0
        return {"vstar_overall_acc": value, f"vstar_{task.metadata['category']}_acc": value}

    def aggregate(self, samples: list[Sample]) -> dict[str, float]:
        by_category: dict[str, list[float]] = defaultdict(list)
        for task, scores in samples:
            by_category[task.metadata["category"]].append(scores["vstar_overall_acc"])
        out = {"vstar_overall_acc": mean(s["vstar_overall_acc"] for _, s in samples)}
        for category, values in sorted(by_category.items()):
            out[f"vstar_{category}_acc"] = mean(values)
        return out
