"""The stderr console shared by the CLI and the pipelines (stdout stays for data)."""

from __future__ import annotations

import unicodedata

from rich.console import Console

err = Console(stderr=True, highlight=False)

# Bidirectional overrides and isolates: they reorder what follows them on the line.
_BIDI = frozenset("\u061c\u200e\u200f\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069")


def terminal_safe(text: object) -> str:
    """``text`` as it may reach a terminal: control characters (ESC, BEL, a lone CR, the C1
    range) and bidirectional overrides are shown escaped (``\\x1b``), newlines (``\\r\\n`` too)
    and tabs kept. Model text, interpreter output and stored rows are hostile: raw, they could
    clear the screen, set the window title, write the clipboard (OSC 52), plant hyperlinks or
    reorder a line. Show the result as a rich ``Text``, never as markup (``[/x]`` would raise,
    ``[link=...]`` would make a link)."""
    text = str(text).replace("\r\n", "\n")
    return "".join(repr(c)[1:-1] if (c not in "\n\t" and unicodedata.category(c) == "Cc")
                   or c in _BIDI else c for c in text)


class StatusProgress:
    """A transient progress bar on ``err`` whose last column shows ``status()`` as it changes
    (a stalled server, a retry), refreshed by rich's own thread even while the caller waits.

    ``describe`` (optional) rewrites the label on each ``advance`` (e.g. acceptance so far).
    Disabled, every method does nothing."""

    def __init__(self, enabled: bool, label: str, total: int, done: int = 0, *,
                 status=None) -> None:
        self.enabled = enabled
        if not enabled:
            return
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            ProgressColumn,
            TextColumn,
            TimeElapsedColumn,
        )
        from rich.text import Text

        class _Status(ProgressColumn):
            def render(self, task):
                line = status() if status is not None else None
                return Text(line or "", style="yellow")

        # The label names models and folders: shown as it is, never read as markup.
        self.bar = Progress(TextColumn("{task.description}", markup=False), BarColumn(), MofNCompleteColumn(),
                            TimeElapsedColumn(), _Status(), console=err, transient=True)
        self.task = self.bar.add_task(label, total=total, completed=done)
        self.bar.start()

    def advance(self, n: int = 1, label: str | None = None) -> None:
        if self.enabled:
            if label is None:
                self.bar.advance(self.task, n)
            else:
                self.bar.update(self.task, advance=n, description=label)

    def close(self) -> None:
        if self.enabled:
            self.bar.stop()
