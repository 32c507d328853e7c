"""Export conversations to LLaMA-Factory's sharegpt format with a ``dataset_info.json`` entry.

Layout written to ``out``::

    out/dataset_info.json      {"<name>": {"file_name": "<name>.jsonl", "formatting": "sharegpt",
                                           "columns": {"messages": "conversations",
                                                       "images": "images", "videos": "videos"}}}
    out/<name>.jsonl           {"conversations": [{"from": "human"|"gpt", "value": ...}, ...],
                                "images": [...], "videos": [...]}

User turns (the prompt and every ``<interpreter>`` observation) become ``human`` turns and model
turns ``gpt`` turns, so they sit at the odd/even positions LLaMA-Factory requires; each image is one
``<image>`` placeholder, in order. Media paths are written relative to ``out`` (LLaMA-Factory joins
them with ``media_dir``, which ``pyvision sft`` sets to ``out``), so the export and its sources move
together.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path

from pipelines.core.records import Conversation
from pipelines.errors import DataError
from pipelines.fsutil import atomic_write_json, atomic_write_text

ROLE = {"user": "human", "assistant": "gpt"}


def to_sharegpt(conv: Conversation, source_root: Path, out: Path) -> dict:
    """One conversation as a LLaMA-Factory sharegpt row (media paths relative to ``out``)."""
    problems = conv.problems()
    if problems:
        raise DataError(f"conversation '{conv.id}' cannot be exported: {problems[0]}",
                        hint="validate the data with `pyvision data validate`")

    def rel(p: str) -> str:
        full = Path(p) if Path(p).is_absolute() else source_root / p
        return os.path.relpath(full.resolve(), out.resolve())

    row = {"conversations": [{"from": ROLE[m.role], "value": m.content} for m in conv.messages],
           "images": [rel(p) for p in conv.images]}
    if conv.videos:
        row["videos"] = [rel(p) for p in conv.videos]
    return row


def export_llamafactory(sources: Iterable[tuple[Path, Iterable[Conversation]]], out: str | Path,
                        name: str = "pyvision_sft") -> dict:
    """Write ``out/<name>.jsonl`` and merge ``name`` into ``out/dataset_info.json``.

    ``sources`` pairs each conversations folder (the root its media paths are relative to) with
    its conversations. Returns ``{"dataset_dir", "dataset", "rows", "images", "videos"}``.
    """
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    lines, n_img, n_vid, has_video = [], 0, 0, False
    for root, convs in sources:
        for conv in convs:
            row = to_sharegpt(conv, Path(root), out)
            n_img += len(row["images"])
            n_vid += len(row.get("videos", []))
            has_video = has_video or bool(row.get("videos"))
            lines.append(json.dumps(row, ensure_ascii=False))
    if not lines:
        raise DataError(f"nothing to export into {out}: no conversations",
                        hint="generate trajectories first (`pyvision data trajectories`)")
    atomic_write_text(out / f"{name}.jsonl", "\n".join(lines) + "\n")
    info_path = out / "dataset_info.json"
    info = json.loads(info_path.read_text(encoding="utf-8")) if info_path.is_file() else {}
    columns = {"messages": "conversations", "images": "images"}
    if has_video:
        columns["videos"] = "videos"
    info[name] = {"file_name": f"{name}.jsonl", "formatting": "sharegpt", "columns": columns}
    atomic_write_json(info_path, info)
    return {"dataset_dir": str(out), "dataset": name, "rows": len(lines), "images": n_img,
            "videos": n_vid}
