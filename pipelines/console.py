"""The stderr console shared by the CLI and the pipelines (stdout stays for data)."""

from __future__ import annotations

from rich.console import Console

err = Console(stderr=True, highlight=False)


def terminal_text(text: str) -> str:
    """What model-written code printed (or a model wrote), safe to show on a terminal: control
    characters but newlines and tabs shown escaped, so that escape sequences cannot set its
    title, write the clipboard (OSC 52) or redraw the screen. Show it as a rich ``Text``, never
    as markup (``[/x]`` would raise, ``[link=...]`` would make a link)."""
    return "".join(c if c.isprintable() or c in "\n\t" else repr(c)[1:-1] for c in text)


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

        self.bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
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
