"""Prompt templates: versioned files, the single source of every trajectory's first turn.

Variants (``prompts/<variant>.v<N>.txt``):

- ``image``: the image is in the model's context (``<image_clue_0>`` tags around it, as in the
  released PyVision SFT data) and in the runtime as ``image_clue_0``; the prompt states its size.
- ``image_noinit``: the image exists only in the runtime; the model must show it to itself.
- ``video``: on-demand context construction: no frames in the context; the runtime holds
  ``video_clue_0`` (a decord VideoReader); the prompt gives frame size, frame count and fps.
- ``video_frames``: the uniform-sampling baseline: frames in the context, the video in the runtime.

A template's version and the sha256 of its text are recorded with every trajectory and score.
Changing a template means adding ``<variant>.v<N+1>.txt`` and a CHANGELOG line, never editing a
released version in place.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

from pipelines.agent.protocol import merge_text_parts
from pipelines.agent.sandbox._zygote import smart_resize
from pipelines.config.agent import AgentConfig
from pipelines.core.records import Task
from pipelines.errors import DataError

PROMPTS_DIR = Path(__file__).with_name("prompts")
CURRENT = {"image": 1, "image_noinit": 1, "video": 1, "video_frames": 1}


@dataclass(frozen=True)
class PromptInfo:
    variant: str
    version: str  # "image@v1"
    sha256: str


@cache
def load_template(variant: str, version: int | None = None) -> tuple[str, PromptInfo]:
    v = version or CURRENT[variant]
    path = PROMPTS_DIR / f"{variant}.v{v}.txt"
    text = path.read_text(encoding="utf-8")
    return text, PromptInfo(variant, f"{variant}@v{v}", hashlib.sha256(text.encode()).hexdigest())


def variant_for(task: Task, agent_cfg: AgentConfig, override: str | None = None) -> str:
    if override:
        return override
    if task.video:
        return "video" if agent_cfg.video_context == "on_demand" else "video_frames"
    return "image" if task.images else "image_noinit"


def context_size(width: int, height: int, min_pixels: int, max_pixels: int,
                 factor: int = 28) -> tuple[int, int]:
    """(width, height) an image of ``width`` x ``height`` has in the model's context: the vision
    processor's rule (sides multiples of ``factor`` within the pixel budget)."""
    h, w = smart_resize(height, width, factor=factor, min_pixels=min_pixels,
                        max_pixels=max_pixels)
    return w, h


def visual_tokens(width: int, height: int, min_pixels: int, max_pixels: int,
                  factor: int = 28) -> int:
    """Visual tokens an image of ``width`` x ``height`` costs: one per ``factor`` x ``factor``
    square of its context size."""
    w, h = context_size(width, height, min_pixels, max_pixels, factor)
    return (w // factor) * (h // factor)


def resize_for_context(image: Any, min_pixels: int, max_pixels: int, factor: int = 28) -> Any:
    """``image`` at its context size, the one resize every image gets before any processor sees
    it: prompt images and frames (here), interpreter images (the agent loop, and the sandbox,
    which returns them at this size already), SFT export (``pipelines/data/export_llamafactory``)
    and every token context (``ChatTokens.encode``). A processor that then ignores
    ``min_pixels``/``max_pixels`` has nothing left to resize, and ``ChatTokens`` checks the visual
    token count it produced per image."""
    size = context_size(image.width, image.height, min_pixels, max_pixels, factor)
    return image if size == image.size else image.resize(size)


def video_info(path: Path, *, quiet: bool = False) -> dict[str, Any]:
    """Frames, fps and size of a video, and its reader; a DataError when it does not decode.
    ``quiet`` as :func:`pipelines.inputs.open_video`'s (input checks only)."""
    try:
        from pipelines.inputs import open_video

        reader = open_video(path, quiet=quiet)
        height, width = reader[0].shape[:2]
        return {"frames": len(reader), "fps": float(reader.get_avg_fps()), "width": int(width),
                "height": int(height), "reader": reader}
    except Exception as exc:  # noqa: BLE001 - any decoder failure means an unusable video
        raise DataError(f"video cannot be decoded: {path} ({exc})",
                        hint="re-encode it (e.g. H.264 mp4) or drop the task") from None


def check_video(path: Path | None) -> None:
    """A command-line ``--video`` that exists decodes (a DataError if not), checked before
    anything runs and without decord's own log line beside the error. A missing file is left to
    the command's own check, which says which option it came from."""
    if path is not None and path.is_file():
        video_info(path, quiet=True)


def build_initial_messages(task: Task, media_root: Path, variant: str, agent_cfg: AgentConfig
                           ) -> tuple[list[dict], PromptInfo, dict[str, Any]]:
    """The first user turn for ``task`` (content parts; images as PIL), its prompt info, and the
    media the sandbox must hold (``{"images": {name: path}, "videos": {name: path}}``)."""
    from PIL import Image, UnidentifiedImageError

    from pipelines.core.media import to_rgb

    template, info = load_template(variant)
    runtime: dict[str, dict[str, Path]] = {"images": {}, "videos": {}}
    context_images: list[Any] = []
    media_lines: list[str] = []
    if variant in ("image", "image_noinit"):
        for i, path in enumerate(task.image_paths(media_root)):
            try:
                with Image.open(path) as img:
                    img.load()
                    full = to_rgb(img)
            except (Image.DecompressionBombError, UnidentifiedImageError, OSError) as exc:
                raise DataError(f"task {task.id}: image {path} cannot be read ({exc})",
                                hint="fix the media path or drop the task") from None
            runtime["images"][f"image_clue_{i}"] = path
            media_lines.append(f"Image Width: {full.width}; Image Height: {full.height}"
                               if len(task.images) == 1 else
                               f"image_clue_{i}: Image Width: {full.width}; Image Height: {full.height}")
            if variant == "image":
                context_images.append(resize_for_context(full, agent_cfg.image_min_pixels,
                                                         agent_cfg.image_max_pixels,
                                                         agent_cfg.image_factor))
    else:
        vpath = task.video_path(media_root)
        if vpath is None or not vpath.is_file():
            raise DataError(f"task {task.id}: video {vpath} not found",
                            hint="fix the media path or drop the task")
        meta = video_info(vpath)
        runtime["videos"]["video_clue_0"] = vpath
        media_lines.append(f"Frame Width: {meta['width']}; Frame Height: {meta['height']}; "
                           f"Frame Count: {meta['frames']}; FPS: {meta['fps']:.2f}")
        if variant == "video_frames":
            import numpy as np

            n = min(agent_cfg.uniform_frames, meta["frames"])
            idx = np.linspace(0, meta["frames"] - 1, n).round().astype(int).tolist()
            frames = meta["reader"].get_batch(idx).asnumpy()
            context_images = [resize_for_context(Image.fromarray(f), agent_cfg.image_min_pixels,
                                                 agent_cfg.image_max_pixels, agent_cfg.image_factor)
                              for f in frames]
    text = template.replace("{media_info}", "\n".join(media_lines)).replace(
        "{question}", task.question.strip())
    parts: list[dict] = []
    if "{images}" in text:
        before, after = text.split("{images}", 1)
        parts.append({"type": "text", "text": before})
        for i, img in enumerate(context_images):
            parts.append({"type": "text", "text": f"<image_clue_{i}>"})
            parts.append({"type": "image", "image": img})
            parts.append({"type": "text", "text": f"</image_clue_{i}>"})
        parts.append({"type": "text", "text": after})
    else:
        parts.append({"type": "text", "text": text})
    parts = [p for p in merge_text_parts(parts) if p.get("type") != "text" or p["text"]]
    return [{"role": "user", "content": parts}], info, runtime
