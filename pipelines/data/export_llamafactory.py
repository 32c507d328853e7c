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

Given the agent settings, every image is first brought to its context size by the one resize the
agent loop, RL and evaluation use (``pipelines.agent.prompts.resize_for_context``): an image
already at that size (every image of our own trajectories) is referenced as it is, any other
(imported or distilled data) is resized once into ``out/media_context/``. LLaMA-Factory's
processor then has nothing left to resize, so SFT sees each image exactly as the policy will.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from pipelines.core.media import to_rgb
from pipelines.core.records import Conversation
from pipelines.errors import DataError
from pipelines.fsutil import atomic_write_json, atomic_write_text

ROLE = {"user": "human", "assistant": "gpt"}


CONTEXT_MEDIA = "media_context"


def context_image(path: Path, out: Path, agent_cfg: Any, counts: dict[str, int]) -> Path:
    """``path``, or a copy of it at its context size under ``out/media_context`` (made once)."""
    from PIL import Image, UnidentifiedImageError

    from pipelines.agent.prompts import context_size, resize_for_context

    bounds = (agent_cfg.image_min_pixels, agent_cfg.image_max_pixels, agent_cfg.image_factor)
    try:
        with Image.open(path) as img:
            size = img.size  # the header only
            if context_size(*size, *bounds) == size:
                return path
            name = hashlib.sha1(f"{path.resolve()}:{bounds}".encode()).hexdigest()[:20] + ".png"
            target = out / CONTEXT_MEDIA / name
            if not target.is_file():
                target.parent.mkdir(parents=True, exist_ok=True)
                resized = resize_for_context(to_rgb(img), *bounds)
                tmp = target.with_suffix(".tmp.png")
                resized.save(tmp)
                os.replace(tmp, target)
            counts["images_resized"] = counts.get("images_resized", 0) + 1
            return target
    except (FileNotFoundError, UnidentifiedImageError, OSError) as exc:
        raise DataError(f"image {path} cannot be read ({exc})",
                        hint="fix the media path or drop the conversation") from None


def to_sharegpt(conv: Conversation, source_root: Path, out: Path, agent_cfg: Any = None,
                counts: dict[str, int] | None = None) -> dict:
    """One conversation as a LLaMA-Factory sharegpt row (media paths relative to ``out``; images
    at their context size when ``agent_cfg`` is given)."""
    problems = conv.problems()
    if problems:
        raise DataError(f"conversation '{conv.id}' cannot be exported: {problems[0]}",
                        hint="validate the data with `pyvision data validate`")

    def full(p: str) -> Path:
        return Path(p) if Path(p).is_absolute() else source_root / p

    def rel(path: Path) -> str:
        return os.path.relpath(path.resolve(), out.resolve())

    images = [full(p) for p in conv.images]
    if agent_cfg is not None:
        images = [context_image(p, out, agent_cfg, counts if counts is not None else {})
                  for p in images]
    row = {"conversations": [{"from": ROLE[m.role], "value": m.content} for m in conv.messages],
           "images": [rel(p) for p in images]}
    if conv.videos:
        row["videos"] = [rel(full(p)) for p in conv.videos]
    return row


def export_llamafactory(sources: Iterable[tuple[Path, Iterable[Conversation]]], out: str | Path,
                        name: str = "pyvision_sft", agent_cfg: Any = None) -> dict:
    """Write ``out/<name>.jsonl`` and merge ``name`` into ``out/dataset_info.json``.

    ``sources`` pairs each conversations folder (the root its media paths are relative to) with
    its conversations; ``agent_cfg`` (the recipe's agent settings) brings every image to its
    context size. Returns ``{"dataset_dir", "dataset", "rows", "images", "videos",
    "images_resized"}``.
    """
    out = Path(out)  # made by the first file written: an export that fails early leaves none
    lines, n_img, n_vid, has_video = [], 0, 0, False
    counts: dict[str, int] = {"images_resized": 0}
    for root, convs in sources:
        for conv in convs:
            row = to_sharegpt(conv, Path(root), out, agent_cfg, counts)
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
            "videos": n_vid, **counts}
