"""`pyvision report`: results tables, training curves and a self-contained HTML page.

Everything shown is read from the store: evaluation aggregates (runs x models x benchmarks, as in
the paper's tables: base vs SFT vs RL), per-step training metrics (reward and its terms, accuracy,
tool calls per trajectory, response length, kept and dropped groups, SFT loss), and per-sample
evaluation records (visual tokens per sample, stop reasons). Several runs can be compared side by
side. :func:`write_report` collects once and renders each format:

- ``collect.py``: :class:`ReportData` and :func:`collect`, everything read from the store.
- ``stats.py``: the primary metric, the model pairs compared, the paired bootstrap and verdicts.
- ``plots.py``: training curves, visual tokens and stop reasons as PNG files.
- ``render.py``: tables, headline sentences, JSON, markdown and HTML.
- ``trajectories.py`` and ``terminal.py``: the trajectory page and `pyvision show`.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from pipelines.errors import UserError
from pipelines.fsutil import atomic_write_text
from pipelines.report.collect import ReportData, collect
from pipelines.report.plots import make_plots
from pipelines.report.render import (
    CHANGES_HEADER,
    COMPARISON_HEADER,
    SCORING_HEADER,
    change_rows,
    comparison_rows,
    fallback_notes,
    headline,
    results_table,
    scoring_rows,
    to_html,
    to_json,
    to_markdown,
)
from pipelines.report.stats import (
    COMPARISONS,
    LEVEL,
    MODEL_ORDER,
    paired_bootstrap,
    primary_metric,
    stratified_bootstrap,
    verdict,
)

__all__ = ["CHANGES_HEADER", "COMPARISONS", "COMPARISON_HEADER", "LEVEL", "MODEL_ORDER",
           "SCORING_HEADER", "ReportData", "change_rows", "collect", "comparison_rows",
           "fallback_notes", "headline", "make_plots", "paired_bootstrap", "primary_metric",
           "results_table", "scoring_rows", "stratified_bootstrap", "to_html", "to_json",
           "to_markdown", "verdict", "write_report"]


def write_report(store: Any, run_ids: list[str] | None, formats: Iterable[str],
                 out_dir: str | Path) -> dict[str, str]:
    """Collect once, render each format into ``out_dir``; returns format -> file path. A report
    that fails removes the folders it made and left empty (``out_dir``, its parents, media/)."""
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
    from pipelines.report.trajectories import MEDIA_DIR

    out = Path(out_dir)
    # The folders this report will make (media/, out, its missing parents), deepest first: a
    # report that fails removes those it left empty, and never one that was there before.
    made = [d for d in (out / MEDIA_DIR, out, *out.parents) if not d.exists()]
    out.mkdir(parents=True, exist_ok=True)
    try:
        return _write(store, data, ts, formats, out)
    except BaseException:
        for folder in made:
            try:
                folder.rmdir()
            except FileNotFoundError:  # not made yet (media/ before the trajectory page)
                continue
            except OSError:  # something was written in it: its parents are not empty either
                break
        raise


def _write(store: Any, data: ReportData, ts: Any, formats: list[str],
           out: Path) -> dict[str, str]:
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
