"""Trajectories for people: what each model did on each sample, and what RL trained on.

:func:`collect_trajectories` reads, for the chosen runs, every evaluated sample (question, input
thumbnails, every turn: the model's text, its code, the interpreter's text and images, the final
answer, the gold answer, the verdict and the scorer that decided it, turns, tool calls, visual
tokens, stop reason) and the RL rollouts the local engine recorded (kept and dropped groups with
their rewards and advantages). :func:`write_page` turns that into ``trajectories.html``: one page
with filters, search, side-by-side comparison of models on the same sample and the samples whose
verdict changed between two models; its images are the stored thumbnails, written once each into
``media/`` next to it and loaded lazily. `pyvision show` renders the same views in a terminal.

A sample's verdict comes from its primary score: ``right`` (1), ``wrong`` (0), ``partial``
(between, e.g. VSI-Bench's mean relative accuracy) or ``unscored``.

Everything is ordered (runs as stored, models base, SFT, RL, then by name; benchmarks and samples
by name) and no time or path of the machine enters the page, so the same store always gives the
same bytes.
"""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipelines.core.media import EXTENSION, thumbnail_file
from pipelines.fsutil import atomic_write_bytes, atomic_write_text
from pipelines.report.stats import MODEL_ORDER, benchmark_primary, primary_metric

TEXT_LIMIT = 4000
"""Characters of any one text (a turn's text, code, output) a page shows; the rest is cut with a
note saying how much. Keeps a page of thousands of samples small when a model rambles."""
VERDICTS = ("right", "partial", "wrong", "unscored")
ASSETS = Path(__file__).with_name("assets")
PAGE = "trajectories.html"
MEDIA_DIR = "media"


def clip(text: str | None, limit: int = TEXT_LIMIT) -> str:
    if not text:
        return ""
    if len(text) <= limit:
        return text
    return f"{text[:limit]}\n… ({len(text) - limit} more characters)"


def sample_verdict(value: float | None) -> str:
    if value is None:
        return "unscored"
    if value >= 1.0 - 1e-9:
        return "right"
    if value <= 1e-9:
        return "wrong"
    return "partial"


def sample_score(benchmark: str, scores: dict[str, float | None]) -> tuple[str | None, float | None]:
    """(metric, value) that decides one sample's verdict: the benchmark's primary metric, else
    its only metric (VSI-Bench scores each sample under its question type), else the report's
    choice of primary metric."""
    if not scores:
        return None, None
    primary = benchmark_primary(benchmark)
    if primary in scores:
        return primary, scores[primary]
    if len(scores) == 1:
        return next(iter(scores.items()))
    name = primary_metric(scores)
    return name, scores[name]


def split_code(text: str) -> tuple[str, str]:
    """A turn's text before its ``<code>`` block and after ``</code>`` (the code is shown from
    ``Turn.code``, highlighted)."""
    start = text.find("<code>")
    if start < 0:
        return text, ""
    end = text.find("</code>", start)
    return text[:start], (text[end + len("</code>"):] if end >= 0 else "")


def turn_views(trajectory: dict[str, Any] | None, images: list[str | None] | None
               ) -> list[dict[str, Any]]:
    """Each turn of a stored trajectory as the page and the terminal show it: text, code, the
    interpreter's status, output and images (thumbnail names; None when not stored)."""
    if not trajectory:
        return []
    out = []
    for t in trajectory.get("turns") or []:
        code = t.get("code")
        before, after = split_code(t.get("assistant") or "") if code else (t.get("assistant") or "", "")
        res = t.get("result") or {}
        idx = t.get("image_indices") or []
        shown = [images[i] if images is not None and i < len(images) else None for i in idx]
        view: dict[str, Any] = {"text": clip(before.strip("\n")), "finish": t.get("finish") or ""}
        if code is not None:
            view.update({"code": clip(code), "after": clip(after.strip("\n")),
                         "status": res.get("status") or "not run",
                         "out": clip(res.get("stdout")), "err": clip(res.get("stderr")),
                         "truncated": bool(res.get("truncated")),
                         "tool_s": round(float(res.get("duration_s") or 0.0), 3),
                         "imgs": shown})
        out.append(view)
    return out


def _question(task: dict[str, Any] | None, trajectory: dict[str, Any] | None) -> str:
    if task and task.get("question"):
        return str(task["question"])
    texts = [p.get("text", "") for p in (trajectory or {}).get("prompt") or []
             if p.get("type") == "text"]
    return texts[-1].strip() if texts else ""


def _model_order(key: tuple[str, str], run_order: dict[str, int]) -> tuple:
    run, model = key
    return (run_order.get(run, 9999), run, MODEL_ORDER.get(model, 9), model)


@dataclass
class TrajectorySet:
    """What the trajectory page shows (see :func:`collect_trajectories`)."""

    runs: list[str]
    models: list[dict[str, str]] = field(default_factory=list)
    """``{"key": "run/model", "run", "model"}`` in display order."""
    benchmarks: list[str] = field(default_factory=list)
    samples: list[dict[str, Any]] = field(default_factory=list)
    """One per (benchmark, sample id): question, gold answer, options, input thumbnails, video."""
    entries: list[dict[str, Any]] = field(default_factory=list)
    """One per evaluated (run, model, benchmark, sample), indexing ``models`` and ``samples``."""
    steps: list[dict[str, Any]] = field(default_factory=list)
    """Recorded RL steps: ``{"run", "step", "groups": [...]}``, each group with its rollouts."""
    media: set[str] = field(default_factory=set)
    """Thumbnail names the page refers to."""
    extra_media: dict[str, Any] = field(default_factory=dict)
    """Thumbnails by name: those read from the store with the samples, and those made now
    (inputs of samples stored before thumbnails were)."""

    def model_index(self, key: str) -> int | None:
        return next((i for i, m in enumerate(self.models) if m["key"] == key), None)

    def entry(self, model_key: str, benchmark: str, sample_id: str) -> dict[str, Any] | None:
        m = self.model_index(model_key)
        for e in self.entries:
            s = self.samples[e["s"]]
            if e["m"] == m and s["benchmark"] == benchmark and s["id"] == sample_id:
                return e
        return None


def _input_thumbs(task: dict[str, Any] | None, ts: TrajectorySet, max_side: int = 512
                  ) -> list[str | None]:
    """Thumbnails of a task's input images made now, for samples stored without them (when the
    files are still where the task says)."""
    if not task or task.get("video"):
        return []
    out: list[str | None] = []
    for path in task.get("images") or []:
        blob = thumbnail_file(path, max_side) if Path(path).is_absolute() else None
        if blob is not None:
            ts.extra_media[blob.sha256] = blob
        out.append(blob.sha256 if blob else None)
    return out


def collect_trajectories(store: Any, run_ids: list[str], *, with_rollouts: bool = True
                         ) -> TrajectorySet:
    """Every evaluated sample (and recorded RL rollout) of ``run_ids``, ready to show."""
    ts = TrajectorySet(runs=list(run_ids))
    run_order = {r: i for i, r in enumerate(run_ids)}
    records: list[dict[str, Any]] = []
    scores: dict[tuple[str, str, str], dict[str, dict[str, float]]] = {}
    for rid in run_ids:
        recs = store.eval_records(rid, with_trajectory=True, with_task=True, with_media=True)
        records += recs
        for key in sorted({(r["model"], r["benchmark"]) for r in recs}):
            scores[(rid, *key)] = store.eval_scores(rid, *key)
    model_keys = sorted({(r["run_id"], r["model"]) for r in records},
                        key=lambda k: _model_order(k, run_order))
    ts.models = [{"key": f"{run}/{model}", "run": run, "model": model} for run, model in model_keys]
    model_index = {k: i for i, k in enumerate(model_keys)}
    ts.benchmarks = sorted({r["benchmark"] for r in records})
    sample_index: dict[tuple[str, str], int] = {}
    for r in sorted(records, key=lambda r: (r["benchmark"], r["sample_id"])):
        key = (r["benchmark"], r["sample_id"])
        media = r.get("media") or {}
        if key not in sample_index:
            task = r.get("task") or {}
            sample_index[key] = len(ts.samples)
            ts.samples.append({
                "benchmark": r["benchmark"], "id": r["sample_id"],
                "question": _question(task, r.get("trajectory")),
                "gold": str(task.get("answer", "")) if task else "",
                "options": list(task.get("options") or []) if task else [],
                "answer_type": task.get("answer_type", "") if task else "",
                "video": Path(task["video"]).name if task and task.get("video") else None,
                "inputs": list(media["inputs"]) if "inputs" in media else _input_thumbs(task, ts),
            })
        elif not ts.samples[sample_index[key]]["inputs"] and media.get("inputs"):
            ts.samples[sample_index[key]]["inputs"] = list(media["inputs"])
    for r in sorted(records, key=lambda r: (model_index[(r["run_id"], r["model"])],
                                            r["benchmark"], r["sample_id"])):
        traj = r.get("trajectory") or {}
        media = r.get("media") or {}
        metric, value = sample_score(r["benchmark"], scores.get(
            (r["run_id"], r["model"], r["benchmark"]), {}).get(r["sample_id"], {}))
        ts.entries.append({
            "m": model_index[(r["run_id"], r["model"])],
            "s": sample_index[(r["benchmark"], r["sample_id"])],
            "verdict": sample_verdict(value), "score": value, "metric": metric,
            "prediction": r["prediction"], "stop": r["stop_reason"] or "unknown",
            "turns": r["turns"] or 0, "tools": r["tool_calls"] or 0,
            "failed": r["failed_calls"] or 0, "visual": r["visual_tokens"] or 0,
            "tokens": r["total_tokens"] or 0, "seconds": round(float(r["duration_s"] or 0.0), 2),
            "scored_by": r.get("scored_by") or "unknown", "scorer": r["scorer"],
            "prompt": r["prompt_version"],
            "steps": turn_views(traj, media.get("images")),
            "images_stored": bool(media),
        })
    if with_rollouts:
        ts.steps = _rollout_steps(store, run_ids)
    for s in ts.samples:
        ts.media.update(x for x in s["inputs"] if x)
    for e in ts.entries:
        ts.media.update(x for st in e["steps"] for x in st.get("imgs") or [] if x)
    for step in ts.steps:
        for g in step["groups"]:
            ts.media.update(x for x in g["inputs"] if x)
            ts.media.update(x for ro in g["rollouts"] for st in ro.get("steps") or []
                            for x in st.get("imgs") or [] if x)
    # The stored thumbnails too, so that writing the page reads nothing more from the store.
    missing = sorted(ts.media - set(ts.extra_media))
    if missing:
        ts.extra_media.update(store.media(missing))
    return ts


def _rollout_steps(store: Any, run_ids: list[str]) -> list[dict[str, Any]]:
    steps: dict[tuple[str, int], dict[int, dict[str, Any]]] = defaultdict(dict)
    for r in store.rollouts(run_ids):
        groups = steps[(r["run_id"], int(r["step"]))]
        media = r.get("media") or {}
        task = r.get("task") or {}
        g = groups.get(r["group_index"])
        if g is None:
            g = groups[r["group_index"]] = {
                "group": r["group_index"], "task_id": r["task_id"],
                "data_source": r["data_source"], "status": r["group_status"], "rank": r["rank"],
                "mean": r["group_mean"], "std": r["group_std"],
                "question": _question(task, r.get("trajectory")),
                "gold": str(task.get("answer", "")), "options": list(task.get("options") or []),
                "video": Path(task["video"]).name if task.get("video") else None,
                "inputs": list(media.get("inputs") or []), "rollouts": []}
        elif not g["inputs"] and media.get("inputs"):
            g["inputs"] = list(media["inputs"])
        g["rollouts"].append({
            "sample": r["sample_index"], "status": r["status"], "reward": r["reward"],
            "accuracy": r["accuracy"], "tool": r["tool"], "format": r["format"],
            "advantage": r["advantage"], "stop": r["stop_reason"] or "unknown",
            "prediction": r["prediction"], "turns": r["turns"] or 0,
            "tools": r["tool_calls"] or 0, "visual": r["visual_tokens"] or 0,
            "steps": turn_views(r.get("trajectory"), media.get("images"))
            if r.get("trajectory") else None})
    run_order = {r: i for i, r in enumerate(run_ids)}
    out = []
    for (run, step), groups in sorted(steps.items(), key=lambda kv: (run_order[kv[0][0]], kv[0][1])):
        ordered = sorted(groups.values(), key=lambda g: (g["rank"] is None, g["rank"] or 0,
                                                         g["group"]))
        out.append({"run": run, "step": step, "groups": ordered})
    return out


def verdict_changes(ts: TrajectorySet, a: str, b: str, benchmark: str | None = None
                    ) -> list[dict[str, Any]]:
    """Samples both models answered whose verdict differs, from ``a`` to ``b`` (model keys
    ``run/model``): ``fixed`` (wrong or partial in a, right in b), ``broken`` (the reverse), or
    ``changed`` (any other change)."""
    ia, ib = ts.model_index(a), ts.model_index(b)
    if ia is None or ib is None:
        return []
    by_sample: dict[int, dict[int, dict[str, Any]]] = defaultdict(dict)
    for e in ts.entries:
        if e["m"] in (ia, ib):
            by_sample[e["s"]][e["m"]] = e
    out = []
    for s, pair in sorted(by_sample.items()):
        sample = ts.samples[s]
        if ia not in pair or ib not in pair or (benchmark and sample["benchmark"] != benchmark):
            continue
        va, vb = pair[ia]["verdict"], pair[ib]["verdict"]
        if va == vb:
            continue
        kind = "fixed" if vb == "right" else "broken" if va == "right" else "changed"
        out.append({"benchmark": sample["benchmark"], "sample_id": sample["id"], "change": kind,
                    "a": pair[ia], "b": pair[ib], "sample": sample})
    return out


def verdict_counts(ts: TrajectorySet) -> list[dict[str, Any]]:
    """Per model and benchmark: samples and how many are right, wrong and partial."""
    counts: dict[tuple[int, str], dict[str, int]] = {}
    for e in ts.entries:
        key = (e["m"], ts.samples[e["s"]]["benchmark"])
        c = counts.setdefault(key, {v: 0 for v in VERDICTS})
        c[e["verdict"]] += 1
    return [{"model": ts.models[m]["key"], "benchmark": bench, "n": sum(c.values()), **c}
            for (m, bench), c in sorted(counts.items())]


# -- the page -------------------------------------------------------------------------------------


def page_payload(ts: TrajectorySet) -> dict[str, Any]:
    return {"runs": ts.runs, "models": ts.models, "benchmarks": ts.benchmarks,
            "samples": ts.samples, "entries": ts.entries, "steps": ts.steps,
            "media_dir": MEDIA_DIR, "media_ext": EXTENSION}


def _script_json(payload: dict[str, Any]) -> str:
    # "<" escaped as \u003c: no text from a model can close the script element early.
    return json.dumps(payload, ensure_ascii=False, separators=(",", ":"),
                      allow_nan=False).replace("<", "\\u003c")


def page_html(ts: TrajectorySet, title: str = "PyVision trajectories") -> str:
    """The self-contained page (inline CSS, JS and data; images under ``media/``)."""
    import html

    css = (ASSETS / "trajectories.css").read_text(encoding="utf-8")
    js = (ASSETS / "trajectories.js").read_text(encoding="utf-8")
    return ("<!doctype html><html lang='en'><head><meta charset='utf-8'>"
            "<meta name='viewport' content='width=device-width, initial-scale=1'>"
            f"<title>{html.escape(title)}</title><style>{css}</style></head><body>"
            f"<noscript>This page needs JavaScript to list the trajectories.</noscript>"
            f"<div id='app' data-title='{html.escape(title)}'></div>"
            f"<script id='data' type='application/json'>{_script_json(page_payload(ts))}</script>"
            f"<script>{js}</script></body></html>\n")


def write_media(store: Any, ts: TrajectorySet, out_dir: Path) -> int:
    """Write each thumbnail the page needs into ``out_dir/media`` (once; a file already there
    with the same name has the same bytes) and remove thumbnails no longer referred to."""
    folder = out_dir / MEDIA_DIR
    folder.mkdir(parents=True, exist_ok=True)
    blobs = dict(ts.extra_media)
    missing = sorted(ts.media - set(blobs))
    if missing:  # not fetched with the samples (collect_trajectories fetches them)
        blobs.update(store.media(missing))
    written = 0
    for sha in sorted(ts.media):
        blob = blobs.get(sha)
        path = folder / f"{sha}{EXTENSION}"
        if blob is None or path.is_file():
            continue
        atomic_write_bytes(path, blob.data)
        written += 1
    for old in folder.glob(f"*{EXTENSION}"):
        if old.name[: -len(EXTENSION)] not in ts.media:
            old.unlink()
    return written


def write_page(store: Any, ts: TrajectorySet, out_dir: str | Path) -> Path:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    write_media(store, ts, out)
    return atomic_write_text(out / PAGE, page_html(ts))
