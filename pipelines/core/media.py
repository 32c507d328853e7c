"""Thumbnails of what a trajectory shows, kept in the store for the report and `pyvision show`.

Trajectories are stored as JSON without pixels. What a reader needs to see is small: the task's
input images and the images the interpreter returned (crops, plots, the video frames the code
sampled). Each is kept as a WebP thumbnail (longest side ``report.thumbnail_px``) in the store's
``media`` table, named by the SHA-256 of its bytes:

- in the store rather than as files in the run directory, because the store is already where
  every result lives (a report renders from the store alone, `--store` elsewhere included), a
  sample and its thumbnails are written in one transaction (never one without the other), and an
  input image shared by every model and run is stored once;
- WebP at a fixed quality and method, so the same image always gives the same bytes and the
  same name, and the report built from them is byte-for-byte repeatable. A 512-pixel thumbnail
  of a synthetic canvas is about 1-2 KB, of a photograph 20-40 KB.

A trajectory's ``media`` record is ``{"inputs": [sha256 | None, ...], "images": [sha256, ...]}``:
one entry per input image of the task (None when it could not be read) and one per image of the
trajectory (``Trajectory.images``, which ``Turn.image_indices`` index). For the image prompt the
images placed in the prompt are the input images, so they reuse the inputs' thumbnails. A video
task with on-demand context has no input image: the frames its code sampled are interpreter
images. With uniform frames the prompt's frames are its inputs.
"""

from __future__ import annotations

import hashlib
import io
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MIME = "image/webp"
EXTENSION = ".webp"
_QUALITY = 80
_METHOD = 2  # libwebp effort: 2 is ~3x faster than the default 4 for ~5% larger files
_CACHE_SIZE = 256
@dataclass(frozen=True)
class MediaBlob:
    """One stored thumbnail, named by the SHA-256 of its bytes."""

    sha256: str
    mime: str
    width: int
    height: int
    data: bytes


_cache: OrderedDict[tuple[str, int, int, int], MediaBlob | None] = OrderedDict()
_cache_lock = threading.Lock()


def to_rgb(image: Any) -> Any:
    """An RGB copy of a PIL image as Qwen-VL's own preprocessing (``qwen_vl_utils.to_rgb``) makes
    it: transparent pixels on white. ``convert("RGB")`` keeps the colour under the transparency,
    usually black, so a diagram drawn on a transparent background came out black."""
    from PIL import Image

    if image.mode in ("RGBA", "LA", "PA", "RGBa", "La") or "transparency" in image.info:
        rgba = image.convert("RGBA")
        out = Image.new("RGB", rgba.size, (255, 255, 255))
        out.paste(rgba, mask=rgba.getchannel("A"))
        return out
    return image.convert("RGB")


def thumbnail(image: Any, max_side: int) -> MediaBlob:
    """A WebP thumbnail of a PIL image, at most ``max_side`` pixels on its longest side."""
    from PIL import Image

    img = image if image.mode == "RGB" else to_rgb(image)
    if max(img.size) > max_side:
        img = img.copy()
        img.thumbnail((max_side, max_side), Image.Resampling.LANCZOS)
    buf = io.BytesIO()
    img.save(buf, format="WEBP", quality=_QUALITY, method=_METHOD)
    data = buf.getvalue()
    return MediaBlob(hashlib.sha256(data).hexdigest(), MIME, img.width, img.height, data)


def thumbnail_file(path: str | Path, max_side: int) -> MediaBlob | None:
    """The thumbnail of an image file (None when it cannot be read). Remembered per file, size
    and modification time, so the base, SFT and RL models of one run decode each input once."""
    from PIL import Image, UnidentifiedImageError

    p = Path(path)
    try:
        st = p.stat()
    except OSError:
        return None
    key = (str(p), st.st_size, st.st_mtime_ns, max_side)
    with _cache_lock:
        if key in _cache:
            _cache.move_to_end(key)
            return _cache[key]
    try:
        with Image.open(p) as img:
            img.draft("RGB", (max_side, max_side))  # JPEG: decode at a reduced scale (fast)
            blob = thumbnail(to_rgb(img), max_side)
    except (OSError, UnidentifiedImageError, ValueError):
        blob = None
    with _cache_lock:
        _cache[key] = blob
        while len(_cache) > _CACHE_SIZE:
            _cache.popitem(last=False)
    return blob


def trajectory_media(task: Any, root: str | Path, traj: Any, max_side: int
                     ) -> tuple[dict[str, list[str | None]] | None, list[MediaBlob]]:
    """The ``media`` record of ``traj`` (see the module docstring) and the thumbnails it names;
    ``(None, [])`` when ``max_side`` is 0 (thumbnails switched off)."""
    if max_side <= 0:
        return None, []
    blobs: dict[str, MediaBlob] = {}

    def keep(blob: MediaBlob | None) -> str | None:
        if blob is None:
            return None
        blobs.setdefault(blob.sha256, blob)
        return blob.sha256

    inputs: list[str | None] = []
    if not task.video:
        inputs = [keep(thumbnail_file(p, max_side)) for p in task.image_paths(Path(root))]
    in_prompt = [p["index"] for p in traj.prompt if p.get("type") == "image"]
    images: list[str | None] = [None] * len(traj.images)
    if traj.variant == "image" and len(in_prompt) == len(inputs):
        for index, sha in zip(in_prompt, inputs):
            images[index] = sha
    for i, img in enumerate(traj.images):
        if images[i] is None:
            images[i] = keep(thumbnail(img, max_side))
    if task.video and in_prompt:  # uniform frames in the prompt: those are what it was shown
        inputs = [images[i] for i in in_prompt]
    return {"inputs": inputs, "images": images}, list(blobs.values())
