"""Answer verifiers shared by RL rewards, the synthetic held-out sets and the benchmark fallbacks.

One entry point, :func:`verify`, turns a task and a final-answer text into a :class:`Verdict`.
The RL reward calls it, and so do the synthetic benchmarks, so a training reward and an
evaluation score of the same answer cannot disagree. The public benchmarks report their
*official* numbers with the exact rules of their reference scorer (see ``benchmarks/vstar.py``
and the others); those rules are ports of lmms-eval 0.7.3, and where they are looser than these
verifiers (V* reads "Dog" as the letter D) the benchmark follows the reference, not us.

Predictions are model output, so hostile input: every function here accepts any string (or
None) and never raises on it; a prediction that cannot be read scores 0 with a ``detail`` saying
why. Regular expressions are linear (no nested quantifiers on the same text), and the symbolic
check of :func:`score_math` runs under math-verify's time limit in the main thread.

Scorer ids carry a version (``choice@1``); bump it when a rule changes what it accepts, so stored
scores say which rule produced them.
"""

from __future__ import annotations

import math
import re
import threading
import unicodedata
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pipelines.core.records import Task

CHOICE_SCORER = "choice@1"
NUMBER_SCORER = "number@1"
MRA_SCORER = "mra@1"
MATH_SCORER = "math-verify@1"
TEXT_SCORER = "text@1"

# math-verify parses at most this many trailing characters, and nothing nested deeper than
# _MATH_MAX_DEPTH: a final answer is short and shallow, and sympy on hostile LaTeX is the one
# place a scorer could stall (outside the main thread math-verify has no time limit).
_MATH_MAX_CHARS = 400
_MATH_MAX_DEPTH = 12
_MATH_TIMEOUT_S = 5


@dataclass(frozen=True)
class Verdict:
    """The outcome of checking one prediction against one gold answer."""

    score: float
    """In [0, 1]; for MRA-scored numbers the MRA value itself, else 1.0 or 0.0."""

    correct: bool
    """Binary correctness (for MRA: MRA >= the threshold)."""

    scorer: str
    """Versioned scorer id, e.g. ``choice@1``, ``mra@1``, ``math-verify@1``."""

    detail: str = ""
    """Short human-readable reason (``no number in prediction`` ...)."""


# -- final-answer extraction -------------------------------------------------------------------

_BOX_OPEN_RE = re.compile(r"\\(?:boxed|fbox)\s*\{")
_SPACES_RE = re.compile(r"[ \t\r\f\v]+")
_TEXT_MACRO_RE = re.compile(r"\\(?:text|textbf|mathrm|mathbf|textit|operatorname)\s*\{([^{}]*)\}")


def _last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` with balanced braces (nested braces kept whole)."""
    starts = [m.end() for m in _BOX_OPEN_RE.finditer(text)]
    if not starts:
        return None
    start = starts[-1]
    depth = 1
    for i in range(start, len(text)):
        ch = text[i]
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                return text[start:i]
    return None


def extract_final_answer(text: str | None) -> str:
    """The answer part of a response: inside the last ``<answer>`` tag and last ``\\boxed{}``.

    A response without tags or boxes is returned stripped, so a bare final answer ("B", "3.5")
    passes through unchanged.
    """
    if not text:
        return ""
    out = text
    lowered = out.lower()
    start = lowered.rfind("<answer>")
    if start >= 0:
        end = lowered.find("</answer>", start)
        out = out[start + len("<answer>"):end if end >= 0 else len(out)]
    boxed = _last_boxed(out)
    if boxed is not None:
        out = boxed
    out = out.strip()
    for left, right in (("$$", "$$"), ("$", "$"), ("\\(", "\\)"), ("\\[", "\\]")):
        if len(out) > len(left) + len(right) and out.startswith(left) and out.endswith(right):
            out = out[len(left):-len(right)].strip()
            break
    return out


def _plain(text: str) -> str:
    """Unicode-normalised text with ``\\text{x}``-style wrappers reduced to ``x``."""
    text = unicodedata.normalize("NFKC", text).replace("\u2212", "-")
    # Collapsed runs keep every regex below linear on hostile padding.
    text = _SPACES_RE.sub(" ", text)
    for _ in range(3):  # nested wrappers such as \text{\textbf{B}}
        new = _TEXT_MACRO_RE.sub(r"\1", text)
        if new == text:
            break
        text = new
    return text


def _empty(scorer: str) -> Verdict:
    return Verdict(0.0, False, scorer, "empty prediction")


# -- text ----------------------------------------------------------------------------------------

_ARTICLES_RE = re.compile(r"\b(a|an|the)\b")


def normalize_text(text: str) -> str:
    """Lower case, no punctuation, no articles, single spaces (SQuAD-style normalisation)."""
    text = _plain(text).lower()
    text = "".join(" " if unicodedata.category(ch).startswith("P") else ch for ch in text)
    text = _ARTICLES_RE.sub(" ", text)
    return " ".join(text.split())


def score_text(prediction: str | None, gold: str) -> Verdict:
    """Normalised exact match (case, whitespace, punctuation and articles ignored)."""
    pred = extract_final_answer(prediction)
    if not pred:
        return _empty(TEXT_SCORER)
    ok = normalize_text(pred) == normalize_text(gold) and bool(normalize_text(gold))
    return Verdict(float(ok), ok, TEXT_SCORER,
                   "normalised text matches" if ok else "normalised text differs")


# -- multiple choice -----------------------------------------------------------------------------

# A letter introduced by a keyword: "Answer: B", "the answer is (b)", "option C", "choice: d".
_KEYWORD_LETTER_RE = re.compile(
    r"\b(?:answer|option|choice)\b(?:\s+is\b)?\s*(?:[:=]\s*)?"
    r"(?:\(([A-Za-z])\)|([A-Za-z])(?![A-Za-z']))")
# After a keyword a lower-case letter counts only when a closing mark or the end follows it:
# "the answer is b." is a letter, "the answer is a car" is a word.
_LETTER_END_RE = re.compile(r"\s*(?:$|[.):,;!\]\n])")
# "(B)" anywhere, or a letter followed by a closing mark at the very start ("b) ...", "B. ...").
_PAREN_LETTER_RE = re.compile(r"\(([A-Za-z])\)")
_LEADING_LETTER_RE = re.compile(r"^\s*\[?([A-Za-z])\s*[.):\]](?:\s|$)")
# A capital letter standing alone and followed by an end or a closing mark: "It is B." but not
# the article in "A red car" nor the pronoun in "I think".
_BARE_LETTER_RE = re.compile(r"(?<![A-Za-z0-9'])([A-Z])(?=\s*(?:$|[.,;:!)\]\n]))")
# Letters listed together ("A or B", "C, D", "A/B"): all of them count, so hedging is ambiguous.
_LETTER_LIST_RE = re.compile(
    r"(?<![A-Za-z0-9'])\(?([A-Z])\)?\s*(?:,|/|\bor\b|\band\b)\s*\(?([A-Z])(?![A-Za-z0-9'])")


def _whole_letter(text: str) -> str | None:
    """The letter when the whole answer is one: "B", "(b)", "[B].", "B:"."""
    core = text.strip().rstrip(".:").strip()
    if len(core) >= 2 and core[0] in "([" and core[-1] in ")]":
        core = core[1:-1].strip()
    return core if len(core) == 1 and "A" <= core.upper() <= "Z" else None


def _letter_index(letter: str) -> int:
    return ord(letter.upper()) - 65


def choice_letter(prediction: str, n_options: int = 0) -> tuple[str | None, str]:
    """The option letter a prediction commits to, or None, with a reason.

    Accepted: "B", "(B)", "B.", "b) text", "Answer: B", "the answer is (b)". A keyword form
    wins (the last one, the model's final statement); otherwise all letter marks must agree,
    so "A or B" is ambiguous rather than the first letter. With ``n_options`` letters beyond
    the options are ignored.
    """
    text = _plain(prediction).strip()

    def ok(letter: str) -> bool:
        return n_options <= 0 or 0 <= _letter_index(letter) < n_options

    whole = _whole_letter(text)
    if whole and ok(whole):
        return whole.upper(), "letter"
    keyword = []
    for m in _KEYWORD_LETTER_RE.finditer(text):
        letter = m.group(1) or m.group(2)
        if ok(letter) and (m.group(1) or letter.isupper() or _LETTER_END_RE.match(text, m.end())):
            keyword.append(letter)
    if keyword:
        return keyword[-1].upper(), "letter after 'answer'"
    marks = [m for m in _PAREN_LETTER_RE.findall(text) if ok(m)]
    lead = _LEADING_LETTER_RE.match(text)
    if lead and ok(lead.group(1)):
        marks.insert(0, lead.group(1))
    marks += [m for m in _BARE_LETTER_RE.findall(text) if ok(m)]
    marks += [m for pair in _LETTER_LIST_RE.findall(text) for m in pair if ok(m)]
    distinct = sorted({m.upper() for m in marks})
    if len(distinct) == 1:
        return distinct[0], "letter"
    if len(distinct) > 1:
        return None, f"ambiguous letters {', '.join(distinct)}"
    return None, "no option letter"


def _option_by_text(prediction: str, options: list[str]) -> int | None:
    """Index of the one option whose text the prediction gives, or None."""
    pred = normalize_text(prediction)
    norm = [normalize_text(o) for o in options]
    exact = [i for i, o in enumerate(norm) if o and o == pred]
    if len(exact) == 1:
        return exact[0]
    if not pred:
        return None
    contained = [i for i, o in enumerate(norm)
                 if o and re.search(rf"(?<!\w){re.escape(o)}(?!\w)", pred)]
    if len(contained) == 1:
        return contained[0]
    if len(contained) > 1:
        # "dark red" contains "red": the longest option wins only when it covers the others.
        longest = max(contained, key=lambda i: len(norm[i]))
        if all(norm[i] in norm[longest] for i in contained):
            return longest
    return None


def score_choice(prediction: str | None, gold_letter: str,
                 options: list[str] | None = None) -> Verdict:
    """Multiple choice: the prediction's letter (or option text) against the gold letter.

    ``gold_letter`` may also be the gold option's text when ``options`` are given.
    """
    options = list(options or [])
    pred = extract_final_answer(prediction)
    if not pred:
        return _empty(CHOICE_SCORER)
    gold = gold_letter.strip().strip("()").strip()
    if len(gold) == 1 and gold.isalpha():
        gold = gold.upper()
    else:
        idx = _option_by_text(gold, options) if options else None
        if idx is None:
            return Verdict(0.0, False, CHOICE_SCORER, f"gold '{gold_letter}' is not an option")
        gold = chr(65 + idx)
    letter, why = choice_letter(pred, len(options))
    if letter is None and options:
        idx = _option_by_text(pred, options)
        if idx is not None:
            letter, why = chr(65 + idx), "option text"
    if letter is None:
        detail = (why if why.startswith("ambiguous")
                  else "no option letter or option text in prediction")
        return Verdict(0.0, False, CHOICE_SCORER, detail)
    ok = letter == gold
    return Verdict(float(ok), ok, CHOICE_SCORER, f"read {letter} ({why}), gold {gold}")


# -- numbers -------------------------------------------------------------------------------------

NUMBER_WORDS: dict[str, int] = {
    "zero": 0, "one": 1, "two": 2, "three": 3, "four": 4, "five": 5, "six": 6, "seven": 7,
    "eight": 8, "nine": 9, "ten": 10, "eleven": 11, "twelve": 12, "thirteen": 13,
    "fourteen": 14, "fifteen": 15, "sixteen": 16, "seventeen": 17, "eighteen": 18,
    "nineteen": 19, "twenty": 20, "thirty": 30, "forty": 40, "fifty": 50, "sixty": 60,
    "seventy": 70, "eighty": 80, "ninety": 90, "hundred": 100, "thousand": 1000,
}
"""English number words, the same table lmms-eval's VSI-Bench scorer uses."""

# lmms-eval's digit pattern, kept verbatim in behaviour for VSI-Bench parity.
_REFERENCE_NUM_RE = re.compile(r"-?\d+(?:\.\d+)?")
# Ours: a minus only when it is not a hyphen ("room-2"), thousands separators, leading-dot
# decimals, exponents, simple fractions ("3/4") and LaTeX fractions.
_NUM_RE = re.compile(
    r"\\d?frac\{\s*(-?\d+(?:\.\d+)?)\s*\}\{\s*(-?\d+(?:\.\d+)?)\s*\}"
    r"|(?<![A-Za-z0-9.,])(-?)(\d{1,3}(?:,\d{3})+(?!\d)(?:\.\d+)?|\d+(?:\.\d+)?|\.\d+)"
    r"(?:[eE]([-+]?\d+))?(?:/(\d+)(?![\d./]))?")
_WORD_RE = re.compile(r"[a-z]+")


def _word_number(text: str, strict_run: bool) -> tuple[int, float] | None:
    """(position, value) of the first run of number words, or None.

    ``strict_run=False`` is lmms-eval's rule: after the first number word, later number words
    extend the run wherever they are ("and" is skipped, any other word ends it). ``True`` also
    ends the run at anything but spaces or hyphens between words, so "two, three" reads 2.
    """
    start = None
    tokens: list[str] = []
    prev_end = 0
    for m in _WORD_RE.finditer(text):
        tok = m.group(0)
        if start is None:
            if tok in NUMBER_WORDS:
                start, prev_end = m.start(), m.end()
                tokens.append(tok)
            continue
        if strict_run and text[prev_end:m.start()].strip(" -"):
            break
        prev_end = m.end()
        if tok == "and":
            continue
        if tok not in NUMBER_WORDS:
            break
        tokens.append(tok)
    if start is None:
        return None
    total, current = 0, 0
    for tok in tokens:
        value = NUMBER_WORDS[tok]
        if value == 100:
            current = max(current, 1) * 100
        elif value == 1000:
            total += max(current, 1) * 1000
            current = 0
        else:
            current += value
    return start, float(total + current)


def extract_number(text: str | None, *, extended: bool = True) -> float | None:
    """The first number in ``text`` (digits or English number words), or None.

    ``extended=False`` reproduces lmms-eval's VSI-Bench ``extract_number`` exactly (its digit
    pattern reads "1,234" as 1 and "room-2" as -2). The default also reads thousands
    separators, fractions (``3/4``, ``\\frac{3}{4}``), exponents and leading-dot decimals,
    treats a minus glued to a word as a hyphen, and ends a run of number words at punctuation.
    """
    if text is None:
        return None
    s = str(text).strip().lower()
    if not s:
        return None
    if extended:
        s = _plain(s)
    words = _word_number(s, strict_run=extended)
    if not extended:
        m = _REFERENCE_NUM_RE.search(s)
        if m is not None and (words is None or m.start() < words[0]):
            return float(m.group(0))
        return words[1] if words else None
    for m in _NUM_RE.finditer(s):
        if words is not None and words[0] < m.start():
            return words[1]
        try:
            if m.group(1) is not None:
                den = float(m.group(2))
                return float(m.group(1)) / den if den else None
            value = float(m.group(4).replace(",", ""))
            if m.group(5):
                value *= 10.0 ** int(m.group(5))
            if m.group(6):
                den = float(m.group(6))
                if den == 0:
                    return None
                value /= den
        except (OverflowError, ValueError):
            return None
        if not math.isfinite(value):
            return None
        return -value if m.group(3) else value
    return words[1] if words else None


def _numbers(prediction: str | None, gold: str | float, scorer: str) -> tuple[float, float] | Verdict:
    """(the prediction's final answer's first number, the gold's), or the ``scorer``'s
    verdict on why one of them is missing."""
    pred_text = extract_final_answer(prediction)
    if not pred_text:
        return _empty(scorer)
    gold_value = gold if isinstance(gold, (int, float)) else extract_number(str(gold))
    if gold_value is None:
        return Verdict(0.0, False, scorer, f"gold '{gold}' is not a number")
    value = extract_number(pred_text)
    if value is None:
        return Verdict(0.0, False, scorer, "no number in prediction")
    return value, float(gold_value)


def score_number(prediction: str | None, gold: str | float, rel_tol: float = 0.01) -> Verdict:
    """The first number of the prediction equals the gold within ``rel_tol`` (relative)."""
    read = _numbers(prediction, gold, NUMBER_SCORER)
    if isinstance(read, Verdict):
        return read
    value, gold_value = read
    ok = math.isclose(value, gold_value, rel_tol=rel_tol, abs_tol=1e-9)
    return Verdict(float(ok), ok, NUMBER_SCORER, f"read {value:g}, gold {gold_value:g}")


def mean_relative_accuracy(pred: float, gold: float, start: float = 0.5, end: float = 0.95,
                           interval: float = 0.05) -> float:
    """VSI-Bench's mean relative accuracy: the share of thresholds t in [start, end] (step
    ``interval``) for which |pred - gold| / |gold| <= 1 - t.

    Identical to lmms-eval's ``mean_relative_accuracy`` for gold > 0 (the same numpy grid, so the
    same answer at every boundary). Two deliberate differences where the reference misbehaves:
    a negative gold uses its magnitude (the reference gives every prediction full marks), and a
    zero gold scores 1 only for an exact 0 (the reference divides by zero).
    """
    import numpy as np

    n_points = int((end - start) / interval + 2)
    thresholds = np.linspace(start, end, n_points)
    if gold == 0:
        return 1.0 if pred == 0 else 0.0
    relative_error = abs(pred - gold) / abs(gold)
    return float((relative_error <= 1 - thresholds).mean())


def score_mra(prediction: str | None, gold: str | float, threshold: float = 0.5) -> Verdict:
    """A number scored by mean relative accuracy; correct when MRA >= ``threshold``."""
    read = _numbers(prediction, gold, MRA_SCORER)
    if isinstance(read, Verdict):
        return read
    value, gold_value = read
    mra = mean_relative_accuracy(value, gold_value)
    return Verdict(mra, mra >= threshold, MRA_SCORER,
                   f"read {value:g}, gold {gold_value:g}, MRA {mra:.2f}")


# -- mathematics ---------------------------------------------------------------------------------

_LATEX_DELIMS = ("$", "\\(", "\\[", "\\boxed", "\\begin")


def _as_latex(text: str) -> str:
    """Wrap bare LaTeX in ``$...$``: math-verify only looks inside math delimiters for LaTeX."""
    text = text.strip()
    if any(d in text for d in _LATEX_DELIMS):
        return text
    return f"${text}$"


def _nesting_depth(text: str) -> int:
    depth = deepest = 0
    for ch in text:
        if ch in "([{":
            depth += 1
            deepest = max(deepest, depth)
        elif ch in ")]}":
            depth = max(depth - 1, 0)
    return deepest


def _math_parse(text: str, timeout: int | None) -> list:
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse

    configs = [LatexExtractionConfig(), ExprExtractionConfig()]
    parsed = parse(_as_latex(text), extraction_config=configs, parsing_timeout=timeout)
    if not parsed:
        parsed = parse(text, extraction_config=configs, parsing_timeout=timeout)
    return parsed


def score_math(prediction: str | None, gold: str) -> Verdict:
    """Mathematical equivalence with math-verify (LaTeX or plain), falling back to normalised
    text equality when neither side parses (e.g. a gold "A" or a word answer)."""
    pred = extract_final_answer(prediction)
    if not pred:
        return _empty(MATH_SCORER)
    pred = pred[-_MATH_MAX_CHARS:]
    if _nesting_depth(pred) > _MATH_MAX_DEPTH:
        return Verdict(0.0, False, MATH_SCORER, "expression nested too deeply to parse")
    from math_verify import verify as mv_verify

    # math-verify's time limit uses SIGALRM, which exists only in the main thread.
    timeout = _MATH_TIMEOUT_S if threading.current_thread() is threading.main_thread() else None
    gold_parsed = _math_parse(gold, timeout)
    pred_parsed = _math_parse(pred, timeout)
    if gold_parsed and pred_parsed and mv_verify(gold_parsed, pred_parsed, timeout_seconds=timeout):
        return Verdict(1.0, True, MATH_SCORER, "equivalent")
    if normalize_text(pred) and normalize_text(pred) == normalize_text(gold):
        return Verdict(1.0, True, MATH_SCORER, "same text")
    if not pred_parsed:
        return Verdict(0.0, False, MATH_SCORER, "no expression in prediction")
    return Verdict(0.0, False, MATH_SCORER, "not equivalent")


# -- dispatch ------------------------------------------------------------------------------------


def scorer_for(task: Task) -> str:
    """The scorer id :func:`verify` uses for ``task``."""
    if task.answer_type == "number":
        return MRA_SCORER if task.metadata.get("metric") == "mra" else NUMBER_SCORER
    return {"choice": CHOICE_SCORER, "math": MATH_SCORER, "text": TEXT_SCORER}[task.answer_type]


def verify(task: Task, prediction: str | None, *, number_rel_tol: float = 0.01,
           mra_threshold: float = 0.5) -> Verdict:
    """Check ``prediction`` (a final answer, or a response with ``<answer>``/``\\boxed{}``)
    against ``task.answer`` with the verifier its ``answer_type`` selects.

    ``number`` tasks whose ``metadata["metric"]`` is ``"mra"`` are scored VSI-Bench style:
    ``score`` is the MRA and ``correct`` means MRA >= ``mra_threshold``. None or an empty
    prediction scores 0; nothing a model writes makes this raise.
    """
    scorer = scorer_for(task)
    if prediction is None or not str(prediction).strip():
        return _empty(scorer)
    if scorer == MRA_SCORER:
        return score_mra(prediction, task.answer, mra_threshold)
    if scorer == NUMBER_SCORER:
        return score_number(prediction, task.answer, number_rel_tol)
    if scorer == CHOICE_SCORER:
        return score_choice(prediction, task.answer, task.options)
    if scorer == MATH_SCORER:
        return score_math(prediction, task.answer)
    return score_text(prediction, task.answer)
