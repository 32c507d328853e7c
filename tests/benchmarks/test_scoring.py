"""The shared verifiers: each test attacks one property of one scorer."""

from __future__ import annotations

import threading

import pytest

from benchmarks.scoring import (
    CHOICE_SCORER,
    MATH_SCORER,
    MRA_SCORER,
    NUMBER_SCORER,
    TEXT_SCORER,
    Verdict,
    extract_final_answer,
    extract_number,
    mean_relative_accuracy,
    score_choice,
    score_math,
    score_number,
    score_text,
    verify,
)
from pipelines.core.records import Task

OPTIONS = ["green", "red", "blue", "dark red"]


def task(answer: str, answer_type: str, **kw) -> Task:
    return Task(id="t", data_source="test", question="q?", answer=answer,
                answer_type=answer_type, **kw)


# -- final answer -------------------------------------------------------------------------------


@pytest.mark.parametrize("text, expected", [
    ("B", "B"),
    ("  3.5 \n", "3.5"),
    ("I zoomed in.\n<answer>\n\\boxed{B}\n</answer>", "B"),
    ("\\boxed{\\frac{\\sqrt{3}}{2}}", "\\frac{\\sqrt{3}}{2}"),  # nested braces kept whole
    ("first \\boxed{1} then \\boxed{2}", "2"),
    ("<answer>$x^2$</answer>", "x^2"),
    ("<answer>unterminated", "unterminated"),
    ("\\boxed{unbalanced", "\\boxed{unbalanced"),
    (None, ""),
])
def test_extract_final_answer(text, expected) -> None:
    assert extract_final_answer(text) == expected


# -- choice -------------------------------------------------------------------------------------


@pytest.mark.parametrize("prediction", [
    "B", "b", "(B)", "B.", "B)", "[B]", "b) red", "B. red", "Answer: B", "The answer is (b)",
    "the correct option is B", "I think it is B.", "\\boxed{\\text{B}}", "red", "It is red.",
    "<answer>(B) red</answer>",
])
def test_choice_accepts_the_gold_letter_in_many_forms(prediction: str) -> None:
    verdict = score_choice(prediction, "B", OPTIONS)
    assert verdict == Verdict(1.0, True, CHOICE_SCORER, verdict.detail), verdict


@pytest.mark.parametrize("prediction, why", [
    ("A red car", "option text"),           # the article "A" is not option A; "red" is B
    ("Apple", None),                        # an "A" inside a word is no letter
    ("I am not sure", None),                # the pronoun "I" is no letter
    ("The answer is a guess", None),        # lower-case "a" after "answer is" is a word
])
def test_choice_does_not_read_letters_inside_words(prediction: str, why: str | None) -> None:
    verdict = score_choice(prediction, "B", OPTIONS)
    if why is None:
        assert verdict.score == 0.0 and "no option letter" in verdict.detail
    else:
        assert verdict.correct and why in verdict.detail


@pytest.mark.parametrize("prediction", ["A or B", "(A) or (B)", "A, B", "options B and C"])
def test_choice_hedging_over_letters_is_ambiguous(prediction: str) -> None:
    verdict = score_choice(prediction, "B", OPTIONS)
    assert not verdict.correct and verdict.detail.startswith("ambiguous")


def test_choice_keyword_statement_wins_and_options_bound_letters() -> None:
    assert score_choice("(A) is tempting, but the answer is B", "B", OPTIONS).correct
    # E is not among four options, so it is not a letter here.
    assert score_choice("E", "B", OPTIONS).detail.startswith("no option letter")
    assert score_choice("dark red", "D", OPTIONS).correct  # longest containing option wins
    assert not score_choice("dark red", "B", OPTIONS).correct


def test_choice_gold_may_be_option_text() -> None:
    assert score_choice("C", "blue", OPTIONS).correct
    assert score_choice("C", "purple", OPTIONS).detail == "gold 'purple' is not an option"


# -- numbers ------------------------------------------------------------------------------------


@pytest.mark.parametrize("text, value", [
    ("42", 42.0), ("There are 7 chairs.", 7.0), ("-3.5 degrees", -3.5), ("1,234 people", 1234.0),
    ("three", 3.0), ("twenty-one", 21.0), ("three hundred and twenty-one", 321.0),
    ("one apple, room 2", 1.0), ("3/4", 0.75), ("\\frac{3}{4}", 0.75), ("2.5e3", 2500.0),
    (".5", 0.5), ("room-2", 2.0), ("two, three", 2.0), ("2024/05/01", 2024.0),
    ("\u22124", -4.0), ("no number here", None), ("", None), (None, None), ("5/0", None),
])
def test_extract_number(text, value) -> None:
    assert extract_number(text) == value


def test_number_tolerance_and_failures() -> None:
    assert score_number("100.9", "100", rel_tol=0.01).correct
    assert not score_number("101.1", "100", rel_tol=0.01).correct
    assert score_number("0", "0").correct
    assert score_number("I count five", "5").correct
    assert score_number("many", "5") == Verdict(0.0, False, NUMBER_SCORER,
                                                "no number in prediction")
    assert score_number("5", "lots").detail == "gold 'lots' is not a number"


# -- mean relative accuracy ---------------------------------------------------------------------


def test_mra_boundaries() -> None:
    assert mean_relative_accuracy(10.0, 10.0) == 1.0
    assert mean_relative_accuracy(20.0, 10.0) == 0.0          # 100 % off
    assert mean_relative_accuracy(15.1, 10.0) == 0.0          # just over 50 % off
    assert mean_relative_accuracy(14.9, 10.0) == 0.1          # passes only t = 0.50
    assert mean_relative_accuracy(10.6, 10.0) == 0.9          # fails only t = 0.95
    assert mean_relative_accuracy(9.4, 10.0) == 0.9           # symmetric
    assert mean_relative_accuracy(0.0, 0.0) == 1.0            # the reference divides by zero
    assert mean_relative_accuracy(1.0, 0.0) == 0.0
    assert mean_relative_accuracy(-10.0, -10.0) == 1.0
    assert mean_relative_accuracy(10.0, -10.0) == 0.0         # the reference gives 1.0 here


def test_mra_verdict_uses_threshold_and_never_raises_on_text() -> None:
    t = task("10", "number", metadata={"metric": "mra"})
    near = verify(t, "10.6", mra_threshold=0.9)
    assert near == Verdict(0.9, True, MRA_SCORER, near.detail)
    assert not verify(t, "10.6", mra_threshold=0.95).correct
    assert verify(t, "I cannot tell") == Verdict(0.0, False, MRA_SCORER, "no number in prediction")


# -- mathematics --------------------------------------------------------------------------------


@pytest.mark.parametrize("prediction, gold", [
    ("\\frac{1}{2}", "0.5"), ("0.5", "\\frac{1}{2}"),
    ("\\dfrac{\\sqrt{3}}{2}", "\\frac{\\sqrt{3}}{2}"),
    ("\\boxed{2\\sqrt{3}}", "\\sqrt{12}"), ("y = 1 + 2x", "y=2x+1"), ("60^\\circ", "60°"),
    ("The answer is $\\frac{\\pi}{4}$", "\\frac{\\pi}{4}"), ("x = 3", "3"), ("C", "C"),
])
def test_math_equivalences(prediction: str, gold: str) -> None:
    verdict = score_math(prediction, gold)
    assert verdict.correct and verdict.scorer == MATH_SCORER, verdict


@pytest.mark.parametrize("prediction", ["\\frac{1}{3}", "2\\sqrt{2}", "7", "banana"])
def test_math_rejects_non_equivalent(prediction: str) -> None:
    assert not score_math(prediction, "\\frac{1}{2}").correct


def test_math_in_a_worker_thread_runs_without_signal_timeouts() -> None:
    out: list[Verdict] = []
    worker = threading.Thread(target=lambda: out.append(score_math("\\frac{2}{4}", "0.5")))
    worker.start()
    worker.join(30)
    assert out and out[0].correct


HOSTILE = ["answer" + " " * 100_000 + "!", "B" + " " * 100_000 + "x", "<answer>" * 50_000,
           "1" * 200_000, "\\boxed{" * 50_000, "(" * 100_000, "A or " * 20_000,
           "answer is " * 20_000, "1," * 100_000, "one " * 50_000, "-" * 100_000 + "1",
           "\\frac{" * 30_000, "B\n" * 50_000]


@pytest.mark.parametrize("answer_type, gold, kw", [
    ("choice", "B", {"options": ["x", "y", "z"]}), ("number", "4", {}),
    ("number", "4", {"metadata": {"metric": "mra"}}), ("text", "paris", {})])
def test_rule_scorers_stay_fast_on_hostile_padding(answer_type, gold, kw) -> None:
    import time

    t = task(gold, answer_type, **kw)
    for text in HOSTILE:
        start = time.thread_time()  # this thread's CPU: a busy machine's waits do not count
        verdict = verify(t, text)
        assert time.thread_time() - start < 1.0, text[:30]
        assert 0.0 <= verdict.score <= 1.0


def test_math_survives_hostile_input_without_a_signal_timeout() -> None:
    import time

    hostile = ["\\frac{" * 500 + "1" + "}" * 499 + "\\sqrt{{{{{{" + "^" * 200, "(" * 100_000,
               "x" * 200_000]
    out: list[tuple[float, Verdict]] = []

    def run() -> None:  # a worker thread: math-verify's SIGALRM limit is off here
        for text in hostile:
            start = time.monotonic()
            verdict = score_math(text, "1")
            out.append((time.monotonic() - start, verdict))

    worker = threading.Thread(target=run)
    worker.start()
    worker.join(60)
    assert not worker.is_alive() and len(out) == len(hostile)
    for seconds, verdict in out:
        assert seconds < 5.0 and not verdict.correct


# -- text ---------------------------------------------------------------------------------------


def test_text_normalisation() -> None:
    assert score_text("The Eiffel Tower!", "eiffel   tower").correct
    assert score_text("an apple.", "Apple").correct
    assert not score_text("apple pie", "apple").correct
    assert score_text("x", "x").scorer == TEXT_SCORER


# -- dispatch -----------------------------------------------------------------------------------


@pytest.mark.parametrize("t, scorer", [
    (task("B", "choice", options=["x", "y"]), CHOICE_SCORER),
    (task("4", "number"), NUMBER_SCORER),
    (task("4", "number", metadata={"metric": "mra"}), MRA_SCORER),
    (task("\\frac{1}{2}", "math"), MATH_SCORER),
    (task("paris", "text"), TEXT_SCORER),
])
def test_empty_or_none_prediction_scores_zero_with_detail(t: Task, scorer: str) -> None:
    for prediction in (None, "", "   \n"):
        assert verify(t, prediction) == Verdict(0.0, False, scorer, "empty prediction")
    assert verify(t, t.answer).correct


def test_verify_reads_the_answer_tag_of_a_full_response() -> None:
    response = ("<code>\n```python\nprint(1)\n```\n</code>\n<interpreter>1</interpreter>\n"
                "So there are four.\n<answer>\\boxed{4}</answer>")
    assert verify(task("4", "number"), response).correct
    assert verify(task("4", "number"), response, number_rel_tol=0.0).correct
