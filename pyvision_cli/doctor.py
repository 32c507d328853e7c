"""`pyvision doctor`: check the installation."""

from __future__ import annotations

from typing import Annotated

import typer

from pyvision_cli.common import COMMAND_HELP, JsonOpt, StoreOpt, command, err, make_app, print_json

app = make_app(COMMAND_HELP["doctor"], no_args_is_help=False)


@command(app)
def doctor(
    store: StoreOpt = None,
    json_out: JsonOpt = False,
    offline: Annotated[bool, typer.Option("--offline", help="Skip the hub reachability check.")] = False,
    hub_timeout: Annotated[float, typer.Option(help="Seconds to wait for the hub.", min=0.1)] = 3.0,
) -> None:
    """Versions of key packages, Python, torch device and GPU count, bubblewrap, store, hub.

    Exits 1 when a required package is missing, 0 otherwise (warnings do not fail).
    """
    from rich.markup import escape
    from rich.table import Table

    from pipelines.doctor import checks_as_json, run_checks
    from pipelines.store import resolve_store_path

    checks = run_checks(resolve_store_path(store), hub_timeout_s=hub_timeout, check_hub=not offline)
    result = checks_as_json(checks)
    if json_out:
        print_json(result)
    else:
        table = Table(title="pyvision doctor", show_lines=False)
        table.add_column("check")
        table.add_column("status")
        table.add_column("found")
        table.add_column("what to do")
        style = {"ok": "green", "warn": "yellow", "missing": "red"}
        for c in checks:
            table.add_row(escape(c.name), f"[{style[c.status]}]{c.status.upper()}[/]",
                          escape(c.found), escape(c.fix))
        err.print(table)
    if not result["ok"]:
        raise typer.Exit(1)
