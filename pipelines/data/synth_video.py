"""Short videos with moving objects (VSI-Bench style questions), written as H.264 mp4 with PyAV.

Families (``metadata["family"]``):

- ``count``: how many objects of a colour are in the video (numeric, MRA, like VSI's
  object_counting).
- ``distance``: how many pixels an object moves between the first and the last frame (numeric,
  MRA, like VSI's distance questions).
- ``order``: which object appears first (multiple choice, like VSI's appearance_order).

Each object moves in a horizontal lane of its own, so objects never overlap and a colour mask of
any frame separates them. Clips are lossless RGB H.264 (``libx264rgb`` at qp 0), encoded on one
thread: the decoded frames are exactly the drawn ones (the palette's colours, pixel for pixel), and
the same seed gives the same bytes. (Lossy ``libx264`` at crf 12 moved colours by a few levels and
gave different bytes for a few percent of identical clips.)
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

from pipelines.core.records import Task
from pipelines.data.vocab import PALETTE, letter_of, mc_question

WIDTH, HEIGHT, FPS = 192, 144, 8
LANE_H = 24  # 6 lanes


def _draw(frame: Any, obj: dict[str, Any], x: float) -> None:
    y0 = obj["lane"] * LANE_H + (LANE_H - obj["size"]) // 2
    xi = int(round(x))  # noqa: RUF046 - x may be a numpy float
    s = obj["size"]
    frame[y0: y0 + s, xi: xi + s] = PALETTE[obj["colour"]]


def _positions(obj: dict[str, Any], n_frames: int) -> list[float]:
    """Left edge per frame: linear motion from x0 with speed v, bouncing inside the frame."""
    lo, hi = 2.0, float(WIDTH - obj["size"] - 2)
    x, v, out = obj["x0"], obj["v"], []
    for _ in range(n_frames):
        out.append(x)
        x += v
        if x < lo or x > hi:
            v = -v
            x = min(max(x, lo), hi)
    return out


def _write(path: Path, objects: list[dict[str, Any]], n_frames: int, background: int) -> list[list[float]]:
    import av
    import numpy as np

    tracks = [_positions(o, n_frames) for o in objects]
    with av.open(str(path), "w") as container:
        stream = container.add_stream("libx264rgb", rate=FPS)
        stream.width, stream.height, stream.pix_fmt = WIDTH, HEIGHT, "rgb24"
        stream.options = {"qp": "0", "preset": "veryfast"}
        stream.codec_context.thread_count = 1
        for t in range(n_frames):
            frame = np.full((HEIGHT, WIDTH, 3), background, dtype=np.uint8)
            for obj, track in zip(objects, tracks):
                if t >= obj.get("appear", 0):
                    _draw(frame, obj, track[t])
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return tracks


def make_video_task(family: str, rng: random.Random, index: int, split: str, root: Path) -> Task:
    colours = list(PALETTE)
    n_frames = rng.choice((20, 24, 28, 32))
    background = rng.choice((24, 32, 40))
    lanes = list(range(HEIGHT // LANE_H))
    rng.shuffle(lanes)

    def obj(colour: str, **kw: Any) -> dict[str, Any]:
        size = kw.pop("size", rng.randint(10, 14))
        speed = rng.uniform(1.0, 3.5) * rng.choice((-1, 1))
        return {"colour": colour, "lane": lanes.pop(), "size": size,
                "x0": float(rng.randint(4, WIDTH - size - 4)), "v": round(speed, 2), **kw}

    tid = f"vid-{split}-{index:06d}"
    meta: dict[str, Any] = {"family": family, "frames": n_frames, "fps": FPS}
    options: list[str] = []
    if family == "count":
        colour = rng.choice(colours)
        k = rng.randint(1, 4)
        objects = [obj(colour) for _ in range(k)]
        objects += [obj(c) for c in rng.sample([x for x in colours if x != colour], rng.randint(0, 2))]
        question = f"How many {colour} objects are in the video?"
        answer, answer_type = str(k), "number"
        meta.update(target=colour, count=k, metric="mra")
    elif family == "distance":
        colour = rng.choice(colours)
        size = rng.randint(10, 14)
        span = WIDTH - size - 8
        # Monotonic motion (no bounce) so start and end frames fix the distance.
        dist = rng.randint(24, span - 8)
        x0 = float(rng.randint(4, span - dist))
        direction = rng.choice((-1, 1))
        if direction < 0:
            x0 += dist
        target = {"colour": colour, "lane": lanes.pop(), "size": size, "x0": x0,
                  "v": round(direction * dist / (n_frames - 1), 6)}
        objects = [target] + [obj(c) for c in rng.sample([x for x in colours if x != colour],
                                                          rng.randint(1, 3))]
        question = (f"How many pixels does the {colour} object move between the first and the "
                    "last frame?")
        answer, answer_type = str(dist), "number"
        meta.update(target=colour, distance_px=dist, metric="mra")
    elif family == "order":
        chosen = rng.sample(colours, 3)
        starts = sorted(rng.sample(range(1, n_frames - 4, 4), 3))
        objects = [obj(c, appear=t) for c, t in zip(chosen, starts)]
        first = chosen[0]
        options = list(chosen)
        rng.shuffle(options)
        question = mc_question("Which object appears first in the video?", options)
        answer, answer_type = letter_of(options, first), "choice"
        meta.update(order=chosen, appear_frames=starts)
    else:
        raise ValueError(f"unknown video family {family}")
    rel = f"media/{tid}.mp4"
    _write(root / rel, objects, n_frames, background)
    return Task(id=tid, data_source="synth/video", question=question, video=rel, answer=answer,
                answer_type=answer_type, options=options,
                metadata={**meta, "objects": objects, "background": background}, split=split)
