"""The repository's Markdown holds up when read:

- an in-page link (``[x](#anchor)``) names a heading of its own file, by GitHub's anchor rule, and a
  relative link names a file or folder that exists, so a contents list that a new section outdates,
  or a renamed file, fails here instead of on a reader;
- every ``pyvision`` command line a user may copy (in code blocks and inline code of the README and
  the guides, and the command table's synopses) parses against the real CLI, and every ``--set``
  key it shows is a recipe key, so a renamed option or key cannot leave the docs behind. The lab
  notebook (docs/tiny-recipe.md) records commands of past commits and is held to this only in its
  "Reproducing a comparison" section; the CHANGELOG records history and is not checked.
"""

from __future__ import annotations

import itertools
import re
import shlex
from pathlib import Path

import pytest
from typer._click.exceptions import UsageError

from pipelines.config.loader import _valid_keys
from pipelines.config.recipe import Recipe
from tests.command_lines import parse_command_line
from tests.helpers import REPO

DOCS = sorted([REPO / "README.md", REPO / "CHANGELOG.md", REPO / "tests" / "README.md",
               *(REPO / "docs").glob("*.md")])
LINK = re.compile(r"\]\(([^)\s]+)\)")


def _is_fence(line: str) -> bool:
    """Whether ``line`` opens or closes a fenced code block (indented ones in lists too)."""
    return line.lstrip().startswith("```")


def _prose(text: str) -> list[str]:
    """The file's lines outside fenced code blocks."""
    lines, fenced = [], False
    for line in text.splitlines():
        if _is_fence(line):
            fenced = not fenced
        elif not fenced:
            lines.append(line)
    return lines


def anchors(text: str) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation but ``-`` and ``_`` dropped, spaces as
    hyphens, a repeated heading numbered ``-1``, ``-2`` ..."""
    seen: dict[str, int] = {}
    out = set()
    for line in _prose(text):
        m = re.match(r"^#{1,6} (.*)$", line)
        if not m:
            continue
        slug = re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-")
        if slug in seen:
            seen[slug] += 1
            slug = f"{slug}-{seen[slug]}"
        else:
            seen[slug] = 0
        out.add(slug)
    return out


def test_anchor_rule_matches_github():
    text = "# A\n## What `make demo` gives, seed by seed\n```\n# not a heading\n```\n## RL at 3e-5 (0bf1056)\n## A\n"
    assert anchors(text) == {"a", "what-make-demo-gives-seed-by-seed", "rl-at-3e-5-0bf1056", "a-1"}


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(REPO)))
def test_links_resolve(doc: Path):
    text = doc.read_text(encoding="utf-8")
    own = anchors(text)
    broken = []
    for line in _prose(text):
        for target in LINK.findall(line):
            if re.match(r"^[a-z]+:", target):  # http:, https:, mailto:
                continue
            path, _, frag = target.partition("#")
            where = doc if not path else (doc.parent / path)
            if path and not where.exists():
                broken.append(f"{target}: no such file")
            elif frag and where.suffix == ".md" and frag not in (own if not path else anchors(where.read_text(encoding="utf-8"))):
                broken.append(f"{target}: no such heading")
    assert not broken, f"{doc.relative_to(REPO)}: " + "; ".join(broken)


# -- command lines ---------------------------------------------------------------------------------

GUIDES = [REPO / "README.md", REPO / "tests" / "README.md", REPO / "docs" / "gpu-check.md",
          REPO / "docs" / "verl-integration.md"]
NOTEBOOK, NOTEBOOK_SECTION = REPO / "docs" / "tiny-recipe.md", "## Reproducing a comparison"
SHELL_END = re.compile(r"\s+(?:\||&&|;|>|2>|#)\s|;\s*|\s*&&\s*")  # where the shell takes over
SET_KEY = re.compile(r"--set '?([a-z_]+(?:\.[a-z_]+)+)=")
KEY_PLACEHOLDERS = {"dotted.key"}


def _checked_text(doc: Path) -> str:
    text = doc.read_text(encoding="utf-8")
    if doc != NOTEBOOK:
        return text
    start = text.index(NOTEBOOK_SECTION)
    end = text.find("\n## ", start + 1)
    return text[start:end if end > 0 else None]


def command_lines(text: str) -> list[str]:
    """The ``pyvision ...`` lines of a Markdown text: from code blocks (continuations joined, a
    leading ``VAR=value`` or shell keyword dropped) and from inline code (across line breaks)."""
    found, fenced, pending = [], False, None
    for line in text.splitlines():
        if _is_fence(line):
            fenced, pending = not fenced, None
            continue
        if not fenced:
            continue
        if pending is None:
            m = re.search(r"(?:^|[\s;(]|\bdo\s)(pyvision\s.*)$", line.strip())
            if not m:
                continue
            pending, line = "", m.group(1)
        pending += " " + line.strip()
        if pending.endswith("\\"):
            pending = pending[:-1].rstrip()
            continue
        found.append(pending.strip())
        pending = None
    inline = re.sub(r"\s*\n\s*", " ", "\n".join(_prose(text)))
    found += re.findall(r"`(pyvision [^`]+)`", inline)
    return found


def variants(line: str) -> list[str]:
    """A documented line as the command lines it stands for: up to the shell's next command, a
    synopsis's ``[optional]`` marks dropped, ``a|b`` alternatives each taken, ``...`` dropped,
    ``$VAR`` standing for more arguments dropped and one inside a value given a value."""
    line = SHELL_END.split(line.replace("\\|", "|"), maxsplit=1)[0]
    tokens = []
    for tok in shlex.split(line):
        if tok.startswith("[-") or (tok.startswith("[") and "]" not in tok):
            tok = tok[1:]
        if tok.endswith("]") and "[" not in tok:
            tok = tok[:-1]
        tok = re.sub(r",?\.\.\.$", "", tok)
        if not tok or re.fullmatch(r"\$\{?\w+\}?", tok):
            continue
        tokens.append(re.sub(r"\$\{?\w+\}?", "0", tok))
    options = [t.split("|") if "|" in t and not t.startswith(("{", "'")) else [t] for t in tokens]
    return [shlex.join(choice) for choice in itertools.product(*options)]


def test_variants_read_synopses_and_shell_lines():
    assert variants("pyvision rl -c RECIPE [--engine local\\|verl] [--resume]") == [
        "pyvision rl -c RECIPE --engine local --resume", "pyvision rl -c RECIPE --engine verl --resume"]
    assert variants("pyvision show RUN [--sample ID \\| --changed A B]") == ["pyvision show RUN --sample ID"]
    assert variants("pyvision report --run R$s --json | jq .") == ["pyvision report --run R0 --json"]
    assert variants("pyvision rl -c x.yaml $SETS --dry-run") == ["pyvision rl -c x.yaml --dry-run"]
    assert variants("pyvision eval --benchmarks vstar,hrbench4k,...") == [
        "pyvision eval --benchmarks vstar,hrbench4k"]
    assert command_lines("```bash\nfor s in 0 1; do\n  OMP_NUM_THREADS=1 pyvision run a.yaml \\\n"
                         "    --until sft\ndone\n```\nor `pyvision report\n--json`.") == [
        "pyvision run a.yaml --until sft", "pyvision report --json"]


def _problems(doc: Path) -> list[str]:
    text = _checked_text(doc)
    problems = []
    for line in command_lines(text):
        for variant in variants(line):
            try:
                parse_command_line(variant)
            except (UsageError, AssertionError) as exc:
                problems.append(f"`{variant}` (from `{line}`): {exc}")
    keys = set(_valid_keys(Recipe))
    flat = re.sub(r"\s*\n\s*", " ", text)
    problems += [f"--set {key}: not a recipe key" for key in SET_KEY.findall(flat)
                 if key not in keys and key not in KEY_PLACEHOLDERS]
    return problems


@pytest.mark.parametrize("doc", [*GUIDES, NOTEBOOK], ids=lambda p: str(p.relative_to(REPO)))
def test_documented_command_lines_parse(doc: Path):
    assert command_lines(_checked_text(doc)), f"{doc.relative_to(REPO)} shows no pyvision command"
    problems = _problems(doc)
    assert not problems, f"{doc.relative_to(REPO)}:\n" + "\n".join(problems)


def test_the_command_check_catches_a_renamed_option_and_key(tmp_path, monkeypatch):
    doc = tmp_path / "guide.md"
    doc.write_text("Run `pyvision rl -c tiny-cpu --epochs 3` or\n```bash\npyvision eval --model M \\\n"
                   "  --set eval.batchsize=4\n```\n", encoding="utf-8")
    problems = _problems(doc)
    assert any("--epochs" in p for p in problems), problems
    assert any("eval.batchsize: not a recipe key" in p for p in problems), problems
