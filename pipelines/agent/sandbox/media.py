"""Media in and out of the sandbox: task images and videos checked on the host and sent as bytes
(decoded inside the sandbox), and shown images accepted back only as raw RGB pixels of a bounded
size (nothing is decoded on the host).
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

from pipelines.core.media import to_rgb
from pipelines.errors import DataError

# Bounds on a shown image coming back: the bytes of its frame, its pixels.
MAX_IMAGE_BYTES = 32 * 1024 * 1024
MAX_IMAGE_PIXELS = 64 * 1024 * 1024
# Larger images are downscaled inside the sandbox before they are shown (with a note in the
# output): even incompressible RGBA pixels then fit in MAX_IMAGE_BYTES, so showing a huge image
# can neither exceed the frame limit nor cost the runtime its state.
SHOWN_IMAGE_MAX_PIXELS = 2560 * 2560


def image_media(name: str, value: Any) -> tuple[dict, bytes]:
    """(spec, bytes) for an image: raw pixels for in-memory images (no encoding cost), the file's
    own bytes otherwise (decoded inside the sandbox)."""
    from PIL import Image

    if isinstance(value, Image.Image):
        # Other modes as a task image file is converted (16-bit greyscale scaled, not clipped).
        img = value if value.mode in ("RGB", "RGBA", "L") else to_rgb(value)
        return ({"name": name, "kind": "image_raw", "mode": img.mode, "size": list(img.size)},
                img.tobytes())
    return {"name": name, "kind": "image"}, _image_bytes(name, value)


def _image_bytes(name: str, value: Any) -> bytes:
    """The bytes of an image file that PIL can verify."""
    from PIL import Image, UnidentifiedImageError

    path = Path(value)
    if not path.is_file():
        raise DataError(f"image for {name} not found: {path}", hint="check the task's media paths")
    data = path.read_bytes()
    stream = None
    try:
        stream = io.BytesIO(data)
        with Image.open(stream) as img:
            img.verify()
    except (UnidentifiedImageError, Image.DecompressionBombError, OSError, SyntaxError,
            ValueError) as exc:
        # PIL names the stream it read ("<_io.BytesIO object at 0x...>"): the file is named here.
        reason = str(exc).replace(f" {stream!r}", "") if stream is not None else str(exc)
        raise DataError(f"image for {name} is corrupt or not an image: {path} ({reason})",
                        hint="replace the file or drop the task") from None
    return data


def video_bytes(name: str, value: Any) -> tuple[bytes, str]:
    """(bytes, suffix) of a video file that decord can open."""
    path = Path(value)
    if not path.is_file():
        raise DataError(f"video for {name} not found: {path}", hint="check the task's media paths")
    try:
        from pipelines.inputs import open_video

        reader = open_video(path)
        if len(reader) == 0:
            raise ValueError("no frames")
        del reader
    except Exception as exc:  # noqa: BLE001 - any decoder failure means an unusable video
        raise DataError(f"video for {name} cannot be decoded: {path} ({exc})",
                        hint="re-encode it (e.g. H.264 mp4) or drop the task") from None
    return path.read_bytes(), path.suffix or ".mp4"


def frame_from_pixels(spec: Any, blob: bytes) -> Any:
    """A shown image from its raw pixels, or None when the sandbox sent anything but RGB pixels
    of a bounded size whose byte count matches it (nothing is parsed or decoded)."""
    from PIL import Image

    try:
        w, h = (int(v) for v in spec["size"])
        ok = spec["mode"] == "RGB" and w > 0 and h > 0 and w * h <= MAX_IMAGE_PIXELS \
            and len(blob) == w * h * 3
    except (TypeError, KeyError, ValueError, OverflowError):  # JSON's Infinity: OverflowError
        return None
    return Image.frombytes("RGB", (w, h), blob) if ok else None
