"""Errors that reach the user.

A :class:`UserError` is something the user can fix (a bad config key, a missing file, an
unreachable endpoint). The CLI prints its message on one line, without a traceback, and exits with
code 2. Everything else is a bug and propagates with its traceback.

Messages follow one shape: *what* went wrong, *where* (file, line, key, URL), and *how to fix it*.
"""

from __future__ import annotations

import codecs
import errno
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import json


DISK_REFUSED = (errno.ENOSPC, errno.EDQUOT, errno.EROFS)
"""The errors of a write the disk refused (full, over quota, read-only): the user's to fix, so one
line (the CLI for an ``OSError``, the store for DuckDB's), not a traceback."""


class UserError(Exception):
    """An error caused by user input; the CLI reports it in one line and exits with code 2."""

    exit_code = 2

    def __init__(self, message: str, *, hint: str | None = None) -> None:
        self.message = message
        self.hint = hint
        super().__init__(self.one_line())

    def one_line(self) -> str:
        text = self.message.rstrip(". ")
        if self.hint:  # a message ending in a question ("did you mean ...?") keeps its mark
            text += (" " if text.endswith(("?", "!")) else ". ") + f"Fix: {self.hint.rstrip('. ')}"
        text = text.replace("\n", " ")
        # A control character from a file name or a row (NUL, ESC ...) is shown escaped: the
        # line stays one line and cannot drive the terminal.
        text = "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)
        return text if text.endswith(("?", "!")) else text + "."


class ConfigError(UserError):
    """A recipe or `--set` override that does not validate."""


class DataError(UserError):
    """A dataset row, media file or JSONL line that cannot be used."""


class EndpointError(UserError):
    """A model, judge or hub endpoint that does not answer after bounded retries."""


class SubprocessFailed(UserError):
    """An external engine (LLaMA-Factory, verl, lmms-eval) exited with an error."""


class ConfigChanged(UserError):
    """A stage of a run was made with another resolved config than the one given now.

    ``changed`` holds the dotted keys whose values differ; :meth:`shown` is how the message
    lists them (the first five), for callers that name them elsewhere.
    """

    def __init__(self, what: str, changed: Sequence[str], *, hint: str | None = None) -> None:
        self.changed = tuple(changed)
        super().__init__(f"{what} was made with a different config ({self.shown()} changed)",
                         hint=hint)

    def shown(self) -> str:
        return ", ".join(self.changed[:5]) + (" ..." if len(self.changed) > 5 else "")


class ManifestError(UserError):
    """A stage's ``manifest.json`` that is not valid JSON or not the shape that stage writes."""


def require_file(path: str | Path, what: str, hint: str | None = None) -> Path:
    """Return ``path`` as a Path if it is an existing file, else raise a :class:`UserError`."""
    p = Path(path)
    if not p.exists():
        raise UserError(f"{what} not found: {p}", hint=hint or "check the path")
    if not p.is_file():
        raise UserError(f"{what} is not a file: {p}", hint=hint or "pass a file, not a directory")
    return p


def decode_utf8(data: bytes, where: str | Path) -> str:
    """``data`` as UTF-8 text (a leading byte-order mark is dropped); other bytes are a UserError
    naming ``where``, the line and the column."""
    data = data.removeprefix(codecs.BOM_UTF8)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        column = exc.start - (data.rfind(b"\n", 0, exc.start) + 1) + 1
        raise UserError(f"{where}:{line}: not UTF-8 text (byte 0x{data[exc.start]:02x} at column "
                        f"{column})", hint="save the file as UTF-8") from None


def malformed_json(exc: json.JSONDecodeError) -> str:
    """How JSON that does not parse is described after its ``file:line`` in errors and reports:
    the parser's reason and the column."""
    return f"malformed JSON ({exc.msg} at column {exc.colno})"
