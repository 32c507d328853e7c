"""Synthetic, verifiable tasks generated offline: the embedded default's whole training mix.

Two kinds, in the spirit of the paper's training data:

- ``image-search`` (V* style visual search): a large canvas with small coloured targets among
  grey distractors; answering needs zooming or pixel measurement.
- ``video`` (VSI-Bench style): short mp4 clips with moving objects; counting and distance
  questions with numeric answers scored by MRA, and order-of-appearance as multiple choice.

Every task is a deterministic function of ``(kind, seed, split, index)``, so a set is the same byte
for byte whatever ``n`` is (task ``i`` does not depend on how many follow) and ``train`` and
``heldout`` never overlap. A set is a folder with ``tasks.jsonl``, ``media/`` and a
``manifest.json`` written last; the folder appears atomically.
"""

from __future__ import annotations

import contextlib
import hashlib
import random
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from pipelines.core.records import Task, write_tasks
from pipelines.errors import UserError
from pipelines.fsutil import atomic_dir, atomic_write_json

# 2: lossless, repeatable video clips (libx264rgb, qp 0).
GENERATOR_VERSION = "2"
KINDS = ("image-search", "video")
FAMILIES = {
    "image-search": ("color", "count", "position", "measure", "text"),
    "video": ("count", "distance", "order"),
}
DEFAULT_FAMILIES = {
    # `text` needs a model that reads; it is for real models, not the tiny demo.
    "image-search": ("color", "count", "position", "measure"),
    "video": ("count", "distance", "order"),
}
# Threads that make a set's tasks (:func:`_in_order`).
_SYNTH_THREADS = 2
MAX_TASKS = 10_000_000
"""The most tasks one set may hold (data.synth.image_search.n_train's bound)."""
BYTES_PER_TASK = {"image-search": 1_000_000, "video": 8_000}
"""Disk per task, rounded up from measured means (0.67 MB per canvas, 4.5 KB per clip), for the
free-space check before a set is written."""


def task_rng(kind: str, seed: int, split: str, index: int) -> random.Random:
    """The RNG of one task: a hash of its identity, independent of every other task."""
    digest = hashlib.sha256(f"pyvision-synth:{kind}:{seed}:{split}:{index}".encode()).digest()
    return random.Random(int.from_bytes(digest[:8], "big"))


def synthesize(kind: str, n: int, seed: int, out: str | Path, *, split: str = "train",
               families: Sequence[str] | None = None, force: bool = False,
               progress: bool = True) -> dict[str, Any]:
    """Generate ``n`` tasks of ``kind`` into ``out``; return the manifest."""
    if kind not in KINDS:
        raise UserError(f"unknown synthetic kind '{kind}'", hint=f"use one of {', '.join(KINDS)}")
    fams = tuple(families) if families else DEFAULT_FAMILIES[kind]
    unknown = [f for f in fams if f not in FAMILIES[kind]]
    if unknown:
        raise UserError(f"unknown {kind} family '{unknown[0]}'",
                        hint=f"use some of {', '.join(FAMILIES[kind])}")
    if not 1 <= n <= MAX_TASKS:
        raise UserError(f"--n {n} is out of range", hint=f"pass 1 to {MAX_TASKS:,} tasks")
    out = Path(out)
    if (out / "manifest.json").exists() and not force:
        raise UserError(f"{out} already holds a finished synthetic set",
                        hint="pass --force to regenerate it, or another --out")
    if out.is_dir():  # anything else there would be replaced only at the end: refused now
        from pipelines.core.modeldir import refuse_existing

        refuse_existing(out, force)
    from pipelines.inputs import check_free_space, check_writable_dir

    check_writable_dir(out, "output folder")
    check_free_space(out, n * BYTES_PER_TASK[kind], f"{n:,} {kind} tasks",
                     hint="pass a smaller --n, or an --out on a disk with more room")
    if kind == "image-search":
        from pipelines.data.synth_image import make_image_task as make
    else:
        from pipelines.data.synth_video import make_video_task as make
    start = time.monotonic()
    tasks: list[Task] = []
    counts: dict[str, int] = {}
    with atomic_dir(out, overwrite=force) as tmp:
        (tmp / "media").mkdir()
        tracker = _progress(progress, f"synth {kind} ({split})", n)

        def family(i: int) -> str:
            return fams[i % len(fams)]

        def build(i: int) -> Task:
            return make(family(i), task_rng(kind, seed, split, i), i, split, tmp)

        # Closed before the folder is removed on an error: no thread writes into it after.
        with contextlib.closing(_in_order(build, n)) as made:
            for i, task in enumerate(made):
                tasks.append(task)
                counts[family(i)] = counts.get(family(i), 0) + 1
                tracker(i + 1)
        tracker(None)
        write_tasks(tmp / "tasks.jsonl", tasks)
        seconds = time.monotonic() - start
        manifest = {"kind": kind, "n": n, "seed": seed, "split": split, "families": list(fams),
                    "generator_version": GENERATOR_VERSION, "counts": counts,
                    "seconds": round(seconds, 2), "tasks_per_s": round(n / max(seconds, 1e-9), 2)}
        atomic_write_json(tmp / "manifest.json", manifest)
    return manifest


def _in_order(build: Callable[[int], Task], n: int) -> Iterator[Task]:
    """``build(0)`` ... ``build(n - 1)``, in that order, made on two threads a few ahead.

    Each task depends on its own index only, so the threads change no byte. Most of a task's
    time goes to encoding its media (PNG, libx264), which releases the GIL: on two cores 60
    canvases took 3.6 s instead of 6.2 (a task's errors still raise, in order)."""
    from concurrent.futures import ThreadPoolExecutor

    workers = _SYNTH_THREADS
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="synth") as pool:
        ahead: deque[Any] = deque()
        for i in range(n):
            ahead.append(pool.submit(build, i))
            if len(ahead) > 2 * workers:  # a bounded window: n may be millions
                yield ahead.popleft().result()
        while ahead:
            yield ahead.popleft().result()


def _progress(enabled: bool, label: str, total: int) -> Callable[[int | None], None]:
    if not enabled:
        return lambda _i: None
    from rich.progress import Progress

    from pipelines.console import err

    bar = Progress(console=err, transient=True)
    task = bar.add_task(label, total=total)
    bar.start()

    def update(i: int | None) -> None:
        if i is None:
            bar.stop()
        else:
            bar.update(task, completed=i)

    return update
