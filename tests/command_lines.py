"""Command lines checked against the real CLI, for the tests that hold texts to it (error hints,
the docs): a line parses when its subcommands and options exist and take the values given."""

from __future__ import annotations

import enum
import re
import shlex
import typing

import typer
from typer._click.core import Command, Context
from typer._click.exceptions import BadParameter, MissingParameter, NoArgsIsHelpError
from typer.core import TyperGroup as Group

from pyvision_cli.main import app

PLACEHOLDER = "X"  # what an f-string's hole becomes in a text read from the source


def _root() -> Group:
    return typer.main.get_command(app)


def _base_make_context(cmd: Command):
    """The command's make_context without pyvision's one-line conversion (which exits)."""
    for cls in type(cmd).__mro__:
        if not cls.__module__.startswith("pyvision_cli") and "make_context" in vars(cls):
            return vars(cls)["make_context"].__get__(cmd)
    raise AssertionError(type(cmd))  # pragma: no cover


def parse_command_line(line: str) -> None:
    """Parse ``pyvision ...`` against the real CLI; raise UsageError for anything unknown.

    Placeholders (PATH, DIR, N, X ...) stand for values: each is given one every type accepts, or,
    for an option with choices, its first choice. A command named without its subcommand or its
    required options parses: texts often name a command, not a whole call."""
    args = shlex.split(line)[1:]
    placeholders = {i for i, a in enumerate(args) if re.fullmatch(r"[A-Z_\[\],.]+|X", a)}
    args = ["1" if i in placeholders else a for i, a in enumerate(args)]
    while True:
        try:
            return _parse(line, args)
        except BadParameter as exc:
            choices = _choices(exc.param)
            at = [i for i in sorted(placeholders)
                  if i > 0 and exc.param is not None and args[i - 1] in exc.param.opts]
            if not choices or not at:
                raise
            args[at[0]] = str(choices[0])
            placeholders.discard(at[0])


def _choices(param) -> list[str]:
    """The values a parameter typed ``Literal[...]`` or an Enum accepts (none for other types)."""
    annotation = getattr(getattr(param, "type_descriptor", None), "annotation", None)
    out: list[str] = []
    for arg in typing.get_args(annotation) or ([annotation] if annotation is not None else []):
        if isinstance(arg, str):
            out.append(arg)
        elif isinstance(arg, type) and issubclass(arg, enum.Enum):
            out += [str(m.value) for m in arg]
        elif typing.get_origin(arg) is typing.Literal:
            out += [str(a) for a in typing.get_args(arg)]
    return out


def _parse(line: str, args: list[str]) -> None:
    cmd: Command = _root()
    try:
        ctx = _base_make_context(cmd)("pyvision", list(args), resilient_parsing=False)
    except NoArgsIsHelpError:
        return
    while isinstance(cmd, Group):
        rest = [*ctx._protected_args, *ctx.args]
        if not rest:
            return
        name, sub, rest = cmd.resolve_command(ctx, rest)
        assert sub is not None, line
        cmd = sub
        try:
            ctx = _base_make_context(cmd)(name, rest, parent=ctx)
        except (MissingParameter, NoArgsIsHelpError):
            return


def all_flags() -> set[str]:
    """Every ``--option`` of every pyvision command."""
    flags: set[str] = set()

    def walk(cmd: Command, ctx: Context) -> None:
        for param in cmd.params:
            flags.update(o for o in [*param.opts, *param.secondary_opts] if o.startswith("--"))
        if isinstance(cmd, Group):
            for name in cmd.list_commands(ctx):
                sub = cmd.get_command(ctx, name)
                walk(sub, Context(sub, parent=ctx, info_name=name))

    root = _root()
    walk(root, Context(root, info_name="pyvision"))
    return flags
