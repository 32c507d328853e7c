"""The trajectory reward: accuracy, the accumulative tool reward, and the guards.

- Accuracy: a task of a registered benchmark (V*, HR-Bench, MathVerse, VSI-Bench, the synthetic
  sets) is judged by that benchmark's own scorer, built exactly as evaluation builds it
  (:mod:`pipelines.scoring`: the reward's tolerances, the judge where the official scorer asks
  one), so a training reward and an evaluation score cannot disagree. Other tasks go to the
  answer-type verifiers (:func:`benchmarks.scoring.verify`) with the same tolerances; their answer
  types listed in ``judge.use_for`` go to the LLM judge first. When the judge does not answer,
  the rules decide and the fallback is counted.
- Tool reward (accumulative): ``tool_reward_per_call`` per *successful* tool call, added only when
  the answer is correct, optionally capped (paper: +0.1 per call).
- Guards: an answer longer than ``max_answer_chars`` zeroes the **whole** reward, tool bonus
  included (the original code let the bonus survive it); a trajectory without a well-formed
  ``<answer>`` gets accuracy 0 and, optionally, ``-format_penalty``.

Every term is kept separately in :class:`RewardBreakdown`.
"""

from __future__ import annotations

import threading
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from pipelines.config.reward import RewardConfig
from pipelines.core.records import Task
from pipelines.scoring import (
    FALLBACK,
    JUDGE,
    RULES,
    JudgeProbe,
    benchmark_for_task,
    scoring_benchmark,
    takes_judge,
)

if TYPE_CHECKING:
    from pipelines.scoring.judge import Judge


@dataclass(frozen=True)
class RewardBreakdown:
    total: float
    accuracy: float
    tool: float
    format: float
    correct: bool
    scorer: str
    judged: bool
    judge_fallback: bool
    detail: str = ""

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def compute_reward(task: Task, final_answer: str | None, *, answer_chars: int,
                   successful_tool_calls: int, well_formed: bool, cfg: RewardConfig,
                   judge: Judge | None = None) -> RewardBreakdown:
    """The reward of one finished trajectory, term by term."""
    from benchmarks.scoring import verify

    if not well_formed or final_answer is None:
        return RewardBreakdown(-cfg.format_penalty, 0.0, 0.0, -cfg.format_penalty, False,
                               "format", False, False, "no well-formed <answer>")
    if answer_chars > cfg.max_answer_chars:
        return RewardBreakdown(0.0, 0.0, 0.0, 0.0, False, "length-guard", False, False,
                               f"answer of {answer_chars} characters > {cfg.max_answer_chars}")
    judged = fallback = False
    name = benchmark_for_task(task)
    if name is not None:
        bench, probe = _benchmark(name, cfg, judge)
        if probe is not None:
            probe.reset()
        _, value, correct = bench.verdict(task, final_answer)
        accuracy = value if cfg.accuracy_mode == "mra" else float(correct)
        outcome = probe.outcome() if probe is not None else RULES
        judged, fallback = outcome == JUDGE, outcome == FALLBACK
        scorer = f"{bench.name}@{bench.version}" + (f";judge:{judge.model}" if judged else "")
        detail = "judge unavailable, rules used" if fallback else ""
        return _with_tool(cfg, accuracy, correct, scorer, judged, fallback, detail,
                          successful_tool_calls)
    verdict = verify(task, final_answer, number_rel_tol=cfg.number_rel_tol,
                     mra_threshold=cfg.mra_threshold)
    correct, scorer, detail = verdict.correct, verdict.scorer, verdict.detail
    accuracy = verdict.score if (cfg.accuracy_mode == "mra" and verdict.scorer.startswith("mra")) \
        else float(verdict.correct)
    if judge is not None and task.answer_type in cfg.judge.use_for:
        score = judge.judge(task.question, final_answer, task.answer, task.data_source)
        if score is None:
            fallback = True
            detail = f"judge unavailable, rule verifier used ({detail})" if detail else \
                "judge unavailable, rule verifier used"
        else:
            judged = True
            correct, accuracy, scorer = score >= 0.5, float(score >= 0.5), f"judge:{judge.model}"
    return _with_tool(cfg, accuracy, correct, scorer, judged, fallback, detail,
                      successful_tool_calls)


def _with_tool(cfg: RewardConfig, accuracy: float, correct: bool, scorer: str, judged: bool,
               fallback: bool, detail: str, successful_tool_calls: int) -> RewardBreakdown:
    """Add the accumulative tool reward (only to a correct answer)."""
    tool = 0.0
    if correct:
        tool = cfg.tool_reward_per_call * successful_tool_calls
        if cfg.tool_reward_cap is not None:
            tool = min(tool, cfg.tool_reward_cap)
    return RewardBreakdown(accuracy + tool, accuracy, tool, 0.0, correct, scorer, judged, fallback,
                           detail)


_BENCHMARKS: dict[tuple, tuple[Any, JudgeProbe | None]] = {}
_BENCHMARKS_LOCK = threading.Lock()


def _benchmark(name: str, cfg: RewardConfig, judge: Judge | None) -> tuple[Any, JudgeProbe | None]:
    """Benchmark ``name`` built for scoring with ``cfg``'s tolerances (and its judge probe when
    its official scorer asks one), once per setting."""
    key = (name, cfg.number_rel_tol, cfg.mra_threshold, id(judge))
    with _BENCHMARKS_LOCK:
        if key not in _BENCHMARKS:
            probe = JudgeProbe(judge, name) if judge is not None and takes_judge(name) else None
            _BENCHMARKS[key] = (scoring_benchmark(name, cfg, probe), probe)
        return _BENCHMARKS[key]
