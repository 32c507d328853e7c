"""Every error message and hint in the code says things that are true of the real CLI.

The texts are read from the source (each UserError-family call's message and `hint=`, and
`pyvision doctor`'s fixes); f-string holes become `X`. In each text:

- a command line (`pyvision ...`, quoted or not) must parse against the real command tree:
  the subcommands exist, every option exists and takes the value given (a command named without
  all its required options is fine: hints often name a command, not a whole call);
- every other `--flag` must be an option of some pyvision command;
- every recipe key (`--set a.b=...`, `set a.b=...`) must be a real recipe key;
- every README section it points to must exist;
- no text may end cut off (`--set rl.n=.`).
"""

from __future__ import annotations

import ast
import re

import pytest
from typer._click.exceptions import UsageError

from pipelines.config.loader import _valid_keys
from pipelines.config.recipe import Recipe
from pipelines.errors import UserError
from pyvision_cli.main import COMMANDS
from tests.command_lines import PLACEHOLDER, all_flags, parse_command_line
from tests.helpers import REPO as ROOT

SOURCES = ("pipelines", "benchmarks", "pyvision_cli")


def _error_calls() -> set[str]:
    """typer's BadParameter, UserError and every class in the sources derived from it, directly or
    not (read from the AST by name, so a new error type is checked without being listed here)."""
    bases: dict[str, set[str]] = {}
    for folder in SOURCES:
        for path in (ROOT / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if isinstance(node, ast.ClassDef):
                    bases[node.name] = {b.attr if isinstance(b, ast.Attribute) else
                                        getattr(b, "id", "") for b in node.bases}
    names = {"UserError"}
    while new := {name for name, of in bases.items() if of & names} - names:
        names |= new
    return names | {"BadParameter"}


ERROR_CALLS = _error_calls()
# Hints owned by work in flight elsewhere, each with the text it still holds. The test fails
# when one is fixed, so that this list only ever shrinks.
KNOWN: dict[tuple[str, str], str] = {}


def _texts(node: ast.AST | None) -> list[str]:
    """The strings an expression can evaluate to, holes as X (unknown expressions: none)."""
    if node is None:
        return []
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, ast.JoinedStr):
        out = [""]
        for part in node.values:
            options = _texts(part) if isinstance(part, ast.Constant) else [PLACEHOLDER]
            out = [a + b for a in out for b in options]
        return out
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        return [a + b for a in _texts(node.left) for b in _texts(node.right)]
    if isinstance(node, ast.IfExp):
        return _texts(node.body) + _texts(node.orelse)
    if isinstance(node, ast.BoolOp):
        return [t for v in node.values for t in _texts(v)]
    return []


def collect_texts() -> list[tuple[str, str]]:
    """(file, text) for every error message, hint and doctor fix in the sources."""
    out: list[tuple[str, str]] = []
    for folder in SOURCES:
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = str(path.relative_to(ROOT))
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if not isinstance(node, ast.Call):
                    continue
                func = node.func
                name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
                exprs: list[ast.AST] = []
                if name in ERROR_CALLS:
                    exprs = node.args[:1] + [k.value for k in node.keywords if k.arg == "hint"]
                elif name == "Check":
                    exprs = node.args[2:4] + [k.value for k in node.keywords if k.arg == "fix"]
                out += [(rel, t) for e in exprs for t in _texts(e)]
            if rel == "pipelines/doctor.py":  # PACKAGES: name -> (purpose, fix)
                out += [(rel, t) for t in re.findall(r'"([^"]*pip install[^"]*)"',
                                                     path.read_text(encoding="utf-8"))]
    return out


TEXTS = collect_texts()


COMMAND_RE = re.compile(r"`(pyvision [^`]+)`|(?<![`\w])(pyvision (?:" + "|".join(COMMANDS)
                        + r")\b[^;`)]*?)(?=$|[;`)]|, or |\. )")
QUOTED_RE = re.compile(r"`[^`]*`")  # another tool's command line (`vllm serve ... --port`)
FLAG_RE = re.compile(r"(?<![\w`-])--[a-z][a-z0-9-]*")
KEY_RE = re.compile(r"(?:--set |\bset |^)([a-z_]+(?:\.[a-z_]+)+)=")
README_RE = re.compile(r"README, '([^']+)'")


def problems_in(text: str, flags: set[str], keys: set[str], headings: list[str]) -> list[str]:
    found = []
    commands = [a or b for a, b in COMMAND_RE.findall(text)]
    for line in commands:
        line = line.strip().rstrip(".")
        try:
            parse_command_line(line)
        except (UsageError, AssertionError) as exc:
            found.append(f"`{line}` does not parse: {exc}")
    rest = QUOTED_RE.sub(" ", COMMAND_RE.sub(" ", text))
    for flag in FLAG_RE.findall(rest):
        if flag not in flags:
            found.append(f"no pyvision command has {flag}")
    for key in KEY_RE.findall(text):
        if PLACEHOLDER not in key and key not in keys:
            found.append(f"'{key}' is not a recipe key")
    for section in README_RE.findall(text):
        if not any(section in h for h in headings):
            found.append(f"README has no section '{section}'")
    line = UserError("m", hint=text).one_line()
    if re.search(r"(=|\s|\(|/)\.$|\.\.\.?\.$", line):
        found.append(f"cut off: {line[-40:]!r}")
    return found


def test_hints_are_collected():
    # The collector must see the code's hints, or the checks below prove nothing.
    assert len(TEXTS) > 300
    assert any("pyvision data download" in t for _, t in TEXTS)
    assert any(f == "pipelines/doctor.py" for f, _ in TEXTS)
    assert {"DataError", "PromptTooLong", "PlaceholderMismatch", "ConfigChanged"} <= ERROR_CALLS
    commands = {a or b for _, t in TEXTS for a, b in COMMAND_RE.findall(t)}
    assert len(commands) >= 15 and "pyvision data prepare --run-id X" in commands


def test_every_hint_names_real_commands_flags_keys_and_sections():
    flags = all_flags()
    keys = set(_valid_keys(Recipe))
    headings = [line.lstrip("# ").strip() for line in
                (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
                if line.startswith("#")]
    bad: dict[tuple[str, str], list[str]] = {}
    for path, text in TEXTS:
        for problem in problems_in(text, flags, keys, headings):
            bad.setdefault((path, problem), []).append(text)
    known = {k for k in bad if any(k[0] == f and flag in k[1] for f, flag in KNOWN)}
    unexpected = {k: v for k, v in bad.items() if k not in known}
    assert not unexpected, "\n".join(f"{p}: {problem}\n    in: {texts[0]!r}"
                                     for (p, problem), texts in unexpected.items())
    fixed = [k for k in KNOWN if not any(p == k[0] and k[1] in pr for p, pr in known)]
    assert not fixed, f"fixed, remove from KNOWN: {fixed}"


@pytest.mark.parametrize("text, problem", [
    ("pass --base-url URL", "no pyvision command has --base-url"),
    ("set sandbox.isolaton=auto", "'sandbox.isolaton' is not a recipe key"),
    ("or with --set rl.n=...", "cut off"),
    ("run `pyvision rl --epochs 3`", "does not parse"),
    ("run `pyvision trian`", "does not parse"),
    ("see README, 'At scale'", "README has no section 'At scale'"),
])
def test_the_checker_catches_what_it_is_for(text, problem):
    headings = ["Evaluation", "Running on a Ray cluster (verl)"]
    found = problems_in(text, all_flags(), set(_valid_keys(Recipe)), headings)
    assert any(problem in f for f in found), found


def test_good_hints_pass_the_checker():
    for text in ("run `pyvision data prepare --run-id X` first, or pass --model PATH",
                 "e.g. pyvision merge --lora runs/x/sft/output --base MODEL --out DIR",
                 "set sandbox.isolation=auto, or --set rl.learning_rate=VALUE",
                 "pass --resume --force to continue"):
        assert problems_in(text, all_flags(), set(_valid_keys(Recipe)), []) == [], text
