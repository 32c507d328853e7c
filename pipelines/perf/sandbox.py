"""`pyvision perf sandbox`: start time, call overhead, crop-and-show, many live sandboxes."""

from __future__ import annotations

import time
from typing import Any

from pipelines.config.sandbox import SandboxConfig
from pipelines.perf import process_tree_memory_mb, summary_ms

CROP_SHOW = """crop = image_clue_0.crop((256, 256, 512, 512))
zoom = crop.resize((768, 768))
plt.figure(figsize=(4, 4))
plt.imshow(zoom)
plt.axis("off")
plt.show()
"""


def run_benchmark(repeats: int = 30, n_concurrent: int = 64,
                  config: SandboxConfig | None = None) -> dict[str, Any]:
    """Measure the sandbox on this machine; returns the JSON the CLI prints."""
    import numpy as np
    from PIL import Image

    from pipelines.agent.sandbox import Sandbox, isolation_mode

    cfg = config or SandboxConfig()
    rng = np.random.default_rng(0)
    image = Image.fromarray(rng.integers(0, 255, (1024, 1024, 3), dtype=np.uint8))
    warm_start = time.monotonic()
    with Sandbox(cfg) as first:  # starts the zygote (once per process)
        first.run("x = 1")
    zygote_s = time.monotonic() - warm_start

    starts = []
    for _ in range(repeats):
        t = time.monotonic()
        s = Sandbox(cfg, images={"image_clue_0": image})
        starts.append(time.monotonic() - t)
        s.close()

    overhead, crop = [], []
    with Sandbox(cfg, images={"image_clue_0": image}) as s:
        for _ in range(3):
            s.run("x = 1")
            s.run(CROP_SHOW)
        for _ in range(repeats):
            t = time.monotonic()
            r = s.run("x = 1")
            overhead.append(time.monotonic() - t)
            assert r.status == "ok", r.stderr
        for _ in range(max(5, repeats // 3)):
            t = time.monotonic()
            r = s.run(CROP_SHOW)
            crop.append(time.monotonic() - t)
            assert r.status == "ok" and len(r.images) == 1, r.stderr

    base = process_tree_memory_mb()
    live = []
    peak = dict(base)
    try:
        for _ in range(n_concurrent):
            s = Sandbox(cfg, images={"image_clue_0": image})
            s.run("crop = image_clue_0.crop((0, 0, 256, 256)); arr = np.asarray(crop)")
            live.append(s)
        peak = process_tree_memory_mb()
        alive = sum(1 for s in live if s.run("print(arr.shape[0])").stdout.strip() == "256")
    finally:
        for s in live:
            s.close()
    return {
        "isolation": isolation_mode(cfg),
        "zygote_start_s": round(zygote_s, 3),
        "start_ms": summary_ms(starts),
        "call_overhead_ms": summary_ms(overhead),
        "crop_show_ms": summary_ms(crop),
        "concurrent": {"n": n_concurrent, "alive": alive, "peak_rss_mb": peak["rss_mb"],
                       "peak_pss_mb": peak["pss_mb"], "baseline_rss_mb": base["rss_mb"],
                       "processes": peak["processes"]},
    }
