"""`pyvision report`: results tables, training curves and a self-contained HTML page.

Everything shown is read from the store: evaluation aggregates (runs x models x benchmarks, as in
the paper's tables: base vs SFT vs RL), per-step training metrics (reward and its terms, accuracy,
tool calls per trajectory, response length, kept and dropped groups, SFT loss), and per-sample
evaluation records (visual tokens per sample, stop reasons). Several runs can be compared side by
side.

Held-out sets are small (the embedded demo's have 48 and 32 samples), so a difference of a few
points between two models can be noise. Within a run, the report therefore compares SFT with base
and RL with SFT on the samples both answered: the mean paired difference and its 95% bootstrap
interval, and a verdict that says "ahead" or "behind" only when the interval excludes zero.
"""

from __future__ import annotations

import base64
import html
import json
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipelines.errors import UserError
from pipelines.fsutil import atomic_write_text

PRIMARY_METRICS = ("overall", "accuracy", "average", "acc", "score")
MODEL_ORDER = {"base": 0, "sft": 1, "rl": 2}
# Training curves worth plotting first when present (others follow alphabetically).
CURVE_ORDER = ("reward/mean", "reward/accuracy", "reward/tool", "accuracy", "tool_calls/mean",
               "turns/mean", "response_length/mean", "strategy/kept_groups",
               "strategy/dropped_zero_variance", "entropy", "grad_norm", "loss")
# (challenger, baseline) pairs compared within a run, in the order the method produces them.
COMPARISONS = (("sft", "base"), ("rl", "sft"))
LEVEL = 0.95  # of the bootstrap interval around a paired difference
COMPARISON_NOTE = ("A verdict says ahead or behind only when the 95% bootstrap interval of the "
                   "paired difference excludes zero. Rows marked 'runs pooled' combine the runs "
                   "of one recipe (seeds, say), resampling within each run.")


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


def primary_metric(metrics: Iterable[str]) -> str:
    names = list(metrics)
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


def paired_scores(store: Any, run_id: str, models: set[str], benchmark: str
                  ) -> list[tuple[str, str, str, list[tuple[float, float]]]]:
    """(challenger, baseline, metric, [(challenger score, baseline score)]) for each pair of
    ``COMPARISONS`` that one run evaluated on the same samples of ``benchmark``."""
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
        metric = primary_metric(names)
        pairs = [(a[s][metric], b[s][metric]) for s in common
                 if a[s].get(metric) is not None and b[s].get(metric) is not None]
        if pairs:
            out.append((challenger, baseline, metric, pairs))
    return out


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


def comparison_rows(data: ReportData) -> list[list[str]]:
    return [[c["run"], c["benchmark"], f"{c['model']} vs {c['baseline']}", c["metric"], str(c["n"]),
             f"{100 * c['value']:.1f} vs {100 * c['baseline_value']:.1f}",
             f"{100 * c['delta']:+.1f}", f"[{100 * c['ci_low']:+.1f}, {100 * c['ci_high']:+.1f}]",
             c["verdict"]] for c in data.comparisons]


COMPARISON_HEADER = ["run", "benchmark", "comparison", "metric", "n", "value (%)", "difference",
                     "95% interval", "verdict"]


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


TRAINING_HEADER = ["run", "RL steps", "rollouts", "why they stopped (share of rollouts)",
                   "masked (over-turn)", "groups varying: reward / accuracy / all"]


def training_rows(data: ReportData) -> list[list[str]]:
    return [[t["run"], str(t["steps"]), str(t["trajectories"]),
             ", ".join(f"{k} {100 * v:.1f}%" for k, v in t["stop_rates"].items()),
             str(t["masked_truncated"]),
             f"{t['groups_varying_reward']} / {t['groups_varying_accuracy']} / {t['groups']}"]
            for t in data.training]


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


CHANGES_HEADER = ["run", "benchmark", "comparison", "n", "fixed", "broken", "other changes"]


def change_rows(data: ReportData) -> list[list[str]]:
    return [[c["run"], c["benchmark"], f"{c['model']} vs {c['baseline']}", str(c["n"]),
             str(c["fixed"]), str(c["broken"]), str(c["changed"])] for c in data.verdict_changes]


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


MODEL_NAMES = {"base": "the base model", "sft": "SFT", "rl": "RL"}


def _model_name(tag: str) -> str:
    return MODEL_NAMES.get(tag, tag)


def _points(c: dict[str, Any], signed: bool) -> str:
    f = "{:+.1f}" if signed else "{:.1f}"
    return (f"{f.format(100 * c['delta'])} [{f.format(100 * c['ci_low'])}, "
            f"{f.format(100 * c['ci_high'])}]")


def headline(data: ReportData) -> list[str]:
    """One plain sentence per comparison (a pair of models in one run, or pooled over the runs
    of one recipe), built from ``data.comparisons``: "RL is ahead of SFT on synth-video by 18.8
    points [6.2, 31.2]; on synth-image it is not separable (+8.3 [-6.2, +22.9])." Differences
    are percentage points of the primary metric with their 95% bootstrap interval."""
    grouped: dict[tuple[str, str, str], list[dict[str, Any]]] = {}
    for c in data.comparisons:
        grouped.setdefault((c["run"], c["model"], c["baseline"]), []).append(c)
    labels = {run for run, _, _ in grouped}
    out = []
    for (run, challenger, baseline), rows in grouped.items():
        a, b = _model_name(challenger), _model_name(baseline)
        by = {v: [c for c in rows if c["verdict"] == v] for v in ("ahead", "behind",
                                                                   "not separable")}
        parts = []
        for verdict_ in ("ahead", "behind"):
            if by[verdict_]:
                whom = b if not parts else "it"
                parts.append(f"{verdict_} of {whom} " if verdict_ == "ahead" else f"behind {whom} ")
                parts[-1] += " and ".join(f"on {c['benchmark']} by "
                                          f"{abs(100 * c['delta']):.1f} points "
                                          f"[{100 * c['ci_low']:.1f}, {100 * c['ci_high']:.1f}]"
                                          for c in by[verdict_])
        unsure = " and ".join(f"{c['benchmark']} ({_points(c, True)})"
                              for c in by["not separable"])
        if parts:
            sentence = f"{a} is " + ", ".join(parts)
            if unsure:
                sentence += f"; on {unsure} it is not separable"
        else:
            sentence = f"{a} and {b} are not separable on {unsure}"
        if len(labels) > 1 or "runs" in rows[0]:
            where = (f"Pooled over the {len(rows[0]['runs'])} runs of "
                     f"{run.split(':', 1)[0]}" if "runs" in rows[0] else f"In run {run}")
            sentence = f"{where}, {sentence}"
        out.append(sentence[0].upper() + sentence[1:] + ".")
    return out


SCORING_HEADER = ["run", "model", "benchmark", "n", "judge", "rules", "rule fallback"]
FALLBACK_MARK = "*"


def scoring_rows(data: ReportData) -> list[list[str]]:
    return [[r["run"], r["model"], r["benchmark"], str(r["n"]), str(r["judge"]), str(r["rules"]),
             str(r["rule_fallback"])] for r in data.scoring]


def _fallbacks(data: ReportData) -> dict[tuple[str, str, str], int]:
    return {(r["run"], r["model"], r["benchmark"]): r["rule_fallback"] for r in data.scoring
            if r["rule_fallback"]}


def fallback_notes(data: ReportData) -> list[str]:
    """What a marked result means and how to score it again (empty when nothing is marked)."""
    import shlex

    notes = []
    for (run, model, bench), n in sorted(_fallbacks(data).items()):
        total = next(r["n"] for r in data.scoring
                     if (r["run"], r["model"], r["benchmark"]) == (run, model, bench))
        command = shlex.join(["pyvision", "eval", "score", "--run-id", run, "--model-tag", model,
                              "--benchmark", bench])
        notes.append(f"{FALLBACK_MARK} {run} / {model} / {bench}: the judge did not answer for "
                     f"{n} of {total} samples and the rule fallback scored them; score them "
                     f"again when it is back: {command}")
    return notes


def to_json(data: ReportData) -> dict[str, Any]:
    return {"headline": headline(data), "runs": data.runs,
            "results": [{k: r[k] for k in ("run", "model", "benchmark", "metric", "value")}
                        for r in data.results],
            "comparisons": data.comparisons,
            "eval_stats": data.eval_stats,
            "scoring": data.scoring,
            "verdict_changes": data.verdict_changes,
            "training": data.training}


def results_table(data: ReportData) -> tuple[list[str], list[list[str]]]:
    """Header and rows: one row per (run, model), one column per benchmark's primary metric."""
    benches = data.benchmarks()
    by_key: dict[tuple[str, str, str], dict[str, float]] = defaultdict(dict)
    for r in data.results:
        by_key[(r["run"], r["model"], r["benchmark"])][r["metric"]] = r["value"]
    header = ["run", "model"]
    for b in benches:
        metrics = {m for (run, model, bb), ms in by_key.items() if bb == b for m in ms}
        header.append(f"{b} ({primary_metric(metrics)})" if metrics else b)
    rows = []
    marked = _fallbacks(data)
    for run, model in data.rows():
        row = [run, model]
        for b in benches:
            ms = by_key.get((run, model, b))
            mark = FALLBACK_MARK if (run, model, b) in marked else ""
            row.append(f"{100 * ms[primary_metric(ms)]:.1f}{mark}" if ms else "-")
        rows.append(row)
    return header, rows


def detail_rows(data: ReportData) -> list[list[str]]:
    return [[r["run"], r["model"], r["benchmark"], r["metric"], f"{100 * r['value']:.2f}",
             str(r["n"]), f"{r['benchmark_version']} / {r['prompt_version']} / {r['scorer']}"]
            for r in sorted(data.results, key=lambda r: (r["run"], r["benchmark"],
                                                          MODEL_ORDER.get(r["model"], 9), r["metric"]))]


# -- plots ----------------------------------------------------------------------------------------


def _curve_names(data: ReportData) -> list[str]:
    names = {n for per in data.curves.values() for n in per}
    ordered = [n for key in CURVE_ORDER for n in sorted(names) if n.split("/", 1)[1] == key]
    return ordered + sorted(names - set(ordered))


def make_plots(data: ReportData, out_dir: Path, max_curves: int = 16) -> dict[str, Path]:
    """Training curves, visual tokens and stop reasons as PNG files; returns name -> path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    made: dict[str, Path] = {}
    names = _curve_names(data)[:max_curves]
    if names:
        cols = min(4, len(names))
        rows = (len(names) + cols - 1) // cols
        fig, axes = plt.subplots(rows, cols, figsize=(4 * cols, 3 * rows), squeeze=False)
        for ax, name in zip(axes.flat, names):
            for run, per in sorted(data.curves.items()):
                if name in per:
                    steps, values = zip(*sorted(per[name]))
                    ax.plot(steps, values, marker="o" if len(steps) < 30 else None, ms=3,
                            label=run)
            ax.set_title(name, fontsize=9)
            ax.set_xlabel("step", fontsize=8)
            ax.tick_params(labelsize=7)
        for ax in list(axes.flat)[len(names):]:
            ax.axis("off")
        axes.flat[0].legend(fontsize=7)
        fig.tight_layout()
        made["training_curves"] = out_dir / "training_curves.png"
        fig.savefig(made["training_curves"], dpi=90)
        plt.close(fig)
    if data.eval_stats:
        labels = [f"{s['run']}\n{s['model']}\n{s['benchmark']}" for s in data.eval_stats]
        fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(max(8, 1.6 * len(labels)), 4))
        ax1.bar(range(len(labels)), [s["visual_tokens_mean"] for s in data.eval_stats])
        ax1.set_title("visual tokens per sample (mean)", fontsize=10)
        reasons = sorted({r for s in data.eval_stats for r in s["stop_reasons"]})
        bottom = [0.0] * len(labels)
        for reason in reasons:
            vals = [s["stop_reasons"].get(reason, 0) / s["n"] for s in data.eval_stats]
            ax2.bar(range(len(labels)), vals, bottom=bottom, label=reason)
            bottom = [b + v for b, v in zip(bottom, vals)]
        ax2.set_title("stop reasons (fraction of samples)", fontsize=10)
        ax2.legend(fontsize=7)
        for ax in (ax1, ax2):
            ax.set_xticks(range(len(labels)), labels, fontsize=6)
        fig.tight_layout()
        made["eval_stats"] = out_dir / "eval_stats.png"
        fig.savefig(made["eval_stats"], dpi=90)
        plt.close(fig)
    return made


# -- renderers ------------------------------------------------------------------------------------


def to_markdown(data: ReportData, images: dict[str, Path] | None = None) -> str:
    header, rows = results_table(data)
    lines = ["# PyVision report", ""]
    if sentences := headline(data):
        lines += [*(f"{s}  " for s in sentences), ""]  # two spaces: a line break
    lines += ["## Results (primary metric, %)", ""]
    if rows:
        lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        lines += ["| " + " | ".join(r) + " |" for r in rows]
        if notes := fallback_notes(data):
            lines += ["", *(f"{note}  " for note in notes)]  # two spaces: a line break
    else:
        lines.append("No evaluation results in the store for these runs.")
    if data.scoring:
        lines += ["", "## Who scored the samples (judge, rules, rule fallback)", "",
                  "| " + " | ".join(SCORING_HEADER) + " |", "|" + "---|" * len(SCORING_HEADER)]
        lines += ["| " + " | ".join(r) + " |" for r in scoring_rows(data)]
    if data.comparisons:
        lines += ["", "## Model comparisons (paired, same samples)", "",
                  "| " + " | ".join(COMPARISON_HEADER) + " |", "|" + "---|" * len(COMPARISON_HEADER)]
        lines += ["| " + " | ".join(r) + " |" for r in comparison_rows(data)]
        lines += ["", COMPARISON_NOTE]
    if data.verdict_changes:
        lines += ["", "## Samples whose verdict changed", "",
                  "| " + " | ".join(CHANGES_HEADER) + " |", "|" + "---|" * len(CHANGES_HEADER)]
        lines += ["| " + " | ".join(r) + " |" for r in change_rows(data)]
        if data.trajectories:
            page = data.trajectories["page"]
            lines += ["", f"Every sample, turn by turn, side by side: [{page}]({page})"]
    if data.eval_stats:
        lines += ["", "## Visual tokens and stop reasons", "",
                  "| run | model | benchmark | n | visual tokens/sample | turns | tool calls | stop reasons |",
                  "|---|---|---|---|---|---|---|---|"]
        for s in data.eval_stats:
            reasons = ", ".join(f"{k}: {v}" for k, v in s["stop_reasons"].items())
            lines.append(f"| {s['run']} | {s['model']} | {s['benchmark']} | {s['n']} | "
                         f"{s['visual_tokens_mean']:.0f} | {s['turns_mean']:.2f} | "
                         f"{s['tool_calls_mean']:.2f} | {reasons} |")
    if data.training:
        lines += ["", "## RL rollouts: why they stopped", "",
                  "| " + " | ".join(TRAINING_HEADER) + " |", "|" + "---|" * len(TRAINING_HEADER)]
        lines += ["| " + " | ".join(r) + " |" for r in training_rows(data)]
    for name, path in (images or {}).items():
        lines += ["", f"![{name}]({path.name})"]
    if data.results:
        lines += ["", "## All metrics", "",
                  "| run | model | benchmark | metric | value (%) | n | versions (benchmark / prompt / scorer) |",
                  "|---|---|---|---|---|---|---|"]
        lines += ["| " + " | ".join(r) + " |" for r in detail_rows(data)]
    return "\n".join(lines) + "\n"


_CSS = """body{font-family:system-ui,sans-serif;margin:2em;color:#222}
table{border-collapse:collapse;margin:1em 0}th,td{border:1px solid #ccc;padding:4px 8px;text-align:right}
th{background:#f0f0f0}td:first-child,td:nth-child(2){text-align:left}img{max-width:100%;border:1px solid #ddd}
h1{font-size:1.5em}h2{font-size:1.2em;margin-top:1.5em}.small{color:#666;font-size:.85em}
.headline{font-size:1.05em;margin:.3em 0}"""


def _html_table(header: list[str], rows: list[list[str]], cls: str) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>"
                   for row in rows)
    return f'<table class="{cls}"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>'


def _link(page: str, label: str, **params: str) -> str:
    from urllib.parse import urlencode

    return (f"<a href='{html.escape(page)}#{html.escape(urlencode(params))}'>"
            f"{html.escape(label)}</a>")


def _html_trajectories(data: ReportData) -> list[str]:
    """The report's way into the trajectory page: per model and benchmark, and per comparison
    the samples whose verdict changed (each a link to that view of the page)."""
    page = data.trajectories.get("page")
    if not page and not data.verdict_changes:
        return []
    parts = ["<h2>Trajectories</h2>"]
    if page:
        parts.append(f"<p>Every evaluated sample turn by turn (code, interpreter output and "
                     f"images), with filters, search and models side by side: "
                     f"{_link(page, page)}.</p>")
        rows = []
        for r in data.trajectories.get("counts", []):
            rows.append("<tr>" + "".join(f"<td>{c}</td>" for c in (
                _link(page, r["model"], model=r["model"], bench=r["benchmark"]),
                html.escape(r["benchmark"]), r["n"],
                _link(page, str(r["right"]), model=r["model"], bench=r["benchmark"],
                      verdict="right"),
                _link(page, str(r["wrong"]), model=r["model"], bench=r["benchmark"],
                      verdict="wrong"), r["partial"])) + "</tr>")
        parts.append("<table class='trajectories'><thead><tr><th>model</th><th>benchmark</th>"
                     "<th>samples</th><th>right</th><th>wrong</th><th>partial</th></tr></thead>"
                     f"<tbody>{''.join(rows)}</tbody></table>")
        if data.trajectories.get("rollout_steps"):
            parts.append(f"<p>RL rollouts of {data.trajectories['rollout_steps']} training "
                         f"steps (kept and dropped groups, rewards, advantages): "
                         f"{_link(page, 'training rollouts', tab='rollouts')}.</p>")
    if data.verdict_changes:
        parts.append("<h3>Samples whose verdict changed</h3>")
        rows = []
        for c in data.verdict_changes:
            a, b = f"{c['run']}/{c['baseline']}", f"{c['run']}/{c['model']}"
            total = c["fixed"] + c["broken"] + c["changed"]
            cells = [html.escape(c["run"]), html.escape(c["benchmark"]),
                     html.escape(f"{c['model']} vs {c['baseline']}"), str(c["n"]),
                     str(c["fixed"]), str(c["broken"]), str(c["changed"])]
            if page and total:
                cells.append(_link(page, f"show the {total}", a=a, b=b, bench=c["benchmark"]))
            elif page:
                cells.append("")
            rows.append("<tr>" + "".join(f"<td>{x}</td>" for x in cells) + "</tr>")
        head = CHANGES_HEADER + ([""] if page else [])
        parts.append("<table class='changes'><thead><tr>"
                     + "".join(f"<th>{html.escape(h)}</th>" for h in head)
                     + f"</tr></thead><tbody>{''.join(rows)}</tbody></table>")
    return parts


def to_html(data: ReportData, images: dict[str, Path] | None = None) -> str:
    """A self-contained page: inline CSS, images embedded as data URIs."""
    header, rows = results_table(data)
    parts = ["<!doctype html><html><head><meta charset='utf-8'><title>PyVision report</title>",
             f"<style>{_CSS}</style></head><body><h1>PyVision report</h1>",
             *(f"<p class='headline'>{html.escape(s)}</p>" for s in headline(data)),
             "<p class='small'>Runs: " + html.escape(", ".join(r["run_id"] for r in data.runs))
             + "</p>", "<h2>Results (primary metric, %)</h2>"]
    parts.append(_html_table(header, rows, "results") if rows else
                 "<p>No evaluation results in the store for these runs.</p>")
    parts += [f"<p class='small fallback'>{html.escape(note)}</p>" for note in fallback_notes(data)]
    if data.scoring:
        parts.append("<h2>Who scored the samples (judge, rules, rule fallback)</h2>")
        parts.append(_html_table(SCORING_HEADER, scoring_rows(data), "scoring"))
    if data.comparisons:
        parts.append("<h2>Model comparisons (paired, same samples)</h2>")
        parts.append(_html_table(COMPARISON_HEADER, comparison_rows(data), "comparisons"))
        parts.append(f"<p class='small'>{html.escape(COMPARISON_NOTE)}</p>")
    parts += _html_trajectories(data)
    for name, path in (images or {}).items():
        b64 = base64.b64encode(path.read_bytes()).decode()
        parts.append(f"<h2>{html.escape(name.replace('_', ' ').capitalize())}</h2>"
                     f"<img alt='{html.escape(name)}' src='data:image/png;base64,{b64}'>")
    if data.eval_stats:
        parts.append("<h2>Visual tokens and stop reasons</h2>")
        parts.append(_html_table(
            ["run", "model", "benchmark", "n", "visual tokens/sample", "turns", "tool calls",
             "stop reasons"],
            [[s["run"], s["model"], s["benchmark"], str(s["n"]), f"{s['visual_tokens_mean']:.0f}",
              f"{s['turns_mean']:.2f}", f"{s['tool_calls_mean']:.2f}",
              ", ".join(f"{k}: {v}" for k, v in s["stop_reasons"].items())]
             for s in data.eval_stats], "stats"))
    if data.training:
        parts.append("<h2>RL rollouts: why they stopped</h2>")
        parts.append(_html_table(TRAINING_HEADER, training_rows(data), "training"))
    if data.results:
        parts.append("<h2>All metrics</h2>")
        parts.append(_html_table(["run", "model", "benchmark", "metric", "value (%)", "n",
                                  "versions (benchmark / prompt / scorer)"],
                                 detail_rows(data), "details"))
    parts.append("</body></html>")
    return "\n".join(parts)


def write_report(store: Any, run_ids: list[str] | None, formats: Iterable[str],
                 out_dir: str | Path) -> dict[str, str]:
    """Collect once, render each format into ``out_dir``; returns format -> file path."""
    formats = list(formats)
    ts = None
    with store.session():  # every read on one connection; the lock is let go before rendering
        data = collect(store, run_ids)
        if "html" in formats and data.runs:
            from pipelines.report.trajectories import collect_trajectories

            ts = collect_trajectories(store, [r["run_id"] for r in data.runs])
    if not data.runs:
        raise UserError(f"the store {store.path} has no runs yet",
                        hint="run a stage first, e.g. `make demo`, or pass --store")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    images = make_plots(data, out) if {"markdown", "html"} & set(formats) else {}
    written: dict[str, str] = {}
    for name, path in images.items():
        written[f"png:{name}"] = str(path)
    if ts is not None:
        from pipelines.report.trajectories import verdict_counts, write_page

        written["trajectories"] = str(write_page(store, ts, out))
        data.trajectories = {"page": Path(written["trajectories"]).name,
                             "counts": verdict_counts(ts), "rollout_steps": len(ts.steps)}
    if "json" in formats:
        written["json"] = str(atomic_write_text(out / "report.json",
                                                json.dumps(to_json(data), indent=2, default=str)))
    if "markdown" in formats:
        written["markdown"] = str(atomic_write_text(out / "report.md", to_markdown(data, images)))
    if "html" in formats:
        written["html"] = str(atomic_write_text(out / "report.html", to_html(data, images)))
    return written
