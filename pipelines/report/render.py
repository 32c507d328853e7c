"""The report as text: tables, headline sentences, JSON, markdown and a self-contained HTML page."""

from __future__ import annotations

import base64
import html
from collections import defaultdict
from pathlib import Path
from typing import Any

from pipelines.report.collect import ReportData
from pipelines.report.stats import MODEL_ORDER, primary_metric

COMPARISON_NOTE = ("A verdict says ahead or behind only when the 95% bootstrap interval of the "
                   "paired difference excludes zero. Rows marked 'runs pooled' combine the runs "
                   "of one recipe (seeds, say), resampling within each run.")


def comparison_rows(data: ReportData) -> list[list[str]]:
    return [[c["run"], c["benchmark"], f"{c['model']} vs {c['baseline']}", c["metric"], str(c["n"]),
             f"{100 * c['value']:.1f} vs {100 * c['baseline_value']:.1f}",
             f"{100 * c['delta']:+.1f}", f"[{100 * c['ci_low']:+.1f}, {100 * c['ci_high']:+.1f}]",
             c["verdict"]] for c in data.comparisons]


COMPARISON_HEADER = ["run", "benchmark", "comparison", "metric", "n", "value (%)", "difference",
                     "95% interval", "verdict"]


TRAINING_HEADER = ["run", "RL steps", "rollouts", "why they stopped (share of rollouts)",
                   "masked (over-turn)", "groups varying: reward / accuracy / all"]


def training_rows(data: ReportData) -> list[list[str]]:
    return [[t["run"], str(t["steps"]), str(t["trajectories"]),
             ", ".join(f"{k} {100 * v:.1f}%" for k, v in t["stop_rates"].items()),
             str(t["masked_truncated"]),
             f"{t['groups_varying_reward']} / {t['groups_varying_accuracy']} / {t['groups']}"]
            for t in data.training]


CHANGES_HEADER = ["run", "benchmark", "comparison", "n", "fixed", "broken", "other changes"]


def change_rows(data: ReportData) -> list[list[str]]:
    return [[c["run"], c["benchmark"], f"{c['model']} vs {c['baseline']}", str(c["n"]),
             str(c["fixed"]), str(c["broken"]), str(c["changed"])] for c in data.verdict_changes]


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
        header.append(f"{b} ({primary_metric(metrics, b)})" if metrics else b)
    rows = []
    marked = _fallbacks(data)
    for run, model in data.rows():
        row = [run, model]
        for b in benches:
            ms = by_key.get((run, model, b))
            mark = FALLBACK_MARK if (run, model, b) in marked else ""
            row.append(f"{100 * ms[primary_metric(ms, b)]:.1f}{mark}" if ms else "-")
        rows.append(row)
    return header, rows


def detail_rows(data: ReportData) -> list[list[str]]:
    return [[r["run"], r["model"], r["benchmark"], r["metric"], f"{100 * r['value']:.2f}",
             str(r["n"]), f"{r['benchmark_version']} / {r['prompt_version']} / {r['scorer']}"]
            for r in sorted(data.results, key=lambda r: (r["run"], r["benchmark"],
                                                          MODEL_ORDER.get(r["model"], 9), r["metric"]))]


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
