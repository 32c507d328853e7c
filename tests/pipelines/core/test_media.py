"""What the model is shown of an image file: ``to_rgb`` (the context image, thumbnails) and the
sandbox zygote's copy of it (``image_clue_N``) agree, and greyscale deeper than 8 bits is scaled,
not clipped."""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image

from pipelines.agent.sandbox._zygote import open_image
from pipelines.core.media import grey_to_8bit, to_rgb


def _png(img: Image.Image, **kw) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="PNG", **kw)
    return buf.getvalue()


def _gradient16() -> np.ndarray:
    """Every 16-bit value once, 256 rows of 256."""
    return np.arange(65536, dtype=np.uint16).reshape(256, 256)


def _reopen(data: bytes) -> Image.Image:
    img = Image.open(io.BytesIO(data))
    img.load()
    return img


def test_a_16_bit_png_is_scaled_to_8_bits_not_clipped_to_white():
    # convert("RGB") clipped every value above 255: the gradient came out 99.6% white.
    img = _reopen(_png(Image.fromarray(_gradient16())))
    assert img.mode == "I;16"
    rgb = np.asarray(to_rgb(img))
    assert rgb.shape == (256, 256, 3) and (rgb[..., 0] == rgb[..., 1]).all()
    assert (rgb[..., 0] == np.arange(256, dtype=np.uint8)[:, None]).all()  # row r: v >> 8 == r
    assert rgb.mean() == pytest.approx(127.5)
    # A 16-bit image made from an 8-bit one (v * 257, v << 8) gives back its 8-bit values.
    eight = np.arange(256, dtype=np.uint16).reshape(16, 16)
    for wide in (eight * 257, eight << 8):
        back = grey_to_8bit(_reopen(_png(Image.fromarray(wide))))
        assert back.mode == "L" and (np.asarray(back) == eight).all()


@pytest.mark.parametrize("mode", ["I;16B", "I"])
def test_other_16_bit_layouts_scale_the_same(mode):
    a = _gradient16()
    img = Image.fromarray(a.astype(">u2")) if mode == "I;16B" else Image.fromarray(a.astype(np.int32))
    assert img.mode == mode
    assert (np.asarray(to_rgb(img))[..., 0] == (a >> 8)).all()
    clipped = Image.fromarray(np.array([[-5, 70000, 65535, 256]], dtype=np.int32))
    assert np.asarray(grey_to_8bit(clipped)).tolist() == [[0, 255, 255, 1]]


def test_float_images_read_0_to_1_as_the_full_range_and_else_as_pillow_does():
    unit = np.array([[0.0, 0.5, 1.0, np.nan]], dtype=np.float32)
    assert np.asarray(grey_to_8bit(Image.fromarray(unit))).tolist() == [[0, 128, 255, 0]]
    eight = np.array([[0.0, 100.0, 255.0, 300.0]], dtype=np.float32)
    img = Image.fromarray(eight)
    assert np.asarray(grey_to_8bit(img)).tolist() == np.asarray(img.convert("L")).tolist()
    assert np.asarray(to_rgb(Image.fromarray(unit)))[0, 1].tolist() == [128, 128, 128]


def test_a_16_bit_transparency_key_goes_on_white():
    a = np.array([[0, 1000, 65535]], dtype=np.uint16)
    img = _reopen(_png(Image.fromarray(a), transparency=1000))
    assert img.mode == "I;16" and img.info["transparency"] == 1000
    assert np.asarray(to_rgb(img))[0, :, 0].tolist() == [0, 255, 255]


def _eight_bit_images() -> dict[str, Image.Image]:
    rng = np.random.default_rng(0)
    rgba = Image.fromarray(rng.integers(0, 256, (24, 32, 4), dtype=np.uint8), "RGBA")
    p = rgba.convert("RGB").convert("P", palette=Image.Palette.ADAPTIVE, colors=16)
    p_transparent = p.copy()
    p_transparent.info["transparency"] = 3
    return {"RGB": rgba.convert("RGB"), "RGBA": rgba, "L": rgba.convert("L"),
            "LA": rgba.convert("LA"), "P": p, "P-transparent": p_transparent,
            "1": rgba.convert("1"), "CMYK": rgba.convert("RGB").convert("CMYK")}


@pytest.mark.parametrize("name", list(_eight_bit_images()))
def test_8_bit_images_are_converted_byte_for_byte_as_before(name):
    # The demo's trained models saw these pixels: the 16-bit fix must not move one of them.
    img = _eight_bit_images()[name]
    if img.mode in ("RGBA", "LA", "PA") or "transparency" in img.info:
        rgba = img.convert("RGBA")
        before = Image.new("RGB", rgba.size, (255, 255, 255))
        before.paste(rgba, mask=rgba.getchannel("A"))
    else:
        before = img.convert("RGB")
    assert to_rgb(img).tobytes() == before.tobytes()


def _files() -> dict[str, bytes]:
    files = {name: _png(img) for name, img in _eight_bit_images().items() if name != "CMYK"}
    files["P-transparent"] = _png(_eight_bit_images()["P"], transparency=3)
    files["I;16"] = _png(Image.fromarray(_gradient16()))
    files["I;16-transparent"] = _png(Image.fromarray(_gradient16()), transparency=4096)
    jpeg = io.BytesIO()
    _eight_bit_images()["CMYK"].save(jpeg, format="JPEG")
    files["JPEG-CMYK"] = jpeg.getvalue()
    for name, a in (("I", _gradient16().astype(np.int32)),
                    ("F", _gradient16().astype(np.float32) / 65535)):
        buf = io.BytesIO()
        Image.fromarray(a).save(buf, format="TIFF")
        files[name] = buf.getvalue()
    return files


@pytest.mark.parametrize("name", list(_files()))
def test_the_sandbox_copy_shows_the_pixels_the_context_image_shows(name):
    # The zygote imports nothing from the project and keeps its own copy of to_rgb: the code's
    # image_clue_0 and the model's context image must hold the same pixels.
    data = _files()[name]
    context = to_rgb(_reopen(data))
    clue = open_image(data, Image, np)
    assert clue.mode in ("RGB", "L")  # "L" is kept as "L" in the sandbox
    assert clue.size == context.size and clue.convert("RGB").tobytes() == context.tobytes()
    if name in ("I;16", "I", "F"):
        assert np.asarray(clue).mean() == pytest.approx(127.5, abs=0.01)
