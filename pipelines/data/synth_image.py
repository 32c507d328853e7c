"""Visual-search tasks: small coloured targets on a large noisy canvas among grey distractors.

Families (``metadata["family"]``):

- ``color``: the one coloured object's colour; multiple choice (V* style) or free-form.
- ``count``: how many objects of a colour (1 to 6), among objects of other colours.
- ``position``: is one coloured object left/right of (or above/below) another; multiple choice.
- ``measure``: the width in pixels of a coloured bar (numeric, scored with MRA).
- ``text``: the word written in a small coloured box (needs a model that can read).

Targets are drawn without anti-aliasing, so their pixels carry the palette colour exactly, and the
background and distractors are pure greys; objects never touch. Everything a solver needs is
therefore recoverable from pixels alone, by code that only knows what the question says.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

from pipelines.core.records import Task
from pipelines.data.vocab import PALETTE, letter_of, mc_question

SHAPES = ("square", "circle", "triangle")
WORDS = ("cat", "sun", "box", "map", "key", "cup", "pen", "car", "fish", "tree", "star", "moon",
         "bird", "door", "lamp", "ship")


class _Canvas:
    def __init__(self, rng: random.Random) -> None:
        import numpy as np
        from PIL import Image, ImageDraw

        self.rng = rng
        self.w = rng.choice((896, 960, 1024, 1088, 1152))
        self.h = rng.choice((672, 720, 768, 832))
        base = rng.randint(228, 244)
        noise = np.random.default_rng(rng.getrandbits(32)).integers(-7, 8, (self.h, self.w))
        grey = np.clip(base + noise, 0, 255).astype(np.uint8)
        self.image = Image.fromarray(np.stack([grey] * 3, axis=-1))
        self.draw = ImageDraw.Draw(self.image)
        self.boxes: list[tuple[int, int, int, int]] = []
        self.objects: list[dict[str, Any]] = []

    def _free(self, box: tuple[int, int, int, int], margin: int = 10) -> bool:
        x0, y0, x1, y1 = box
        return all(x1 + margin <= a or b + margin <= x0 or y1 + margin <= c or d + margin <= y0
                   for a, c, b, d in self.boxes)

    def place(self, w: int, h: int, where: tuple[int, int, int, int] | None = None) -> tuple[int, int, int, int]:
        """A free box of size w x h (optionally inside ``where``)."""
        lx, ly, hx, hy = where or (8, 8, self.w - 8, self.h - 8)
        for _ in range(2000):
            x = self.rng.randint(lx, max(lx, hx - w))
            y = self.rng.randint(ly, max(ly, hy - h))
            box = (x, y, x + w, y + h)
            if self._free(box):
                self.boxes.append(box)
                return box
        raise RuntimeError("canvas too crowded")

    def shape(self, kind: str, box: tuple[int, int, int, int], fill: tuple[int, int, int]) -> None:
        x0, y0, x1, y1 = box
        if kind == "square":
            self.draw.rectangle((x0, y0, x1 - 1, y1 - 1), fill=fill)
        elif kind == "circle":
            self.draw.ellipse((x0, y0, x1 - 1, y1 - 1), fill=fill)
        else:
            self.draw.polygon([((x0 + x1) // 2, y0), (x1 - 1, y1 - 1), (x0, y1 - 1)], fill=fill)

    def add(self, colour: str | None, size: tuple[int, int] | None = None, kind: str | None = None,
            where: tuple[int, int, int, int] | None = None) -> dict[str, Any]:
        kind = kind or self.rng.choice(SHAPES)
        s = self.rng.randint(14, 30)
        w, h = size or (s, s)
        box = self.place(w, h, where)
        if colour is None:
            g = self.rng.randint(90, 190)
            fill = (g, g, g)
        else:
            fill = PALETTE[colour]
        self.shape(kind, box, fill)
        obj = {"colour": colour or "grey", "shape": kind, "box": list(box)}
        self.objects.append(obj)
        return obj

    def distractors(self, n: int) -> None:
        for _ in range(n):
            self.add(None)

    def save(self, root: Path, name: str) -> str:
        rel = f"media/{name}.png"
        self.image.save(root / rel, optimize=False, compress_level=3)
        return rel


def make_image_task(family: str, rng: random.Random, index: int, split: str, root: Path) -> Task:
    c = _Canvas(rng)
    colours = list(PALETTE)
    tid = f"img-{split}-{index:06d}"
    meta: dict[str, Any] = {"family": family, "width": c.w, "height": c.h}
    options: list[str] = []
    if family == "color":
        colour = rng.choice(colours)
        c.add(colour)
        c.distractors(rng.randint(10, 18))
        if rng.random() < 0.7:
            options = rng.sample([x for x in colours if x != colour], 3) + [colour]
            rng.shuffle(options)
            question = mc_question("What is the colour of the small coloured object?", options)
            answer, answer_type = letter_of(options, colour), "choice"
        else:
            question = "What is the colour of the small coloured object? Answer with the colour name."
            answer, answer_type = colour, "text"
        meta["target"] = colour
    elif family == "count":
        colour = rng.choice(colours)
        k = rng.randint(1, 6)
        for _ in range(k):
            c.add(colour)
        for other in rng.sample([x for x in colours if x != colour], rng.randint(0, 3)):
            c.add(other)
        c.distractors(rng.randint(6, 14))
        question = f"How many {colour} objects are in the image?"
        answer, answer_type = str(k), "number"
        meta.update(target=colour, count=k)
    elif family == "position":
        c1, c2 = rng.sample(colours, 2)
        axis = rng.choice(("horizontal", "vertical"))
        a = c.add(c1)
        # The second object goes wholly inside a region at least ~100 px from the first's
        # centre along the asked axis, so the relation is unambiguous.
        ax, ay = int(_center(a, 0)), int(_center(a, 1))
        if axis == "horizontal":
            regions = [(8, 8, ax - 95, c.h - 8), (ax + 95, 8, c.w - 8, c.h - 8)]
        else:
            regions = [(8, 8, c.w - 8, ay - 95), (8, ay + 95, c.w - 8, c.h - 8)]
        regions = [r for r in regions if r[2] - r[0] >= 60 and r[3] - r[1] >= 60]
        b = c.add(c2, where=rng.choice(regions))
        c.distractors(rng.randint(8, 16))
        if axis == "horizontal":
            truth = "left" if _center(a, 0) < _center(b, 0) else "right"
            options = ["left", "right"]
            stem = f"Is the {c1} object to the left or to the right of the {c2} object?"
        else:
            truth = "above" if _center(a, 1) < _center(b, 1) else "below"
            options = ["above", "below"]
            stem = f"Is the {c1} object above or below the {c2} object?"
        rng.shuffle(options)
        question = mc_question(stem, options)
        answer, answer_type = letter_of(options, truth), "choice"
        meta.update(first=c1, second=c2, axis=axis, relation=truth)
    elif family == "measure":
        colour = rng.choice(colours)
        width = rng.randint(30, 420)
        c.add(colour, size=(width, rng.randint(8, 14)), kind="square")
        for other in rng.sample([x for x in colours if x != colour], rng.randint(0, 2)):
            c.add(other)
        c.distractors(rng.randint(6, 12))
        question = f"How many pixels wide is the {colour} bar?"
        answer, answer_type = str(width), "number"
        meta.update(target=colour, width_px=width, metric="mra")
    elif family == "text":
        from PIL import ImageFont

        colour = rng.choice([x for x in colours if x != "yellow"])
        word = rng.choice(WORDS)
        font = ImageFont.load_default(size=14)
        tw = int(c.draw.textlength(word, font=font))
        box = c.place(tw + 10, 22)
        c.shape("square", box, PALETTE[colour])
        c.draw.text((box[0] + 5, box[1] + 3), word, fill=(255, 255, 255), font=font)
        c.objects.append({"colour": colour, "shape": "box", "box": list(box), "word": word})
        c.distractors(rng.randint(8, 14))
        question = f"What word is written in the {colour} box? Answer with the word."
        answer, answer_type = word, "text"
        meta.update(target=colour, word=word)
    else:
        raise ValueError(f"unknown image family {family}")
    image = c.save(root, tid)
    metric = meta.pop("metric", None)
    metadata = {**meta, "objects": c.objects}
    if metric:
        metadata["metric"] = metric
    return Task(id=tid, data_source="synth/image-search", question=question, images=[image],
                answer=answer, answer_type=answer_type, options=options, metadata=metadata,
                split=split)


def _center(obj: dict[str, Any], axis: int) -> float:
    box = obj["box"]
    return (box[axis] + box[axis + 2]) / 2
