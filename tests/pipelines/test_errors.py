"""The one line a UserError prints: what, where, how to fix; nothing that breaks the line."""

from __future__ import annotations

from pipelines.errors import UserError


def test_the_line_ends_once_and_joins_the_hint():
    assert UserError("store x is locked.", hint="wait.").one_line() == \
        "store x is locked. Fix: wait."
    assert UserError("unknown key 'a'; did you mean 'b'?", hint="rename it").one_line() == \
        "unknown key 'a'; did you mean 'b'? Fix: rename it."


def test_line_breaks_and_control_characters_from_names_do_not_reach_the_terminal():
    line = str(UserError("missing media file a\nb\x00c \x1b[2Jd\te é.png", hint="fix it"))
    assert line == "missing media file a b\\x00c \\x1b[2Jd\\te é.png. Fix: fix it."
    assert line.isprintable()
