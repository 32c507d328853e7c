"""Trajectories in a terminal (`pyvision show`): the trajectory page's views, drawn with Rich.

- a list of the run's samples (filtered by model, benchmark and verdict);
- one sample, every model of the run one after the other (``--sample``): question, gold answer,
  then per model the verdict and the scorer that decided it, turns, tool calls, visual tokens,
  stop reason, and each turn: the model's text, its code (highlighted), the interpreter's output
  and images;
- the samples whose verdict changed between two models (``--changed A B``).

Images are the stored thumbnails. In a terminal that shows images (iTerm2 and WezTerm's inline
images, kitty's graphics protocol) they are drawn inline; elsewhere each is written once into a
media folder (by default next to the store) and its path is printed.
"""

from __future__ import annotations

import base64
import difflib
import io
import os
from pathlib import Path
from typing import Any

from rich.console import Console, Group
from rich.markup import escape
from rich.panel import Panel
from rich.rule import Rule
from rich.syntax import Syntax
from rich.table import Table
from rich.text import Text

from pipelines.console import terminal_safe as safe
from pipelines.core.media import EXTENSION
from pipelines.errors import UserError
from pipelines.report.trajectories import (
    VERDICTS,
    TrajectorySet,
    collect_trajectories,
)

IMAGE_MODES = ("auto", "inline", "paths", "none")
_COLOURS = {"right": "green", "wrong": "red", "partial": "yellow", "unscored": "dim",
            "fixed": "green", "broken": "red", "changed": "yellow"}


def inline_protocol(env: dict[str, str] | None = None) -> str | None:
    """``iterm`` (iTerm2, WezTerm), ``kitty``, or None when the terminal shows no images."""
    env = dict(os.environ) if env is None else env
    if env.get("TERM_PROGRAM") in ("iTerm.app", "WezTerm"):
        return "iterm"
    if env.get("TERM") == "xterm-kitty" or env.get("KITTY_WINDOW_ID"):
        return "kitty"
    return None


def _png(data: bytes) -> bytes:
    from PIL import Image

    out = io.BytesIO()
    with Image.open(io.BytesIO(data)) as img:
        img.save(out, format="PNG")
    return out.getvalue()


def inline_image(data: bytes, protocol: str) -> str:
    """The escape sequence that draws an image (PNG) in the terminal."""
    payload = base64.b64encode(_png(data)).decode()
    if protocol == "iterm":
        return f"\033]1337;File=inline=1;size={len(payload)};preserveAspectRatio=1:{payload}\a"
    chunks = [payload[i: i + 4096] for i in range(0, len(payload), 4096)] or [""]
    parts = []
    for i, chunk in enumerate(chunks):
        more = 1 if i < len(chunks) - 1 else 0
        head = f"a=T,f=100,m={more}" if i == 0 else f"m={more}"
        parts.append(f"\033_G{head};{chunk}\033\\")
    return "".join(parts)


class Images:
    """Where the thumbnails go: inline, as files (paths printed), or nowhere."""

    def __init__(self, store: Any, console: Console, mode: str, media_dir: Path) -> None:
        if mode not in IMAGE_MODES:
            raise UserError(f"unknown --images '{mode}'", hint=f"use one of {', '.join(IMAGE_MODES)}")
        self.store, self.console, self.media_dir = store, console, media_dir
        protocol = inline_protocol() if console.is_terminal else None
        if mode == "inline" and protocol is None:
            protocol = "iterm"  # asked for: the most widely supported protocol
        self.protocol = protocol if mode in ("auto", "inline") else None
        self.mode = "none" if mode == "none" else ("inline" if self.protocol else "paths")

    def path(self, sha: str) -> Path | None:
        """The thumbnail as a file (written once)."""
        target = self.media_dir / f"{sha}{EXTENSION}"
        if not target.is_file():
            blob = self.store.media([sha]).get(sha)
            if blob is None:
                return None
            self.media_dir.mkdir(parents=True, exist_ok=True)
            tmp = target.with_suffix(".tmp")
            tmp.write_bytes(blob.data)
            tmp.replace(target)
        return target

    def show(self, sha: str | None, label: str) -> None:
        if sha is None:
            self.console.print(f"  [dim]{escape(label)}: not stored[/]")
            return
        if self.mode == "none":
            self.console.print(f"  [dim]{escape(label)}[/]")
            return
        if self.mode == "inline":
            blob = self.store.media([sha]).get(sha)
            if blob is not None:
                self.console.print(f"  [dim]{escape(label)}:[/]")
                self.console.file.write(inline_image(blob.data, self.protocol or "iterm") + "\n")
                self.console.file.flush()
                return
        path = self.path(sha)
        self.console.print(f"  [dim]{escape(label)}:[/] {escape(str(path) if path else 'not stored')}",
                           soft_wrap=True, highlight=False)


def _n(count: int, word: str) -> str:
    return f"{count} {word}{'' if count == 1 else 's'}"


def _verdict(v: str) -> str:
    return f"[bold {_COLOURS.get(v, 'white')}]{v}[/]"


def _check_models(ts: TrajectorySet, keys: list[str]) -> None:
    known = [m["key"] for m in ts.models]
    for key in keys:
        if key not in known:
            close = difflib.get_close_matches(key, known, n=1)
            raise UserError(f"model '{key}' has no evaluated samples in the store",
                            hint=(f"did you mean '{close[0]}'? " if close else "")
                            + f"known: {', '.join(known) or 'none'}")


def load(store: Any, run: str, extra_runs: list[str] = ()) -> TrajectorySet:
    runs = [r["run_id"] for r in store.runs()]
    for rid in [run, *extra_runs]:
        if rid not in runs:
            close = difflib.get_close_matches(rid, runs, n=1)
            raise UserError(f"run '{rid}' is not in the store {store.path}",
                            hint=(f"did you mean '{close[0]}'? " if close else "")
                            + f"known runs: {', '.join(runs) or 'none'}")
    ts = collect_trajectories(store, list(dict.fromkeys([run, *extra_runs])), with_rollouts=False)
    if not ts.entries:
        raise UserError(f"run '{run}' has no evaluated samples in the store",
                        hint="run `pyvision eval` (or `pyvision run`) for it first")
    return ts


def model_key(run: str, model: str) -> str:
    """``rl`` means the model ``rl`` of ``run``; ``other-run/rl`` another run's."""
    return model if "/" in model else f"{run}/{model}"


def select(ts: TrajectorySet, *, models: list[str] | None = None, benchmark: str | None = None,
           sample: str | None = None, verdict: str | None = None) -> list[dict[str, Any]]:
    if models:
        _check_models(ts, models)
    if benchmark and benchmark not in ts.benchmarks:
        raise UserError(f"benchmark '{benchmark}' has no samples in this run",
                        hint=f"known: {', '.join(ts.benchmarks)}")
    if verdict and verdict not in VERDICTS:
        raise UserError(f"unknown verdict '{verdict}'", hint=f"use one of {', '.join(VERDICTS)}")
    wanted = {ts.model_index(m) for m in models} if models else None
    out = [e for e in ts.entries
           if (wanted is None or e["m"] in wanted)
           and (not benchmark or ts.samples[e["s"]]["benchmark"] == benchmark)
           and (sample is None or ts.samples[e["s"]]["id"] == sample)
           and (not verdict or e["verdict"] == verdict)]
    if sample is not None and not out:
        ids = sorted({s["id"] for s in ts.samples})
        close = difflib.get_close_matches(sample, ids, n=1)
        raise UserError(f"sample '{sample}' is not among the selected samples",
                        hint=(f"did you mean '{close[0]}'? " if close else "")
                        + "list them with `pyvision show RUN`")
    return out


def print_headline(sentences: list[str], console: Console | None = None) -> None:
    """Each sentence on its own line (wrapped at spaces in a terminal, one line in a log)."""
    from pipelines.console import err

    console = console or err
    for sentence in sentences:
        console.print(Text(safe(sentence), style="bold"), soft_wrap=not console.is_terminal)


def print_table(title: str, header: list[str], rows: list[list[str | Text]],
                console: Console | None = None) -> None:
    """A table that is never cut to "benchm…". In a log (not a terminal) it is printed as wide
    as it needs, one line per row; in a terminal it wraps cells at spaces, and when even that
    would split words (a narrow terminal) it is printed as one block per row instead. Plain
    strings (the title and headers too) are shown as they are (never read as markup)."""
    from pipelines.console import err

    console = console or err
    cells = [[c if isinstance(c, Text) else Text(safe(c)) for c in row] for row in rows]
    table = Table(title=Text(title, style="table.title"))
    for h in header:
        table.add_column(Text(h), overflow="fold")
    for row in cells:
        table.add_row(*row)
    # Measured without the console's width as a cap (console.measure clamps to it).
    measured = console.measure(table, options=console.options.update_width(1_000_000))
    if not console.is_terminal:
        # Console.print never renders wider than its console: a wide twin on the same file.
        wide = Console(file=console.file, width=max(measured.maximum, console.width),
                       color_system=console.color_system, highlight=False)
        wide.print(table, crop=False)
    elif measured.minimum <= console.width:
        console.print(table)
    else:
        console.print(Text(title, style="bold"))
        for row in cells:
            label = " · ".join(f"{h} {c.plain}" for h, c in zip(header[:2], row[:2]))
            rest = "; ".join(f"{h} {c.plain}" for h, c in zip(header[2:], row[2:]))
            console.print(Text(f"- {label}: {rest}"))


def render_list(console: Console, ts: TrajectorySet, entries: list[dict[str, Any]],
                limit: int) -> None:
    rows = []
    for e in entries[:limit]:
        s = ts.samples[e["s"]]
        rows.append([ts.models[e["m"]]["key"], s["benchmark"], s["id"],
                     Text.from_markup(_verdict(e["verdict"])), str(e["prediction"]), s["gold"],
                     str(e["turns"]), str(e["tools"]), str(e["visual"]), e["stop"]])
    print_table(f"{len(entries)} samples" + (f" (first {limit})" if len(entries) > limit else ""),
                ["model", "benchmark", "sample", "verdict", "answer", "gold", "turns",
                 "tool calls", "visual tokens", "stop"], rows, console)


def render_changes(console: Console, changes: list[dict[str, Any]], a: str, b: str,
                   limit: int) -> None:
    fixed = sum(c["change"] == "fixed" for c in changes)
    broken = sum(c["change"] == "broken" for c in changes)
    rows = [[c["benchmark"], c["sample_id"],
             Text.from_markup(f"{_verdict(c['change'])} ({c['a']['verdict']} → "
                              f"{c['b']['verdict']})"),
             str(c["a"]["prediction"]), str(c["b"]["prediction"]), c["sample"]["gold"],
             str(c["a"]["tools"]), str(c["b"]["tools"])] for c in changes[:limit]]
    print_table(f"verdict changed from {a} to {b}: {len(changes)} samples ({fixed} fixed, "
                f"{broken} broken)", ["benchmark", "sample", "change", f"{a} answer",
                                      f"{b} answer", "gold", f"{a} tool calls",
                                      f"{b} tool calls"], rows, console)
    if changes:
        console.print(f"[dim]one of them turn by turn: pyvision show RUN --sample "
                      f"{escape(safe(changes[0]['sample_id']))}[/]", highlight=False)


def render_sample(console: Console, ts: TrajectorySet, entries: list[dict[str, Any]],
                  images: Images) -> None:
    """One sample: the question and its inputs once, then each model's trajectory."""
    s = ts.samples[entries[0]["s"]]
    console.print(Rule(f"{escape(safe(s['benchmark']))} · sample {escape(safe(s['id']))}"))
    console.print(Text(safe(s["question"])))
    gold = s["gold"]
    if s["options"] and len(gold) == 1 and "A" <= gold <= "Z" and ord(gold) - 65 < len(s["options"]):
        gold += f" ({s['options'][ord(gold) - 65]})"
    console.print(f"[bold]gold:[/] {escape(safe(gold))}", highlight=False)
    if s["video"]:
        console.print(f"[dim]video {escape(safe(s['video']))}: the model sees only the frames its code "
                      "sampled (interpreter images below)[/]", highlight=False)
    for i, sha in enumerate(s["inputs"]):
        images.show(sha, f"input image {i + 1}")
    for e in entries:
        render_entry(console, ts, e, images)


def render_entry(console: Console, ts: TrajectorySet, e: dict[str, Any], images: Images) -> None:
    s = ts.samples[e["s"]]
    head = (f"{escape(safe(ts.models[e['m']]['key']))} · {_verdict(e['verdict'])} · answer "
            f"{escape(safe(e['prediction']))} (gold {escape(safe(s['gold']))})")
    score = "-" if e["score"] is None else f"{e['score']:.3f}"
    facts = (f"score {e['metric'] or '-'} = {score}"
             f" · scored by {e['scored_by']} ({e['scorer']}) · {_n(e['turns'], 'turn')} · "
             f"{_n(e['tools'], 'tool call')}" + (f" ({e['failed']} failed)" if e["failed"] else "")
             + f" · {_n(e['visual'], 'visual token')} · stop: {e['stop']} · {e['seconds']} s")
    console.print()
    console.print(Panel(Text(safe(facts)), title=head, title_align="left", expand=True))
    if s["video"]:
        frames = [x for t in e["steps"] for x in t.get("imgs") or []]
        if not frames:
            console.print(f"  [yellow]the code sampled no frames ({e['visual']} visual tokens)[/]")
    for i, t in enumerate(e["steps"], start=1):
        console.print(Rule(f"model, turn {i}", align="left", style="dim"))
        if t["text"]:
            console.print(Text(safe(t["text"])))
        if "code" in t:
            console.print(Syntax(safe(t["code"]), "python", theme="ansi_dark", word_wrap=True,
                                 background_color="default"))
            body = [Text(f"{t['status']} ({t['tool_s']} s)"
                         + (", output truncated" if t["truncated"] else ""), style="bold")]
            if t["out"]:
                body.append(Text(safe(t["out"])))
            if t["err"]:
                body.append(Text(safe(t["err"]), style="red"))
            console.print(Panel(Group(*body), title="interpreter", title_align="left",
                                border_style="yellow" if t["status"] == "ok" else "red"))
            for k, sha in enumerate(t.get("imgs") or [], start=1):
                images.show(sha, f"interpreter image {k}")
            if t.get("after"):
                console.print(Text(safe(t["after"])))
    console.print(f"[bold]final answer:[/] {escape(safe(e['prediction']))} · gold "
                  f"{escape(safe(s['gold']))} · {_verdict(e['verdict'])}", highlight=False)


def entry_json(ts: TrajectorySet, e: dict[str, Any], images: Images | None) -> dict[str, Any]:
    s = ts.samples[e["s"]]
    out = {"model": ts.models[e["m"]]["key"], "benchmark": s["benchmark"], "sample_id": s["id"],
           "question": s["question"], "gold": s["gold"],
           **{k: e[k] for k in ("verdict", "score", "metric", "prediction", "stop", "turns",
                                "tools", "failed", "visual", "scored_by", "scorer", "steps")}}
    if images is not None and images.mode != "none":  # JSON names files, whatever the terminal
        def where(sha: str | None) -> str | None:
            path = images.path(sha) if sha else None
            return str(path) if path else None

        out["inputs"] = [where(x) for x in s["inputs"]]
        out["steps"] = [{**t, "imgs": [where(x) for x in t.get("imgs") or []]} if "code" in t
                        else t for t in e["steps"]]
    return out
