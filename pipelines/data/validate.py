"""Validation of a tasks or conversations file: schema, answers, placeholders, and media that open.

Every read in the project validates rows (see ``records.read_tasks``); this adds the expensive
check that each media file actually decodes (a truncated PNG or an mp4 without frames), for
``pyvision data validate`` and before long runs.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from pipelines.core.records import (
    CONVERSATIONS_FILE,
    TASKS_FILE,
    Task,
    read_conversations,
    read_tasks,
)
from pipelines.errors import DataError


def media_problem(path: Path) -> str | None:
    """Why ``path`` cannot be used as an image or video, or None when it decodes."""
    if not path.is_file():
        return f"missing media file {path}"
    if path.suffix.lower() in (".mp4", ".webm", ".mkv", ".avi", ".mov"):
        try:
            from pipelines.inputs import open_video

            if len(open_video(path, quiet=True)) == 0:
                return f"video without frames {path}"
        except Exception as exc:  # noqa: BLE001 - any decoder failure is a finding
            return f"undecodable video {path} ({str(exc).splitlines()[0][:80]})"
        return None
    from PIL import Image

    try:
        with Image.open(path) as img:
            img.load()
    except Exception as exc:  # noqa: BLE001
        return f"corrupt image {path} ({exc})"
    return None


def row_media_problems(media: Sequence[Sequence[Path]]) -> list[str | None]:
    """For each row's media files, the first one's problem (:func:`media_problem`) or None, in
    row order. Files are opened on a few threads: decoding releases the GIL."""
    import os
    from concurrent.futures import ThreadPoolExecutor

    def first(paths: Sequence[Path]) -> str | None:
        return next((q for q in map(media_problem, paths) if q), None)

    with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
        return list(pool.map(first, media))


def check_media_decode(task_sets: Sequence[tuple[Sequence[Task], Path, str]], what: str) -> None:
    """Raise a :class:`DataError` for the first task (in file order) whose image or video does
    not decode, before a long run starts on it (the RL stage would otherwise meet it mid-step).
    ``task_sets`` are the tasks already read from each file: (tasks, media root, file)."""
    rows = [(f"{file}: row '{t.id}'", t.media_paths(root))
            for tasks, root, file in task_sets for t in tasks]
    for (where, _), problem in zip(rows, row_media_problems([m for _, m in rows])):
        if problem:
            raise DataError(f"{what}: {where}: {problem}",
                            hint="replace the file or drop the row (`pyvision data validate "
                                 "DIR` lists every bad row)")


def skipped_rows(skipped: Mapping[str, int], problems: Sequence[str]) -> str:
    """One line on the rows a validating read skipped (a ReadReport's ``skipped`` and
    ``problems``): how many, by reason, and the first with its place, e.g. ``skipped 3 rows:
    2 missing_media, 1 malformed_json; first: data/tasks.jsonl:2: missing media file ...``."""
    n = sum(skipped.values())
    reasons = ", ".join(f"{count} {reason}" for reason, count in
                        sorted(skipped.items(), key=lambda item: (-item[1], item[0])))
    first = f"; first: {problems[0]}" if problems else ""
    return f"skipped {n} row{'' if n == 1 else 's'}: {reasons}{first}"


def validate_path(path: str | Path, *, strict: bool = False) -> dict[str, Any]:
    p = Path(path)
    is_conv = (p.is_dir() and (p / CONVERSATIONS_FILE).exists() and not (p / TASKS_FILE).exists()) \
        or p.name == CONVERSATIONS_FILE
    rows, report = (read_conversations(p, strict=strict) if is_conv else read_tasks(p, strict=strict))
    root = p if p.is_dir() else p.parent
    by: Counter[str] = Counter()
    good = []
    media = [[root / m for m in [*row.images, *row.videos]] if is_conv else row.media_paths(root)
             for row in rows]
    for row, problem in zip(rows, row_media_problems(media)):
        if problem:
            where = f"{report.path}: row '{row.id}'"
            if strict:
                raise DataError(f"{where}: {problem}", hint="replace the file or drop the row")
            report.skip("corrupt_media", where, problem)
            continue
        good.append(row)
        if is_conv:
            by[f"source: {row.data_source}"] += 1
        else:
            by[f"family: {row.metadata.get('family', row.data_source)}"] += 1
            by[f"answer type: {row.answer_type}"] += 1
    report.kept = len(good)
    return {**report.as_dict(), "kind": "conversations" if is_conv else "tasks", "by": dict(by)}
