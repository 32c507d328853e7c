"""The repository's Markdown links lead somewhere: an in-page link (``[x](#anchor)``) names a heading
of its own file, by GitHub's anchor rule, and a relative link names a file or folder that exists. A
contents list that a new section outdates, or a renamed file, fails here instead of on a reader."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.helpers import REPO

DOCS = sorted([REPO / "README.md", REPO / "CHANGELOG.md", REPO / "tests" / "README.md",
               *(REPO / "docs").glob("*.md")])
LINK = re.compile(r"\]\(([^)\s]+)\)")


def _prose(text: str) -> list[str]:
    """The file's lines outside fenced code blocks."""
    lines, fenced = [], False
    for line in text.splitlines():
        if line.startswith("```"):
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
