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
from typer._click.exceptions import NoArgsIsHelpError, UsageError
from typer.core import TyperGroup

from pipelines.console import err
from pipelines.errors import DISK_REFUSED, UserError

COMMAND_HELP: dict[str, str] = {
    "run": "Run a recipe end to end: data, sft, rl, merge, eval, report.",
    "data": "Synthesise, download, import, validate and export data.",
    "sft": "Supervised fine-tuning on LLaMA-Factory.",
    "rl": "RL with the PyVision rollout strategy (local engine or verl).",
    "merge": "Merge a LoRA adapter or a verl checkpoint into a model folder.",
    "eval": "Evaluate agentically on V*, HRBench, MathVerse, VSI-Bench.",
    "report": "Results tables, training curves and an HTML report.",
    "show": "Show trajectories in the terminal: a sample, or what changed.",
    "agent": "Run one agent trajectory and show it turn by turn.",
    "sandbox": "Run code in the sandbox the agent uses.",
    "model": "Build, pretrain and probe the tiny offline Qwen2.5-VL.",
    "perf": "Benchmarks of the project's own speed (JSON with --json).",
    "doctor": "Check the installation: packages, devices, sandbox, store, hub.",
}
"""Each command's one-line help (module ``pyvision_cli.<name>``), in the order ``pyvision --help``
lists them, the pipeline first. The root help lists these lines without importing the command
modules, and each module's app is made with the same line, so the two cannot drift apart."""


def debug_enabled() -> bool:
    return os.environ.get("PYVISION_DEBUG", "").lower() in ("1", "true", "yes")


def print_error(message: str) -> None:
    """One unwrapped red ``error:`` line on stderr."""
    from rich.markup import escape

    err.print(f"[bold red]error:[/] {escape(message)}", soft_wrap=True, highlight=False)


def _usage_error(exc: UsageError) -> typer.Exit:
    """A command-line error (unknown option, bad value, missing argument) as one line, like a
    UserError: what is wrong, then where to read the options."""
    where = exc.ctx.command_path if exc.ctx is not None else "pyvision"
    message = " ".join(exc.format_message().replace("Value error, ", "").split()).rstrip(". ")
    print_error(f"{message}. Fix: see `{where} --help`.")
    return typer.Exit(exc.exit_code)


def _reraise_user_errors(call, *args, **kwargs):
    """Run a command; a UserError becomes one unwrapped red line on stderr and exit code 2.

    (Raising a ClickException instead would let Typer draw a wrapped box around the message.)
    """
    try:
        return call(*args, **kwargs)
    except UserError as exc:
        if debug_enabled():
            traceback.print_exc(file=sys.stderr)
        print_error(exc.one_line())
        raise typer.Exit(exc.exit_code) from None
    except OSError as exc:
        if exc.errno not in DISK_REFUSED:
            raise
        # A disk that fills up (or is remounted read-only) mid-command: the atomic writes have
        # removed their temp files; say so in one line rather than a traceback from deep inside.
        if debug_enabled():
            traceback.print_exc(file=sys.stderr)
        where = f" {exc.filename}" if exc.filename else ""
        error = UserError(f"cannot write{where} ({exc.strerror})",
                          hint="free space on that disk, or write elsewhere (--out, --store, "
                               "--set runs_dir=DIR)")
        print_error(error.one_line())
        raise typer.Exit(error.exit_code) from None
    except NoArgsIsHelpError:
        raise
    except UsageError as exc:  # e.g. an unknown subcommand
        raise _usage_error(exc) from None


def _parse_in_one_line(make_context, *args, **kwargs):
    try:
        return make_context(*args, **kwargs)
    except NoArgsIsHelpError:
        raise
    except UsageError as exc:
        raise _usage_error(exc) from None


def _name_text_values(params: list[Any]) -> None:
    """Help shows an option's value by name (``--families FAMILIES``), not as ``<str>``."""
    for param in params:
        if getattr(param, "bare_type", lambda: "")() not in ("str", "list[str]"):
            continue
        if param.param_type_name == "argument":  # its NAME says it already
            param.display_type_rich = lambda ctx: None
        elif param.metavar is None:
            param.metavar = param.name.upper()


# Text options that name a local folder or file unless they are a hub id or a URL (which never
# start with ``~``): their ``~`` is expanded as a path option's is.
_PATH_TEXT_OPTIONS = frozenset({"model", "base", "dataset_dir", "tasks", "python"})


def _expand_home(name: str, value: Any) -> Any:
    if isinstance(value, Path):
        return value.expanduser()
    if isinstance(value, str) and name in _PATH_TEXT_OPTIONS and value.startswith("~"):
        return os.path.expanduser(value)
    if isinstance(value, (list, tuple)):
        return type(value)(_expand_home(name, v) for v in value)
    return value


class _OneLineErrors:
    """Mixed into a Typer group or command: parse errors and UserError become one line, exit 2.
    A ``~`` the shell left in a path (``--out=~/x``, a quoted value) is expanded once, before
    the command runs, so that its checks and its work see the same folder."""

    params: list[click.Parameter]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        _name_text_values(self.params)

    def make_context(self, *args: Any, **kwargs: Any) -> click.Context:
        return _parse_in_one_line(super().make_context, *args, **kwargs)  # type: ignore[misc]

    def invoke(self, ctx: click.Context) -> Any:
        ctx.params = {k: _expand_home(k, v) for k, v in ctx.params.items()}
        return _reraise_user_errors(super().invoke, ctx)  # type: ignore[misc]


class PyVisionGroup(_OneLineErrors, TyperGroup):
    """A Typer group whose commands report UserError as one line with exit code 2; blank
    values of its own options (``pyvision eval --model ""``) are refused, its subcommands'
    by the subcommand."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        raw = list(args)
        rest = super().parse_args(ctx, args)
        left = len(getattr(ctx, "_protected_args", None) or ()) + len(rest)
        _refuse_blank(raw[: len(raw) - left], ctx)
        return rest


def blank_value(args: list[str]) -> str | None:
    """The option given an empty or blank value on the command line (``--out ""``,
    ``--out=``), or ``""`` for a blank positional argument; None when there is none. No
    option takes blank text: a path would become the current folder, a name or a question
    would reach a server or the model as it is."""
    for i, arg in enumerate(args):
        if arg.startswith("--") and "=" in arg:
            name, _, value = arg.partition("=")
            if not value.strip():
                return name
        elif not arg.strip():
            prev = args[i - 1] if i else ""
            return prev if prev.startswith("-") and "=" not in prev else ""
    return None


def _refuse_blank(args: list[str], ctx: click.Context) -> None:
    if (name := blank_value(args)) is not None:
        raise UsageError(f"{name} is empty (give it a value, or leave the option out)" if name
                         else "an argument is empty (give it a value)", ctx)


class PyVisionCommand(_OneLineErrors, typer.core.TyperCommand):
    """A single Typer command with the same UserError handling; blank values are refused."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        _refuse_blank(args, ctx)
        return super().parse_args(ctx, args)


# Plain help (no Rich markup: a "[default: ...]" in a help text stays text), every default shown.
APP_SETTINGS: dict[str, Any] = {
    "add_completion": False, "pretty_exceptions_enable": False, "rich_markup_mode": None,
    "context_settings": {"help_option_names": ["-h", "--help"], "show_default": True},
}


def make_app(help: str, *, group: bool = False, **kwargs: Any) -> typer.Typer:
    """A Typer app with the project's conventions (no completion, no rich tracebacks, plain
    help that shows defaults and choices).

    ``group=True`` keeps it a command group even with a single subcommand (``pyvision model
    tiny``); otherwise a one-command app is that command (``pyvision sft``).
    """
    app = typer.Typer(help=help, cls=PyVisionGroup,
                      no_args_is_help=kwargs.pop("no_args_is_help", True), **APP_SETTINGS,
                      **kwargs)
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
    "--config", "-c", metavar="RECIPE",
    help="Recipe YAML or a shipped recipe's name (tiny-cpu, pyvision-image-7b, ...) [default: tiny-cpu].", show_default=False)]
SetOpt = Annotated[list[str] | None, typer.Option(
    "--set", metavar="KEY=VALUE",
    help="Override a recipe key, e.g. --set rl.learning_rate=1e-6 (repeatable).",
    show_default=False)]
StoreOpt = Annotated[Path | None, typer.Option(
    "--store", envvar="PYVISION_STORE", metavar="FILE",
    help="DuckDB store file [default: runs/pyvision.duckdb].", show_default=False)]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print machine-readable JSON on stdout.")]
ForceOpt = Annotated[bool, typer.Option("--force", help="Redo stages that already finished.")]
# sft and rl: what --resume and --force mean, alone and together.
StageForceOpt = Annotated[bool, typer.Option("--force", help=(
    "Start the stage over: its folder and its metrics in the store are removed first. With "
    "--resume: continue from the last checkpoint although the config changed (the new config "
    "replaces the old)."))]
ResumeOpt = Annotated[bool, typer.Option("--resume", help=(
    "Continue an unfinished stage from its last checkpoint; the metrics after that checkpoint "
    "are replaced. Refused when the config changed, unless --force is given too."))]
RERUN_CONFIG_HINT = ("pass --resume --force to continue from the last checkpoint with the new "
                     "config, --force alone to start over, or --run-id NEW for a separate run")
def check_run_id_option(value: str | None) -> str | None:
    """The one run-id rule (:func:`pipelines.rundir.check_run_id`), applied while parsing."""
    if value is None:
        return None
    from pipelines.rundir import RUN_ID_RULE, valid_run_id

    if not valid_run_id(value):
        raise typer.BadParameter(f"'{value}' is not a valid run id ({RUN_ID_RULE})")
    return value


RunIdOpt = Annotated[str | None, typer.Option(
    "--run-id", metavar="ID", callback=check_run_id_option,
    help="Run id: runs/<run-id>/<stage>/ [default: the recipe's name].", show_default=False)]


def load_recipe(config: Path | None, sets: list[str] | None):
    """The recipe from ``-c`` (default: tiny-cpu) with ``--set`` overrides applied."""
    from pipelines.config.recipe import load_recipe as _load

    return _load(config, tuple(sets or ()))


def print_json(obj: Any) -> None:
    """Write ``obj`` as JSON to stdout (the only thing a ``--json`` command prints there)."""
    sys.stdout.write(json.dumps(obj, indent=2, default=str) + "\n")
    sys.stdout.flush()
