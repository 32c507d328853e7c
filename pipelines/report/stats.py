"""What the report compares, and how sure it is: the primary metric of a result, the model pairs
compared within a run, and the paired bootstrap behind each verdict.

Held-out sets are small (the embedded demo's have 48 and 32 samples), so a difference of a few
points between two models can be noise. Within a run, the report therefore compares SFT with base
and RL with SFT on the samples both answered: the mean paired difference and its 95% bootstrap
interval, and a verdict that says "ahead" or "behind" only when the interval excludes zero.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from typing import Any

PRIMARY_METRICS = ("overall", "accuracy", "average", "acc", "score")
# The method's order of models, wherever models are listed.
MODEL_ORDER = {"base": 0, "sft": 1, "rl": 2}
# (challenger, baseline) pairs compared within a run, in the order the method produces them.
COMPARISONS = (("sft", "base"), ("rl", "sft"))
LEVEL = 0.95  # of the bootstrap interval around a paired difference


_PRIMARY: dict[str, str | None] = {}


def benchmark_primary(benchmark: str) -> str | None:
    """The registered benchmark's own headline metric (``vstar_overall_acc``), or None."""
    if benchmark not in _PRIMARY:
        try:
            from benchmarks import benchmark_class

            _PRIMARY[benchmark] = benchmark_class(benchmark).primary_metric
        except Exception:  # noqa: BLE001 - an unknown or unimportable benchmark: fall back below
            _PRIMARY[benchmark] = None
    return _PRIMARY[benchmark]


def primary_metric(metrics: Iterable[str], benchmark: str | None = None) -> str:
    """The headline among ``metrics``: ``benchmark``'s own primary metric when it is there (V*'s
    and VSI-Bench's are not the first of their names in any order), else by name."""
    names = list(metrics)
    primary = benchmark_primary(benchmark) if benchmark else None
    if primary in names:
        return primary
    for m in PRIMARY_METRICS:
        if m in names:
            return m
    return min(names)


def paired_bootstrap(deltas: list[float], *, resamples: int = 2000, level: float = LEVEL,
                     seed: int = 0) -> tuple[float, float, float]:
    """Mean of paired per-sample differences and its percentile bootstrap interval.

    Deterministic for a given ``seed``, so a report rendered twice says the same thing."""
    return stratified_bootstrap([deltas], resamples=resamples, level=level, seed=seed)


def stratified_bootstrap(groups: list[list[float]], *, resamples: int = 2000,
                         level: float = LEVEL, seed: int = 0) -> tuple[float, float, float]:
    """``paired_bootstrap`` over the differences of several runs, pooled: each resample draws
    within every run, so each run keeps its size and seed-to-seed spread stays in the interval's
    width only as sampling noise (the runs are strata, not samples)."""
    import numpy as np

    arrays = [np.asarray(g, dtype=float) for g in groups if len(g)]
    total = sum(a.size for a in arrays)
    if total == 0:
        raise ValueError("no paired samples to compare")
    rng = np.random.default_rng(seed)
    sums = np.zeros(resamples)
    for a in arrays:
        sums += a[rng.integers(0, a.size, size=(resamples, a.size))].sum(axis=1)
    means = sums / total
    tail = (1.0 - level) / 2.0
    mean = sum(float(a.sum()) for a in arrays) / total
    return mean, float(np.quantile(means, tail)), float(np.quantile(means, 1.0 - tail))


def verdict(low: float, high: float) -> str:
    if low > 0:
        return "ahead"
    if high < 0:
        return "behind"
    return "not separable"


def _comparison(run: str, benchmark: str, challenger: str, baseline: str, metric: str,
                groups: list[list[tuple[float, float]]]) -> dict[str, Any]:
    pairs = [p for g in groups for p in g]
    delta, low, high = stratified_bootstrap([[x - y for x, y in g] for g in groups])
    return {"run": run, "benchmark": benchmark, "model": challenger, "baseline": baseline,
            "metric": metric, "n": len(pairs), "value": sum(x for x, _ in pairs) / len(pairs),
            "baseline_value": sum(y for _, y in pairs) / len(pairs),
            "delta": delta, "ci_low": low, "ci_high": high, "level": LEVEL,
            "verdict": verdict(low, high)}


Paired = dict[str, list[tuple[str, str, str, list[tuple[float, float]]]]]
"""Benchmark -> ``paired_scores`` of one run."""


def compare_models(run_id: str, paired: Paired) -> list[dict[str, Any]]:
    """Paired comparisons (see ``COMPARISONS``) of one run's models, benchmark by benchmark."""
    return [_comparison(run_id, bench, challenger, baseline, metric, [pairs])
            for bench in sorted(paired)
            for challenger, baseline, metric, pairs in paired[bench]]


def pooled_comparisons(runs: list[dict[str, Any]],
                       paired_by_run: dict[str, Paired]) -> list[dict[str, Any]]:
    """The same comparisons pooled over the runs of one recipe (seeds of one setting, say):
    per-run differences resampled within each run. Runs of different recipes never mix."""
    by_recipe: dict[str, list[str]] = defaultdict(list)
    for r in runs:
        by_recipe[r["name"]].append(r["run_id"])
    out = []
    for name, ids in sorted(by_recipe.items()):
        if len(ids) < 2:
            continue
        groups: dict[tuple[str, str, str, str], dict[str, list]] = defaultdict(dict)
        for rid in ids:
            for bench, rows in paired_by_run.get(rid, {}).items():
                for challenger, baseline, metric, pairs in rows:
                    groups[(bench, challenger, baseline, metric)][rid] = pairs
        order = {pair: i for i, pair in enumerate(COMPARISONS)}
        for (bench, challenger, baseline, metric), per_run in sorted(
                groups.items(), key=lambda kv: (kv[0][0], order[kv[0][1:3]], kv[0][3])):
            if len(per_run) < 2:
                continue
            row = _comparison(f"{name}: {len(per_run)} runs pooled", bench, challenger,
                              baseline, metric, list(per_run.values()))
            out.append({**row, "runs": sorted(per_run)})
    return out
