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
    usually black, so a diagram drawn on a transparent background came out black. A greyscale
    image of more than 8 bits (a 16-bit PNG) is scaled to 8 bits first (:func:`grey_to_8bit`):
    ``convert("RGB")`` clips its values at 255, so a 16-bit image came out nearly all white.

    The sandbox builds ``image_clue_N`` with its own copy of this (``open_image`` in
    ``pipelines/agent/sandbox/_zygote.py``, which imports nothing from the project): the two
    must match, so that the code sees the pixels the model was shown
    (``tests/pipelines/core/test_media.py`` checks that they do)."""
    from PIL import Image

    if image.mode in ("I", "F") or image.mode.startswith("I;16"):
        return grey_to_8bit(image).convert("RGB")
    if image.mode in ("RGBA", "LA", "PA", "RGBa", "La") or "transparency" in image.info:
        rgba = image.convert("RGBA")
        out = Image.new("RGB", rgba.size, (255, 255, 255))
        out.paste(rgba, mask=rgba.getchannel("A"))
        return out
    return image.convert("RGB")


def grey_to_8bit(image: Any) -> Any:
    """An "L" copy of a greyscale PIL image of more than 8 bits (modes "I;16*", "I", "F").

    - "I;16" (16-bit PNG/TIFF) and "I" (32-bit, taken to hold 16-bit values as Pillow's readers
      of 16-bit greyscale give them; clipped to 0..65535): ``v >> 8``, i.e. floor(v / 256).
      Every 8-bit level gets exactly 256 of the 16-bit values, 65535 is 255, and a 16-bit image
      made from an 8-bit one (``v * 257`` or ``v << 8``) gives back exactly its 8-bit values.
    - "F": values in [0, 1] (every finite one) are read as a 0..1 scale, ``round(v * 255)``;
      otherwise as Pillow's own 0..255 scale (the one ``convert("F")`` of an "L" image gives),
      converted as Pillow converts it (clipped). NaN is 0, +inf the top, -inf 0.
    - A ``transparency`` key (a 16-bit grey value) is put on white, as :func:`to_rgb` does.

    Must match ``grey_to_8bit`` in ``pipelines/agent/sandbox/_zygote.py``."""
    import numpy as np
    from PIL import Image

    a = np.asarray(image)
    if image.mode == "F":
        finite = a[np.isfinite(a)]
        if finite.size and finite.min() >= 0.0 and finite.max() <= 1.0:
            unit = np.nan_to_num(a.astype(np.float64), nan=0.0, posinf=1.0, neginf=0.0)
            return Image.fromarray(np.rint(unit * 255.0).astype(np.uint8))
        return Image.fromarray(np.nan_to_num(a, nan=0.0).astype(np.float32)).convert("L")
    wide = np.clip(a.astype(np.int64), 0, 65535)
    out = (wide >> 8).astype(np.uint8)
    key = image.info.get("transparency")
    if isinstance(key, int) and not isinstance(key, bool):
        out[a == key] = 255
    return Image.fromarray(out)


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
