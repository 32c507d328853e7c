"""Which scorer decided each evaluated sample, and scoring stored predictions again.

Benchmarks whose official scorer asks an LLM judge (MathVerse; HR-Bench where its rules fail)
fall back to their rules when the judge does not answer. The same prediction can then score 1
with the judge up and 0 with it down, so every stored sample records which scorer decided it
(``scored_by``): ``judge``, ``rules`` (the rules decided and no judge was asked: no judge
configured, a benchmark without one, HR-Bench's rules reading the letter, an empty answer) or
``rule_fallback`` (the judge was asked and did not answer). Aggregates built on fallbacks say so
in their scorer, the evaluation summary and ``pyvision report`` count them, and
:func:`rescore` asks the judge again for exactly those samples once it is back.
"""

from __future__ import annotations

import shlex
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pipelines.core.records import Task
from pipelines.errors import DataError, UserError
from pipelines.scoring import FALLBACK, JUDGE, RULES, JudgeProbe, scoring_benchmark, takes_judge

if TYPE_CHECKING:
    from benchmarks.base import Benchmark
    from pipelines.config.recipe import Recipe
    from pipelines.config.reward import RewardConfig
    from pipelines.store import Store

@dataclass
class Scoring:
    """A benchmark with the judge it may ask (``probe`` is None when it asks none)."""

    bench: Benchmark
    probe: JudgeProbe | None = None
    judge_model: str | None = None

    @property
    def scorer(self) -> str:
        """The scorer as configured: the reference, plus the judge when one may be asked."""
        return self.bench.reference + (f"; judge {self.judge_model}" if self.probe else "")

    def sample_scorer(self, scored_by: str) -> str:
        """The scorer that actually decided one sample."""
        if scored_by == JUDGE:
            return self.scorer
        if scored_by == FALLBACK:
            return (f"{self.bench.reference}; rule fallback (judge {self.judge_model} did not "
                    "answer)")
        return self.bench.reference

    def aggregate_scorer(self, counts: Counter[str]) -> str:
        """The configured scorer, marked when some samples were decided by the rule fallback."""
        fallbacks = counts.get(FALLBACK, 0)
        if not fallbacks:
            return self.scorer
        return f"{self.scorer}; rule fallback for {fallbacks} of {sum(counts.values())} samples"

    def score(self, task: Task, prediction: str | None) -> tuple[dict[str, float], str]:
        """Per-sample scores and which scorer decided them."""
        if self.probe is None:
            return self.bench.score(task, prediction), RULES
        self.probe.reset()
        scores = self.bench.score(task, prediction)
        return scores, self.probe.outcome()


def scoring_for(name: str, judge: Any, judge_model: str | None, reward: RewardConfig) -> Scoring:
    """Benchmark ``name`` built as the RL reward builds it (the reward's tolerances), given
    ``judge`` (a :class:`pipelines.scoring.judge.Judge`, or None) when its official scorer takes one."""
    if judge is None or not takes_judge(name):
        return Scoring(scoring_benchmark(name, reward))
    probe = JudgeProbe(judge, name)
    return Scoring(scoring_benchmark(name, reward, probe), probe, judge_model)


def store_aggregate(store: Store, run_id: str, model_tag: str, scoring: Scoring,
                    tasks: dict[str, Task]) -> tuple[dict[str, float], int, Counter[str]]:
    """Aggregate the stored samples of ``tasks`` and store it, with the scorer marked when some
    samples were decided by the rule fallback; returns (aggregate, samples, scored_by counts)."""
    bench = scoring.bench
    stored = store.eval_scores(run_id, model_tag, bench.name)
    samples = [(tasks[sid], s) for sid, s in stored.items() if sid in tasks]
    aggregate = bench.aggregate(samples) if samples else {}
    records = [r for r in store.eval_records(run_id, model_tag, bench.name)
               if r["sample_id"] in tasks]
    counts = Counter(r["scored_by"] or "unknown" for r in records)
    prompt_versions = {r["prompt_version"] for r in records}
    store.set_eval_aggregate(run_id, model_tag, bench.name, aggregate, n=len(samples),
                             benchmark_version=bench.version,
                             prompt_version=",".join(sorted(prompt_versions)),
                             scorer=scoring.aggregate_scorer(counts))
    return aggregate, len(samples), counts


def fallback_warning(run_id: str, model_tag: str, benchmark: str, counts: Counter[str]) -> str:
    """One line for a result that used the rule fallback ("" when it did not)."""
    fallbacks = counts.get(FALLBACK, 0)
    if not fallbacks:
        return ""
    command = shlex.join(["pyvision", "eval", "score", "--run-id", run_id, "--model-tag",
                          model_tag, "--benchmark", benchmark])
    return (f"{model_tag} on {benchmark}: the judge did not answer for {fallbacks} of "
            f"{sum(counts.values())} samples; the rule fallback scored them (marked in the store "
            f"and the report). When the judge is back: {command}")


def rescore(store: Store, recipe: Recipe, run_id: str, benchmark: str,
            model_tag: str | None = None) -> dict[str, dict[str, Any]]:
    """Ask the judge again for the stored samples of ``benchmark`` in ``run_id`` (every model tag,
    or ``model_tag``) that the rule fallback scored; update their scores and the aggregate.

    Returns ``{model_tag: {"rescored", "judged", "still_fallback", "scored_by", "aggregate"}}``.
    """
    from pipelines.scoring.judge import Judge

    records = store.eval_records(run_id, model_tag, benchmark, with_task=True)
    if not records:
        who = f" for model tag '{model_tag}'" if model_tag else ""
        raise UserError(f"run '{run_id}' has no stored samples of '{benchmark}'{who} in "
                        f"{store.path}", hint=f"check --run-id and --benchmark (and --model-tag); "
                        f"`pyvision report --run {run_id}` lists what the run evaluated")
    cfg = recipe.reward.judge
    if not cfg.base_url:
        raise UserError("no judge to re-score with: reward.judge.base_url is not set",
                        hint="pass --set reward.judge.base_url=URL (the run's stored recipe is "
                             "used otherwise)")
    scoring = scoring_for(benchmark, Judge(cfg, store=store), cfg.model, recipe.reward)
    if scoring.probe is None:
        raise UserError(f"'{benchmark}' is scored by rules only; there is no judge verdict to "
                        "ask for", hint="re-score a benchmark with a judge (mathverse, hrbench4k, "
                        "hrbench8k)")
    out: dict[str, dict[str, Any]] = {}
    for model in sorted({r["model"] for r in records}):
        rows = [r for r in records if r["model"] == model]
        _check_rescorable(rows, scoring.bench, run_id, model)
        tasks = {r["sample_id"]: Task.model_validate(r["task"]) for r in rows}
        pending = [r for r in rows if r["scored_by"] == FALLBACK]
        judged = 0
        for r in pending:
            scores, scored_by = scoring.score(tasks[r["sample_id"]], r["prediction"])
            judged += scored_by == JUDGE
            store.rescore_eval_sample(run_id, model, benchmark, r["sample_id"], scores=scores,
                                      scorer=scoring.sample_scorer(scored_by),
                                      scored_by=scored_by)
        aggregate, _, counts = store_aggregate(store, run_id, model, scoring, tasks)
        out[model] = {"rescored": len(pending), "judged": judged,
                      "still_fallback": counts.get(FALLBACK, 0), "scored_by": dict(counts),
                      "aggregate": aggregate}
    return out


def _check_rescorable(rows: list[dict[str, Any]], bench: Benchmark, run_id: str,
                      model: str) -> None:
    """Every stored sample carries its task and was scored by this benchmark version."""
    where = f"{model} on {bench.name} in run '{run_id}'"
    no_task = [r["sample_id"] for r in rows if not r.get("task")]
    if no_task:
        raise DataError(f"{len(no_task)} stored samples of {where} (e.g. {no_task[0]}) were "
                        "stored without their task by an older pyvision and cannot be scored "
                        "again from the store", hint="evaluate them again under a new --run-id")
    versions = sorted({r["benchmark_version"] for r in rows} - {bench.version})
    if versions:
        raise DataError(f"stored samples of {where} were scored by {bench.name} version "
                        f"{versions[0]}, this pyvision has version {bench.version}",
                        hint="evaluate them again under a new --run-id")
