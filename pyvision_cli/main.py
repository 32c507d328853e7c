"""`pyvision`: the command-line entry point.

Each command lives in its own module (``pyvision_cli/<name>.py``, exposing a Typer ``app``) and is
imported only when invoked, so ``pyvision --help`` starts in well under a second and imports no
ML library. The table below is the single place where commands are registered.
"""

from __future__ import annotations

import importlib
import os
from typing import Any

import typer

# Typer 0.29 vendors its own click (typer._click); exceptions and commands must come from it to
# be recognised by Typer's main loop.
from typer import _click as click
from typer.core import TyperCommand

from pyvision_cli.common import COMMAND_HELP, PyVisionGroup, make_app

# name -> (module, one-line help), in the order shown in --help.
COMMANDS: dict[str, tuple[str, str]] = {name: (f"pyvision_cli.{name}", line) for name, line in COMMAND_HELP.items()}


class LazyRootGroup(PyVisionGroup):
    """Root group that imports a command's module only when that command runs.

    While the root help is being formatted, commands are listed from the static table above
    through placeholders, so showing help imports none of the command modules.
    """

    _listing = False

    def list_commands(self, ctx: click.Context) -> list[str]:
        return list(COMMANDS)

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name not in COMMANDS:
            return None
        module_name, short_help = COMMANDS[name]
        if self._listing:
            return TyperCommand(name, help=short_help, short_help=short_help)
        cmd = typer.main.get_command(importlib.import_module(module_name).app)
        cmd.name = name
        return cmd

    def format_help(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        self._listing = True
        try:
            super().format_help(ctx, formatter)
        finally:
            self._listing = False


app = make_app(
    "PyVision-RL: build agentic vision models with RL, end to end.\n\n"
    "Start with `make demo` (the embedded tiny-cpu recipe, offline, on CPU) or "
    "`pyvision run tiny-cpu`.")
app.info.cls = LazyRootGroup


@app.callback()
def _root(
    debug: bool = typer.Option(False, "--debug", help="Show tracebacks for user errors too."),
) -> None:
    if debug:
        os.environ["PYVISION_DEBUG"] = "1"


def _terminated(signum: int, frame: Any) -> None:
    # SIGTERM (`kill`, a job scheduler's stop) unwinds like Ctrl-C: temp folders are removed,
    # finished samples committed, the stage marked failed; then exit 128 + 15.
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> Any:
    """Console-script entry point."""
    import signal

    signal.signal(signal.SIGTERM, _terminated)
    return app(args=argv, prog_name="pyvision")


if __name__ == "__main__":
    main()
