"""Our benchmark scores equal lmms-eval 0.7.3's for the same rows and the same final answers.

lmms-eval's own task functions (``process_results``, aggregations, ``doc_to_text``) are imported
from the installed package and fed the fixture rows as docs. Its ``lmms_eval.tasks`` package
``__init__`` imports torch and transformers (about 10 s), so the task modules are loaded under a
bare package object instead, and removed again afterwards so no other test sees it.
"""

from __future__ import annotations

import copy
import importlib
import os
import sys
import types
from collections import defaultdict
from collections.abc import Iterator
from typing import Any

import pytest

from benchmarks import get_benchmark
from tests.benchmarks.test_benchmarks import hrbench_rows, mathverse_rows, vsibench_rows, vstar_rows


@pytest.fixture(scope="module")
def lmms() -> Iterator[dict[str, types.ModuleType]]:
    import lmms_eval

    saved_key = os.environ.get("OPENAI_API_KEY")
    # mathverse_evals builds an OpenAI client at import; it is never called here.
    os.environ.setdefault("OPENAI_API_KEY", "unused-in-tests")
    before = set(sys.modules)
    package = types.ModuleType("lmms_eval.tasks")
    package.__path__ = [os.path.join(os.path.dirname(lmms_eval.__file__), "tasks")]
    real = sys.modules.get("lmms_eval.tasks")
    sys.modules["lmms_eval.tasks"] = package
    try:
        yield {name: importlib.import_module(f"lmms_eval.tasks.{name}.utils")
               for name in ("vstar_bench", "hrbench", "mathverse", "vsibench")}
    finally:
        for name in set(sys.modules) - before:
            if name.startswith("lmms_eval.tasks"):
                del sys.modules[name]
        if real is not None:
            sys.modules["lmms_eval.tasks"] = real
        else:
            sys.modules.pop("lmms_eval.tasks", None)
        if saved_key is None:
            os.environ.pop("OPENAI_API_KEY", None)


# -- V* -------------------------------------------------------------------------------------------

VSTAR_PREDICTIONS = [
    ["A", "C", "B", "A"],
    ["(A)", "The answer is C.", "B. right", "a"],
    ["Dog", "Because it is leather", "I think (B)", ""],
    ["D", "none of these", "left", "Answer: B"],
    ["B", "A. rubber", "The dog is on the right", "(A) above"],
]


@pytest.mark.parametrize("preds", VSTAR_PREDICTIONS)
def test_vstar_equals_lmms_eval(lmms, preds: list[str]) -> None:
    ref = lmms["vstar_bench"]
    bench = get_benchmark("vstar")
    rows = vstar_rows()
    tasks = [bench.task_from_row(r) for r in rows]
    ours = bench.aggregate([(t, bench.score(t, p)) for t, p in zip(tasks, preds)])
    results = [ref.vstar_process_results(r, [p]) for r, p in zip(rows, preds)]
    assert ours["vstar_overall_acc"] * 100 == pytest.approx(
        ref.vstar_aggregate_results([x["vstar_overall_acc"] for x in results]))
    for category in ("direct_attributes", "relative_position"):
        key = f"vstar_{category}_acc"
        theirs = ref.vstar_aggregate_results([x[key] for x in results if key in x])
        assert ours[key] * 100 == pytest.approx(theirs)


def test_vstar_prompt_equals_lmms_eval(lmms) -> None:
    kwargs = {"pre_prompt": "", "post_prompt": "\nAnswer with the option's letter from the given "
                                               "choices directly."}
    bench = get_benchmark("vstar")
    reference = lmms["vstar_bench"].vstar_doc_to_text
    for row in vstar_rows():
        assert bench.task_from_row(row).question == reference(row, kwargs)


# -- HR-Bench ------------------------------------------------------------------------------------

# Answers lmms-eval's rules read (letters, option text, refusals) and ones it sends to its GPT
# matcher; the fake GPT below answers "B" for those, and our judge is told the same.
HRBENCH_PREDICTIONS = [
    ["A", "C", "A", "D", "B", "D"],
    ["A", "B", "the boat", "red", "LOCAL", "D. the boat"],
    ["The answer is A", "C D", "Cannot determine the answer", "(D)", "a", "B."],
    ["it is probably blue", "EXPRESS", "B", "Z", "no idea", "car"],
]


@pytest.mark.parametrize("preds", HRBENCH_PREDICTIONS)
@pytest.mark.parametrize("name", ["hrbench4k", "hrbench8k"])
def test_hrbench_equals_lmms_eval(lmms, monkeypatch, name: str, preds: list[str]) -> None:
    ref = lmms["hrbench"]
    monkeypatch.setattr(ref.hrbench_evaluator, "_post_request",
                        lambda payload: {"choices": [{"message": {"content": "B"}}]})

    def judge(question: str, prediction: str, gold: str) -> float:
        return 1.0 if gold.startswith("B.") else 0.0  # what the fake GPT's "B" means

    bench = get_benchmark(name, judge=judge)
    rows = hrbench_rows(0 if name == "hrbench4k" else 100)
    tasks = [bench.task_from_row(r) for r in rows]
    ours = bench.aggregate([(t, bench.score(t, p)) for t, p in zip(tasks, preds)])
    by_metric: dict[str, list[Any]] = defaultdict(list)
    for row, pred in zip(rows, preds):
        for key, value in ref.hrbench_process_results(copy.deepcopy(row), [pred]).items():
            by_metric[key].append(value)
    for metric in ("average", "single", "cross"):
        assert ours[metric] == pytest.approx(ref.hrbench_aggregate_results(by_metric[metric], None))


def test_hrbench_prompt_equals_lmms_eval(lmms) -> None:
    bench = get_benchmark("hrbench4k")
    for row in hrbench_rows():
        assert bench.task_from_row(row).question == lmms["hrbench"].hrbench_doc_to_text(row)


# -- MathVerse -----------------------------------------------------------------------------------


def _fake_judge_verdict(question: str, gold: str, prediction: str) -> bool:
    """A deterministic stand-in for the LLM judge: the last token equals the gold."""
    tokens = prediction.replace("$", " ").split()
    return bool(tokens) and tokens[-1].strip(".") == gold


MATHVERSE_PREDICTIONS = [
    ["C", "\\frac{3}{2}", "5", "2\\sqrt{3}"],
    ["The answer is C.", "1.5", "It is 5", "3.46"],
    ["B", "", "6", "so the height is 2\\sqrt{3}"],
]


@pytest.mark.parametrize("preds", MATHVERSE_PREDICTIONS)
def test_mathverse_equals_lmms_eval_with_the_same_judge(lmms, monkeypatch, preds) -> None:
    ref = lmms["mathverse"]
    monkeypatch.setattr(ref.mathverse_evaluator, "score_answer",
                        lambda question, answer, response, quick_match=False:
                        _fake_judge_verdict(question, answer, response))
    bench = get_benchmark("mathverse", judge=lambda q, p, g: float(_fake_judge_verdict(q, g, p)))
    rows = mathverse_rows()
    tasks = [bench.task_from_row(r) for r in rows]
    ours = bench.aggregate([(t, bench.score(t, p)) for t, p in zip(tasks, preds)])
    theirs = [ref.mathverse_process_results(copy.deepcopy(r), [p])["gpt_eval_score"]
              for r, p in zip(rows, preds)]
    assert ours["gpt_eval_score"] == pytest.approx(
        ref.mathverse_aggregate_results_eval(theirs, None))
    by_version: dict[str, list[int]] = defaultdict(list)
    for row, value in zip(rows, theirs):
        by_version[row["problem_version"].lower().replace(" ", "_")].append(value)
    for slug, values in by_version.items():
        assert ours[slug] == pytest.approx(ref.mathverse_aggregate_results_eval(values, None))


def test_mathverse_query_wo_prompt_equals_lmms_eval(lmms) -> None:
    bench = get_benchmark("mathverse", query_type="query_wo")
    kwargs = {"shot_type": "format-prompt", "query_type": "query_wo"}
    for row in mathverse_rows():
        assert bench.task_from_row(row).question == lmms["mathverse"].mathverse_doc_to_text(row,
                                                                                          kwargs)


# -- VSI-Bench -----------------------------------------------------------------------------------

VSI_PREDICTIONS = [
    ["3", "12", "2.5", "120", "23.4", "B", "C", "A", "A", "B", "D"],
    ["three", "twelve", "about 2 meters", "1.5 m", "30", "b", "C.", "B", "A. left", "(B)", "d"],
    ["4", "twenty-one", "3.75", "seven hundred", "none", "B table", "", "A.", "B", "B", "D"],
    ["There are 2 chairs", "eleven lamps", "-2.5", "0", "23", "A", "c", "a", "A", "C", "D"],
]


@pytest.mark.parametrize("preds", VSI_PREDICTIONS)
def test_vsibench_equals_lmms_eval(lmms, preds: list[str]) -> None:
    ref = lmms["vsibench"]
    bench = get_benchmark("vsibench")
    rows = vsibench_rows()
    tasks = [bench.task_from_row(r) for r in rows]
    ours = bench.aggregate([(t, bench.score(t, p)) for t, p in zip(tasks, preds)])
    docs = [ref.vsibench_process_results(copy.deepcopy(r), [p])["vsibench_overall"]
            for r, p in zip(rows, preds)]
    theirs = {"vsibench_overall": ref.vsibench_aggregate_overall(docs)}
    for metric in bench.metric_names[1:]:
        theirs[metric] = getattr(ref, f"vsibench_aggregate_{metric}")(docs)
    assert ours == theirs


def test_vsibench_prompt_equals_lmms_eval(lmms) -> None:
    kwargs = {"pre_prompt": "",
              "mca_post_prompt": "Answer with the option's letter from the given choices "
                                 "directly.",
              "na_post_prompt": "Please answer the question using a single word or phrase."}
    bench = get_benchmark("vsibench")
    for row in vsibench_rows():
        assert bench.task_from_row(row).question == lmms["vsibench"].vsibench_doc_to_text(row,
                                                                                        kwargs)


def test_number_extraction_and_mra_equal_lmms_eval(lmms) -> None:
    from benchmarks.scoring import extract_number, mean_relative_accuracy

    ref = lmms["vsibench"]
    texts = ["3", "There are 3 boxes", "three", "Three boxes.", "twenty-one",
             "three hundred and twenty-one", "one apple, room 2", "1,234", "room-2", "-5",
             "two, three", "a thousand", "none", "", "3.50 m", "about 2.5e3", "four and five",
             "nine hundred thousand", "0.5", "twelve 12"]
    for text in texts:
        assert extract_number(text, extended=False) == ref.extract_number(text), text
    for gold in (1.0, 3.0, 2.5, 7.3, 120.0):
        for factor in (0.0, 0.3, 0.5, 0.55, 0.6, 0.7, 0.75, 0.9, 0.95, 1.0, 1.05, 1.1, 1.25,
                       1.45, 1.5, 1.55, 2.0):
            pred = gold * factor
            assert mean_relative_accuracy(pred, gold) == pytest.approx(
                float(ref.mean_relative_accuracy(pred, gold, 0.5, 0.95, 0.05)), abs=0), \
                (pred, gold)


def test_hrbench_uneven_cycles_equal_lmms_eval(lmms) -> None:
    """With a cycle short of a row, the mean of cycle means differs from plain accuracy."""
    ref = lmms["hrbench"]
    bench = get_benchmark("hrbench4k")
    rows = hrbench_rows()[:5]  # cycle_0 has 3 rows, cycle_1 has 2
    preds = ["A", "B", "B", "D", "B"]  # cycle_0: 1/3 right, cycle_1: 2/2 right
    tasks = [bench.task_from_row(r) for r in rows]
    ours = bench.aggregate([(t, bench.score(t, p)) for t, p in zip(tasks, preds)])
    results = [ref.hrbench_process_results(copy.deepcopy(r), [p])["average"]
               for r, p in zip(rows, preds)]
    assert ours["average"] == pytest.approx(ref.hrbench_aggregate_results(results, None))
    assert ours["average"] == pytest.approx((1 / 3 + 1) / 2)
    assert ours["average"] != pytest.approx(3 / 5)
