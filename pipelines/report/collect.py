"""Everything the report shows, read from the store: :class:`ReportData` and :func:`collect`."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from pipelines.errors import UserError
from pipelines.report.stats import (
    COMPARISONS,
    MODEL_ORDER,
    Paired,
    benchmark_primary,
    compare_models,
    pooled_comparisons,
    primary_metric,
)


@dataclass
class ReportData:
    runs: list[dict[str, Any]]
    results: list[dict[str, Any]]
    curves: dict[str, dict[str, list[tuple[int, float]]]] = field(default_factory=dict)
    eval_stats: list[dict[str, Any]] = field(default_factory=list)
    comparisons: list[dict[str, Any]] = field(default_factory=list)
    scoring: list[dict[str, Any]] = field(default_factory=list)
    """Per (run, model, benchmark) that a judge scored: samples decided by the judge, by the
    rules, and by the rule fallback when the judge did not answer."""
    verdict_changes: list[dict[str, Any]] = field(default_factory=list)
    """Per run, benchmark and pair of ``COMPARISONS``: samples both models answered, and how many
    the challenger fixed (right where the baseline was not), broke, or changed otherwise."""
    trajectories: dict[str, Any] = field(default_factory=dict)
    """Set by ``write_report`` when it wrote the trajectory page: its file name and, per model
    and benchmark, verdict counts (for the HTML report's links into it)."""
    training: list[dict[str, Any]] = field(default_factory=list)
    """Per run with RL steps in the store (either engine): RL rollouts over all steps, why they
    stopped (``stop/<reason>`` weighted by each step's trajectories), the trajectories
    over-turn masking left out of the loss, and the groups that varied in reward and in
    accuracy (what the zero-variance filter would keep on either basis)."""

    def benchmarks(self) -> list[str]:
        return sorted({r["benchmark"] for r in self.results})

    def rows(self) -> list[tuple[str, str]]:
        keys = {(r["run"], r["model"]) for r in self.results}
        return sorted(keys, key=lambda k: (k[0], MODEL_ORDER.get(k[1], 9), k[1]))


def paired_scores(store: Any, run_id: str, models: set[str], benchmark: str
                  ) -> list[tuple[str, str, str, list[tuple[float, float]]]]:
    """(challenger, baseline, metric, [(challenger score, baseline score)]) for each pair of
    ``COMPARISONS`` that one run evaluated on the same samples of ``benchmark``."""
    from pipelines.report.trajectories import sample_score

    out = []
    compared = {m for pair in COMPARISONS for m in pair}
    scores = {m: store.eval_scores(run_id, m, benchmark) for m in models & compared}
    for challenger, baseline in COMPARISONS:
        if challenger not in scores or baseline not in scores:
            continue
        a, b = scores[challenger], scores[baseline]
        common = sorted(set(a) & set(b))
        names = {k for sid in common for k in a[sid] if k in b[sid]}
        if not names:
            continue
        # Each sample's headline value, as its verdict reads it: the benchmark's primary metric
        # (V*: overall, not the first category by name), or the one metric VSI-Bench scores a
        # sample under (its question type), so every common sample is compared.
        metric = benchmark_primary(benchmark) or primary_metric(names)
        values = [(sample_score(benchmark, a[s])[1], sample_score(benchmark, b[s])[1])
                  for s in common]
        pairs = [(x, y) for x, y in values if x is not None and y is not None]
        if pairs:
            out.append((challenger, baseline, metric, pairs))
    return out


def collect(store: Any, run_ids: list[str] | None = None) -> ReportData:
    """Read everything the report shows for ``run_ids`` (default: every run in the store)."""
    all_runs = store.runs()
    known = {r["run_id"] for r in all_runs}
    if run_ids:
        missing = [r for r in run_ids if r not in known]
        if missing:
            raise UserError(f"run '{missing[0]}' is not in the store {store.path}",
                            hint=f"known runs: {', '.join(sorted(known)) or 'none'}")
        runs = [r for r in all_runs if r["run_id"] in run_ids]
    else:
        runs = all_runs
    ids = [r["run_id"] for r in runs]
    results = [{"run": a["run_id"], "model": a["model"], "benchmark": a["benchmark"],
                "metric": a["metric"], "value": a["value"], "n": a["n"],
                "benchmark_version": a["benchmark_version"], "prompt_version": a["prompt_version"],
                "scorer": a["scorer"]} for a in store.eval_aggregates(ids)] if ids else []
    curves: dict[str, dict[str, list[tuple[int, float]]]] = {}
    stats = []
    comparisons: list[dict[str, Any]] = []
    changes: list[dict[str, Any]] = []
    paired_by_run: dict[str, Paired] = {}
    for rid in ids:
        per: dict[str, list[tuple[int, float]]] = defaultdict(list)
        for m in store.metrics(rid):
            if m["value"] is not None:
                per[f"{m['stage']}/{m['name']}"].append((int(m["step"]), float(m["value"])))
        if per:
            curves[rid] = dict(per)
        by_bench: dict[str, set[str]] = defaultdict(set)
        for r in results:
            if r["run"] == rid:
                by_bench[r["benchmark"]].add(r["model"])
        paired_by_run[rid] = {bench: paired_scores(store, rid, models, bench)
                              for bench, models in by_bench.items()}
        comparisons += compare_models(rid, paired_by_run[rid])
        changes += verdict_change_counts(store, rid, by_bench)
        groups: dict[tuple[str, str], list[dict]] = defaultdict(list)
        for rec in store.eval_records(rid):
            groups[(rec["model"], rec["benchmark"])].append(rec)
        for (model, bench), recs in sorted(groups.items(),
                                           key=lambda kv: (MODEL_ORDER.get(kv[0][0], 9), kv[0])):
            reasons: dict[str, int] = defaultdict(int)
            for rec in recs:
                reasons[rec["stop_reason"] or "unknown"] += 1
            n = len(recs)
            stats.append({
                "run": rid, "model": model, "benchmark": bench, "n": n,
                "visual_tokens_mean": sum(r["visual_tokens"] or 0 for r in recs) / n,
                "turns_mean": sum(r["turns"] or 0 for r in recs) / n,
                "tool_calls_mean": sum(r["tool_calls"] or 0 for r in recs) / n,
                "stop_reasons": dict(sorted(reasons.items())),
            })
    comparisons += pooled_comparisons(runs, paired_by_run)
    return ReportData(runs=[{k: (str(v) if k == "created_at" else v) for k, v in r.items()}
                            for r in runs], results=results, curves=curves, eval_stats=stats,
                      comparisons=comparisons, scoring=scoring_counts(store, ids),
                      verdict_changes=changes, training=training_stats(curves))


def training_stats(curves: dict[str, dict[str, list[tuple[int, float]]]]) -> list[dict[str, Any]]:
    """``ReportData.training`` from the runs' ``rl/*`` metric curves."""
    out = []
    for run, per in sorted(curves.items()):
        counts = dict(per.get("rl/trajectories", []))
        if not counts:
            continue
        total = sum(counts.values())
        stops: dict[str, float] = {}
        for name, points in per.items():
            if name.startswith("rl/stop/"):
                n = sum(v * counts.get(step, 0) for step, v in points)
                if n > 0:
                    stops[name.removeprefix("rl/stop/")] = n / total
        sums = {key: sum(v for _, v in per.get(f"rl/{key}", []))
                for key in ("train/masked_truncated", "strategy/groups_varying_reward",
                            "strategy/groups_varying_accuracy", "strategy/generated_groups")}
        out.append({"run": run, "steps": len(counts), "trajectories": int(total),
                    "stop_rates": dict(sorted(stops.items(), key=lambda kv: -kv[1])),
                    "masked_truncated": int(sums["train/masked_truncated"]),
                    "groups": int(sums["strategy/generated_groups"]),
                    "groups_varying_reward": int(sums["strategy/groups_varying_reward"]),
                    "groups_varying_accuracy": int(sums["strategy/groups_varying_accuracy"])})
    return out


def verdict_change_counts(store: Any, run_id: str, models_by_bench: dict[str, set[str]]
                          ) -> list[dict[str, Any]]:
    """``ReportData.verdict_changes`` of one run (verdicts as the trajectory page gives them)."""
    from pipelines.report.trajectories import sample_score, sample_verdict

    out = []
    for bench in sorted(models_by_bench):
        models = models_by_bench[bench]
        verdicts = {}
        for m in models & {m for pair in COMPARISONS for m in pair}:
            verdicts[m] = {sid: sample_verdict(sample_score(bench, sc)[1])
                           for sid, sc in store.eval_scores(run_id, m, bench).items()}
        for challenger, baseline in COMPARISONS:
            if challenger not in verdicts or baseline not in verdicts:
                continue
            a, b = verdicts[baseline], verdicts[challenger]
            common = sorted(set(a) & set(b))
            fixed = sum(a[s] != "right" and b[s] == "right" for s in common)
            broken = sum(a[s] == "right" and b[s] != "right" for s in common)
            changed = sum(a[s] != b[s] for s in common) - fixed - broken
            out.append({"run": run_id, "benchmark": bench, "model": challenger,
                        "baseline": baseline, "n": len(common), "fixed": fixed,
                        "broken": broken, "changed": changed})
    return out


def scoring_counts(store: Any, run_ids: list[str]) -> list[dict[str, Any]]:
    """``ReportData.scoring``: who decided the samples of each result a judge took part in."""
    if not run_ids:
        return []
    rows = []
    for (run, model, bench), counts in store.eval_scored_by(run_ids).items():
        if counts.get("judge", 0) or counts.get("rule_fallback", 0):
            rows.append({"run": run, "model": model, "benchmark": bench,
                         "n": sum(counts.values()), "judge": counts.get("judge", 0),
                         "rules": counts.get("rules", 0),
                         "rule_fallback": counts.get("rule_fallback", 0)})
    return sorted(rows, key=lambda r: (r["run"], r["benchmark"], MODEL_ORDER.get(r["model"], 9),
                                       r["model"]))
