"""`pyvision report`: results tables, training curves and an HTML report from the store."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

import typer

from pipelines.errors import UserError
from pyvision_cli.common import COMMAND_HELP, StoreOpt, command, err, make_app, print_json

app = make_app(COMMAND_HELP["report"], no_args_is_help=False)


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

    if out is not None and fmt in ("table", "json"):
        raise UserError(f"--out is for report files; --format {fmt} prints to the "
                        f"{'terminal' if fmt == 'table' else 'standard output'}",
                        hint="drop --out, or pass --format html or markdown")
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
        err.print(f"no runs in the store {st.path} yet; nothing written", markup=False)
        return
    written = write_report(st, run, [fmt], target)
    for kind, path in written.items():
        err.print(f"{kind}: {path}", markup=False)


def print_results(store, runs: list[str] | None, console=None, *, headline: bool = True) -> None:
    """The headline (one sentence per comparison), the results table (runs x models by
    benchmarks, primary metric), the paired model comparisons and the samples whose verdict
    changed, on stderr."""
    from rich.markup import escape

    from pipelines.report import (
        CHANGES_HEADER,
        COMPARISON_HEADER,
        SCORING_HEADER,
        change_rows,
        collect,
        comparison_rows,
        fallback_notes,
        results_table,
        scoring_rows,
    )
    from pipelines.report.terminal import print_headline, print_table

    console = console or err
    with store.session():  # one connection for every read: the lock is held once, briefly
        data = collect(store, runs)
    if headline:
        from pipelines.report import headline as sentences

        print_headline(sentences(data), console)
    header, rows = results_table(data)
    if rows:
        print_table("results (primary metric, %)", header, rows, console)
    else:
        console.print("no evaluation results in the store for these runs")
    for note in fallback_notes(data):
        console.print(f"[yellow]{escape(note)}[/]", soft_wrap=True, highlight=False)
    if data.scoring:
        print_table("who scored the samples", SCORING_HEADER, scoring_rows(data), console)
    if data.comparisons:
        print_table("paired comparisons (ahead/behind only when the 95% interval excludes 0)",
                    COMPARISON_HEADER, comparison_rows(data), console)
    if any(c["fixed"] or c["broken"] or c["changed"] for c in data.verdict_changes):
        print_table("samples whose verdict changed (pyvision show RUN --changed BASELINE MODEL)",
                    CHANGES_HEADER, change_rows(data), console)
