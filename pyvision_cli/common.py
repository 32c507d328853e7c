"""What every command shares: options, consoles, error handling, JSON output.

Conventions: progress, tables and messages go to stderr (``err``); data goes to stdout, as JSON
with ``--json``. A :class:`pipelines.errors.UserError` becomes one red line on stderr and exit
code 2; ``--debug`` (or ``PYVISION_DEBUG=1``) adds the traceback. This module imports no ML
library, so every command's ``--help`` is instant.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path
from typing import Annotated, Any

import typer

# Typer 0.29 vendors its own click (typer._click); exceptions and commands must come from it to
# be recognised by Typer's main loop.
from typer import _click as click
from typer.core import TyperGroup

from pipelines.console import err
from pipelines.errors import UserError


def debug_enabled() -> bool:
    return os.environ.get("PYVISION_DEBUG", "").lower() in ("1", "true", "yes")


def _reraise_user_errors(call, *args, **kwargs):
    """Run a command; a UserError becomes one unwrapped red line on stderr and exit code 2.

    (Raising a ClickException instead would let Typer draw a wrapped box around the message.)
    """
    try:
        return call(*args, **kwargs)
    except UserError as exc:
        if debug_enabled():
            traceback.print_exc(file=sys.stderr)
        from rich.markup import escape

        err.print(f"[bold red]error:[/] {escape(exc.one_line())}", soft_wrap=True, highlight=False)
        raise typer.Exit(exc.exit_code) from None


class PyVisionGroup(TyperGroup):
    """A Typer group whose commands report UserError as one line with exit code 2."""

    def invoke(self, ctx: click.Context) -> Any:
        return _reraise_user_errors(super().invoke, ctx)


class PyVisionCommand(typer.core.TyperCommand):
    """A single Typer command with the same UserError handling."""

    def invoke(self, ctx: click.Context) -> Any:
        return _reraise_user_errors(super().invoke, ctx)


def make_app(help: str, *, group: bool = False, **kwargs: Any) -> typer.Typer:
    """A Typer app with the project's conventions (no completion, no rich tracebacks).

    ``group=True`` keeps it a command group even with a single subcommand (``pyvision model
    tiny``); otherwise a one-command app is that command (``pyvision sft``).
    """
    app = typer.Typer(help=help, cls=PyVisionGroup,
                      no_args_is_help=kwargs.pop("no_args_is_help", True), add_completion=False,
                      pretty_exceptions_enable=False,
                      context_settings={"help_option_names": ["-h", "--help"]}, **kwargs)
    if group:
        @app.callback()
        def _group() -> None:
            """A group callback makes Typer keep subcommand names even for one subcommand."""

    return app


def command(app: typer.Typer, name: str | None = None, **kwargs: Any):
    """``@command(app)``: register a command that reports UserError as exit 2."""
    return app.command(name, cls=PyVisionCommand, **kwargs)


# -- shared options --------------------------------------------------------------------------

ConfigOpt = Annotated[Path | None, typer.Option(
    "--config", "-c", help="Recipe YAML (default: pipelines/recipes/tiny-cpu.yaml).",
    show_default=False)]
SetOpt = Annotated[list[str] | None, typer.Option(
    "--set", help="Override a recipe key, e.g. --set rl.learning_rate=1e-6 (repeatable).",
    show_default=False)]
StoreOpt = Annotated[Path | None, typer.Option(
    "--store", envvar="PYVISION_STORE",
    help="DuckDB store file [default: runs/pyvision.duckdb].", show_default=False)]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print machine-readable JSON on stdout.")]
ForceOpt = Annotated[bool, typer.Option("--force", help="Redo stages that already finished.")]
RunIdOpt = Annotated[str | None, typer.Option(
    "--run-id", help="Run id: runs/<run-id>/<stage>/ [default: the recipe's name].",
    show_default=False)]


def load_recipe(config: Path | None, sets: list[str] | None):
    """The recipe from ``-c`` (default: tiny-cpu) with ``--set`` overrides applied."""
    from pipelines.config.recipe import load_recipe as _load

    return _load(config, tuple(sets or ()))


def print_json(obj: Any) -> None:
    """Write ``obj`` as JSON to stdout (the only thing a ``--json`` command prints there)."""
    sys.stdout.write(json.dumps(obj, indent=2, default=str) + "\n")
    sys.stdout.flush()
