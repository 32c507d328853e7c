"""`pyvision report`: results tables, training curves and an HTML report from the store."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

import typer

from pyvision_cli.common import StoreOpt, command, err, make_app, print_json

app = make_app("Results tables, training curves and an HTML report.", no_args_is_help=False)


@command(app)
def report(
    run: Annotated[list[str] | None, typer.Option("--run", help="Run id(s) to include (repeatable) [default: all].")] = None,
    fmt: Annotated[Literal["table", "markdown", "html", "json"], typer.Option("--format", help="table: terminal; markdown / html: files in --out; json: stdout.")] = "table",
    out: Annotated[Path | None, typer.Option("--out", help="Folder for report files and plots [default: runs/report].")] = None,
    store: StoreOpt = None,
) -> None:
    """Runs by benchmarks (base vs SFT vs RL), training curves, visual tokens and stop reasons.

    `table` prints to the terminal; `markdown` and `html` write report.md / report.html (with PNG
    plots) into --out; `json` prints {"runs": [..], "results": [..]} on stdout.
    """
    from pipelines.report import collect, to_json, write_report
    from pipelines.store import Store

    st = Store(store, read_only=True)
    if fmt == "json":
        with st.session():  # one connection for every read: the lock is held once, briefly
            data = collect(st, run)
        print_json(to_json(data))
        return
    if fmt == "table":
        print_results(st, run)
        return
    target = out or Path("runs") / "report"
    from pipelines.inputs import check_writable_dir

    check_writable_dir(target, "--out")
    if not run and not st.runs():
        # As the table and JSON say for an empty store: nothing to show, and no error.
        err.print(f"no runs in the store {st.path} yet; nothing written")
        return
    written = write_report(st, run, [fmt], target)
    for kind, path in written.items():
        err.print(f"{kind}: {path}")


def print_results(store, runs: list[str] | None) -> None:
    """The results table (runs x models by benchmarks, primary metric) and the paired model
    comparisons on stderr."""
    from rich.markup import escape

    from pipelines.report import (
        COMPARISON_HEADER,
        SCORING_HEADER,
        collect,
        comparison_rows,
        fallback_notes,
        results_table,
        scoring_rows,
    )

    with store.session():  # one connection for every read: the lock is held once, briefly
        data = collect(store, runs)
    header, rows = results_table(data)
    if rows:
        _print_table("results (primary metric, %)", header, rows)
    else:
        err.print("no evaluation results in the store for these runs")
    for note in fallback_notes(data):
        err.print(f"[yellow]{escape(note)}[/]", soft_wrap=True, highlight=False)
    if data.scoring:
        _print_table("who scored the samples", SCORING_HEADER, scoring_rows(data))
    if data.comparisons:
        _print_table("paired comparisons (ahead/behind only when the 95% interval excludes 0)",
                     COMPARISON_HEADER, comparison_rows(data))


def _print_table(title: str, header: list[str], rows: list[list[str]]) -> None:
    from rich.table import Table

    table = Table(title=title)
    for h in header:
        table.add_column(h)
    for row in rows:
        table.add_row(*row)
    err.print(table)
