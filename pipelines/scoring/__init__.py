"""One answer to "is this right?", for the RL reward and for evaluation alike.

A task of a registered benchmark (loaded by it, so it keeps the raw row its official scorer reads:
V*, HR-Bench, MathVerse, VSI-Bench; or a synthetic task) is judged by that benchmark's own scorer, built with the reward's
tolerances (``reward.number_rel_tol``, ``reward.mra_threshold``) and, where its official scorer
asks one, the LLM judge; evaluation builds the benchmark the same way (:func:`scoring_benchmark`).
Tasks of other sources (the RL training sets) go to the answer-type verifiers
(:func:`benchmarks.scoring.verify`) with the same tolerances.

:class:`JudgeProbe` is the judge callable a benchmark receives: it remembers, per thread, whether
the sample being scored asked the judge and whether it answered, so every score records which
scorer decided it (``judge``, ``rules``, or ``rule_fallback`` when the judge did not answer).
"""

from __future__ import annotations

import inspect
import threading
from functools import lru_cache
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from benchmarks.base import Benchmark
    from pipelines.config.reward import RewardConfig

JUDGE = "judge"
RULES = "rules"
FALLBACK = "rule_fallback"


class JudgeProbe:
    """The judge callable a benchmark receives; remembers, per thread, whether the sample being
    scored asked it and whether it answered."""

    def __init__(self, judge: Any, benchmark: str) -> None:
        self.judge = judge
        self.benchmark = benchmark
        self._seen = threading.local()

    def __call__(self, question: str, prediction: str, gold: str) -> float | None:
        verdict = self.judge.judge(question, prediction, gold, self.benchmark)
        self._seen.asked = True
        self._seen.answered = getattr(self._seen, "answered", False) or verdict is not None
        return verdict

    def reset(self) -> None:
        self._seen.asked = self._seen.answered = False

    def outcome(self) -> str:
        if getattr(self._seen, "answered", False):
            return JUDGE
        return FALLBACK if getattr(self._seen, "asked", False) else RULES


def benchmark_for_task(task: Any) -> str | None:
    """The benchmark that scores ``task``: its ``data_source``'s benchmark when the task carries
    the raw row that benchmark's scorer reads (or needs none, as the synthetic sets), else None."""
    name = benchmark_for_source(task.data_source)
    if name is None:
        return None
    from benchmarks import benchmark_class

    needs_row = getattr(benchmark_class(name), "source_prefix", None) is None
    return name if not needs_row or "row" in task.metadata else None


@lru_cache(maxsize=256)
def benchmark_for_source(data_source: str) -> str | None:
    """The registered benchmark whose tasks carry ``data_source`` (the synthetic sets match by
    prefix), or None."""
    from benchmarks import BENCHMARKS, benchmark_class

    if data_source in BENCHMARKS:
        return data_source
    for name in BENCHMARKS:
        prefix = getattr(benchmark_class(name), "source_prefix", None)
        if prefix and data_source.startswith(prefix):
            return name
    return None


def takes_judge(name: str) -> bool:
    """Whether benchmark ``name``'s official scorer asks an LLM judge."""
    from benchmarks import benchmark_class

    return "judge" in inspect.signature(benchmark_class(name)).parameters


def scoring_benchmark(name: str, reward: RewardConfig, judge: JudgeProbe | None = None
                      ) -> Benchmark:
    """Benchmark ``name`` as both the reward and the evaluation score with it: the reward's
    tolerances for the scorers that take them, and ``judge`` for those whose official scorer
    asks one."""
    from benchmarks import benchmark_class

    params = inspect.signature(benchmark_class(name)).parameters
    offered = {"number_rel_tol": reward.number_rel_tol, "mra_threshold": reward.mra_threshold,
               "judge": judge}
    return benchmark_class(name)(**{k: v for k, v in offered.items()
                                    if k in params and v is not None})
