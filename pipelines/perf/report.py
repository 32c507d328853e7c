"""`pyvision perf report`: how long the report takes for thousands of evaluated samples.

A temporary store is filled with ``samples`` evaluated samples split over three models (base,
SFT, RL) and two benchmarks, each shaped like a real one: a question, two or three turns with
code, interpreter output and an interpreter image, an input image shared by the three models,
scores and a scorer. Their thumbnails are real WebP thumbnails (made while filling, not timed).
Then it times, separately:

- ``collect_s``: reading every trajectory, score and thumbnail name from the store;
- ``page_s``: rendering trajectories.html (data, code and style inline);
- ``media_s``: writing the thumbnails the page refers to into ``media/``;
- ``report_s``: the whole ``write_report`` (HTML with plots and the trajectory page, markdown,
  JSON), as ``pyvision report --format html`` and ``pyvision run`` call it;
- with Chromium installed, ``browser_s``: a headless Chromium loading the page and printing its
  DOM, minus the same for an empty page (Chromium's own start-up); and ``page_ready_ms``, the
  page's own clock from navigation start to its list and summary drawn.
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

MODELS = ("base", "sft", "rl")
BENCHMARKS = ("synth-image", "synth-video")


def _trajectory(i: int, model: str, answer: str) -> tuple[dict[str, Any], int]:
    from pipelines.agent.trajectory import ToolResult, Trajectory, Turn

    code = (f"import matplotlib.pyplot as plt\ncrop = image_clue_0.crop(({i % 50}, 0, "
            f"{i % 50 + 200}, 200))  # zoom on the left\nplt.imshow(crop); plt.show()\n"
            f"print('mean colour', np.asarray(crop).mean(axis=(0, 1)))")
    t = Trajectory(task_id=f"s{i}", data_source="synth/image-search", variant="image",
                   prompt_version="image@v1", prompt_hash="0" * 64, mode="eval")
    t.prompt = [{"type": "image", "index": 0}, {"type": "text", "text": "Question ..."}]
    n_code = 1 + i % 2
    for k in range(n_code):
        t.turns.append(Turn(
            assistant=f"Step {k + 1}: I look at the region around the object.\n<code>\n```python\n"
                      f"{code}\n```\n</code>", code=code,
            result=ToolResult("ok", f"mean colour [{i % 255} 120 {k * 40}]\n", "", 0.05, 1,
                              False),
            observation=[{"type": "text", "text": "<interpreter>\nText Result:\n..."},
                         {"type": "image", "index": 1 + k},
                         {"type": "text", "text": "\n</interpreter>"}],
            image_indices=[1 + k], finish="code"))
    t.turns.append(Turn(assistant=f"The object is there.\n<answer>\n\\boxed{{{answer}}}\n</answer>",
                        finish="eos"))
    t.final_answer, t.stop_reason = answer, "answered"
    t.tool_calls = t.successful_calls = n_code
    return t.to_json(), n_code


def fill_store(store: Any, samples: int, seed: int = 0) -> int:
    """``samples`` evaluated samples (over models and benchmarks); returns the thumbnails made."""
    import random

    from PIL import Image, ImageDraw

    from pipelines.core.media import thumbnail
    from pipelines.store import EvalRecord

    rng = random.Random(seed)
    store.upsert_run("perf", "perf", config={})
    inputs: dict[int, Any] = {}
    records = []
    made = 0
    for m, model in enumerate(MODELS):
        for i in range(samples // len(MODELS) + (m < samples % len(MODELS))):
            bench = BENCHMARKS[i % len(BENCHMARKS)]
            if i not in inputs:
                img = Image.new("RGB", (640, 480), (rng.randrange(256), 200, 200))
                ImageDraw.Draw(img).ellipse((i % 500, 100, i % 500 + 40, 140), fill=(20, 20, 200))
                inputs[i] = thumbnail(img, 512)
                made += 1
            gold = "ABCD"[i % 4]
            answer = gold if rng.random() < 0.3 + 0.2 * m else "ABCD"[(i + 1) % 4]
            traj, n_code = _trajectory(i, model, answer)
            crops = []
            for k in range(n_code):
                crop = Image.new("RGB", (200, 200), ((i * 7 + k) % 256, 80, 40 * m))
                ImageDraw.Draw(crop).rectangle((i % 180, (i // 180) % 180, i % 180 + 20,
                                                (i // 180) % 180 + 20), fill=(250, 250, 250))
                crops.append(thumbnail(crop, 512))
            made += len(crops)
            right = float(answer == gold)
            records.append(EvalRecord(
                run_id="perf", model=model, benchmark=bench, sample_id=f"s{i:05d}",
                benchmark_version="1", prompt_version="image@v1", prompt_hash="0" * 64,
                scorer="verify@1", scored_by="rules", prediction=answer, stop_reason="answered",
                turns=len(traj["turns"]), tool_calls=n_code, failed_calls=0, visual_tokens=256,
                total_tokens=900, duration_s=1.0, trajectory=traj, scores={"accuracy": right},
                task={"id": f"s{i:05d}", "question": f"Where is the blue object? (sample {i})",
                      "answer": gold, "options": ["left", "right", "top", "bottom"],
                      "answer_type": "choice"},
                media={"inputs": [inputs[i].sha256],
                       "images": [inputs[i].sha256] + [c.sha256 for c in crops]},
                blobs=[inputs[i], *crops]))
            if len(records) >= 500:
                store.add_eval_records(records)
                records = []
    store.add_eval_records(records)
    for model in MODELS:
        for bench in BENCHMARKS:
            scores = store.eval_scores("perf", model, bench)
            mean = sum(s["accuracy"] for s in scores.values()) / max(1, len(scores))
            store.set_eval_aggregate("perf", model, bench, {"accuracy": mean}, n=len(scores),
                                     benchmark_version="1", prompt_version="image@v1",
                                     scorer="verify@1")
    return made


def _chromium(url: str, profile: Path) -> tuple[float, str]:
    """Wall seconds of a headless Chromium loading ``url`` and printing its DOM, and the DOM."""
    exe = shutil.which("chromium") or shutil.which("chromium-browser")
    start = time.perf_counter()
    proc = subprocess.run([exe, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
                           "--disable-background-networking", "--disable-component-update",
                           f"--user-data-dir={profile}", "--allow-file-access-from-files",
                           "--dump-dom", url], capture_output=True, text=True, timeout=300,
                          check=False)
    return time.perf_counter() - start, proc.stdout


def run_benchmark(samples: int = 2000, browser: bool = True) -> dict[str, Any]:
    from pipelines.report import write_report
    from pipelines.report.trajectories import collect_trajectories, page_html, write_media
    from pipelines.store import Store

    with tempfile.TemporaryDirectory(prefix="pyvision-perf-report-") as tmp:
        root = Path(tmp)
        store = Store(root / "store.duckdb")
        start = time.perf_counter()
        thumbs = fill_store(store, samples)
        fill_s = time.perf_counter() - start
        start = time.perf_counter()
        ts = collect_trajectories(store, ["perf"])
        collect_s = time.perf_counter() - start
        start = time.perf_counter()
        html = page_html(ts)
        page_s = time.perf_counter() - start
        start = time.perf_counter()
        write_media(store, ts, root / "page")
        media_s = time.perf_counter() - start
        start = time.perf_counter()
        written = write_report(store, ["perf"], ["html", "markdown", "json"], root / "report")
        report_s = time.perf_counter() - start
        page = Path(written["trajectories"])
        media = list((root / "report" / "media").iterdir())
        result: dict[str, Any] = {
            "samples": len(ts.entries), "models": len(ts.models), "thumbnails": len(ts.media),
            "fill_s": round(fill_s, 2), "thumbnails_made": thumbs,
            "collect_s": round(collect_s, 3), "page_s": round(page_s, 3),
            "media_s": round(media_s, 3), "report_s": round(report_s, 3),
            "page_mb": round(len(html.encode()) / 2**20, 2),
            "media_mb": round(sum(p.stat().st_size for p in media) / 2**20, 2),
            "browser_s": None, "page_ready_ms": None}
        if browser and (shutil.which("chromium") or shutil.which("chromium-browser")):
            import re

            blank = root / "blank.html"
            blank.write_text("<!doctype html><p>blank</p>")
            _chromium(blank.as_uri(), root / "chrome")  # a warm profile for both
            empty = min(_chromium(blank.as_uri(), root / "chrome")[0] for _ in range(2))
            runs = [_chromium(page.as_uri(), root / "chrome") for _ in range(2)]
            result["browser_s"] = round(max(0.0, min(t for t, _ in runs) - empty), 3)
            # The page's own clock: navigation start to its list and summary drawn.
            drawn = [int(m.group(1)) for _, dom in runs
                     if (m := re.search(r'data-ready-ms="(\d+)"', dom))]
            result["page_ready_ms"] = min(drawn) if drawn else None
        return result
