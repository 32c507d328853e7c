"""Real datasets: download from the Hugging Face hub, or import a copy made elsewhere.

``download(name, out)`` fetches the dataset repository with ``huggingface_hub.snapshot_download``
(resumable: files already complete are skipped and partial ones continue), unpacks its archives,
and converts it with ``import_dataset``. Without a network it fails within seconds, naming the
dataset and the ``pyvision data import NAME --from-dir DIR`` route for a copy made elsewhere.

``import_dataset(name, from_dir, out)`` converts the published layout to canonical records:
``conversations.jsonl`` for SFT data, ``tasks.jsonl`` for RL data and evaluation sets, with media
under ``out/media`` (a link to the source folder, so gigabytes of images are not copied).
Rows whose media cannot be found, whose placeholders do not match their images, or whose answer
is empty are reported with file and row, and skipped (or fail the import with ``strict``).
"""

from __future__ import annotations

import os
import re
import shutil
import tarfile
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from pipelines.core.records import (
    Conversation,
    Message,
    ReadReport,
    Task,
    iter_jsonl,
    write_conversations,
    write_tasks,
)
from pipelines.errors import DataError, UserError
from pipelines.fsutil import atomic_write_json

MEDIA_LINK = "media"
IMAGE_EXT = (".png", ".jpg", ".jpeg", ".webp", ".bmp", ".gif")
VIDEO_EXT = (".mp4", ".webm", ".mkv", ".avi", ".mov")


@dataclass(frozen=True)
class HubDataset:
    """A dataset we know how to fetch and convert."""

    name: str
    repo_id: str
    kind: Literal["sft", "rl", "eval"]
    description: str
    allow_patterns: tuple[str, ...] | None = None
    archives: tuple[str, ...] = ()


DATASETS: dict[str, HubDataset] = {d.name: d for d in (
    HubDataset("pyvision-image-sft", "Agents-X/PyVision-Image-SFT-Data", "sft",
               "6.9k multi-turn PyVision trajectories with 1-23 images each (paper's cold start)",
               ("*.json", "*.tar.gz", "README.md"), ("images.tar.gz",)),
    HubDataset("pyvision-image-rl", "Agents-X/PyVision-Image-RL-Data", "rl",
               "44.6k image RL prompts: visual search, maths, charts"),
    HubDataset("pyvision-video-rl", "Agents-X/PyVision-Video-RL-Data", "rl",
               "15k video RL prompts (VSI, long video); videos are about 8.6 GB"),
    HubDataset("vstar", "lmms-lab-encoder/vstar-bench", "eval", "V* visual search benchmark"),
    HubDataset("hrbench", "DreamMr/HR-Bench", "eval", "HR-Bench 4K and 8K"),
    HubDataset("mathverse", "CaraJ/MathVerse-lmmseval", "eval", "MathVerse (testmini)"),
    HubDataset("vsibench", "nyu-visionx/VSI-Bench", "eval", "VSI-Bench spatial video QA"),
)}


def get_dataset(name: str) -> HubDataset:
    if name not in DATASETS:
        import difflib

        close = difflib.get_close_matches(name, list(DATASETS), n=1)
        hint = f"did you mean '{close[0]}'?" if close else f"known: {', '.join(DATASETS)}"
        raise UserError(f"unknown dataset '{name}'", hint=hint)
    return DATASETS[name]


def _offline_error(ds: HubDataset, reason: str) -> DataError:
    return DataError(
        f"cannot reach the Hugging Face hub to download '{ds.name}' ({ds.repo_id}): {reason}",
        hint=f"on a machine with internet run `huggingface-cli download {ds.repo_id} --repo-type "
             f"dataset --local-dir DIR`, copy DIR here, then `pyvision data import {ds.name} "
             f"--from-dir DIR`")


def check_reachable(ds: HubDataset, timeout_s: float = 8.0) -> None:
    """Fail fast (seconds, not minutes of retries) when the hub cannot be reached."""
    if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes"):
        raise _offline_error(ds, "HF_HUB_OFFLINE is set")
    from huggingface_hub import HfApi

    try:
        # HF_ENDPOINT is read per call so a mirror set after import is honoured.
        HfApi(endpoint=os.environ.get("HF_ENDPOINT")).dataset_info(ds.repo_id, timeout=timeout_s)
    except Exception as exc:  # noqa: BLE001 - any failure to answer means "not reachable"
        reason = type(exc).__name__
        text = str(exc).splitlines()[0][:160] if str(exc) else ""
        raise _offline_error(ds, f"{reason}: {text}" if text else reason) from None


def download(name: str, out: str | Path, *, revision: str | None = None,
             timeout_s: float = 8.0, strict: bool = False) -> dict[str, Any]:
    """Download (resumably) into ``out/raw``, unpack, and convert into ``out``."""
    ds = get_dataset(name)
    out = Path(out)
    check_reachable(ds, timeout_s)
    from huggingface_hub import snapshot_download

    raw = out / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    snapshot_download(ds.repo_id, repo_type="dataset", revision=revision, local_dir=str(raw),
                      allow_patterns=list(ds.allow_patterns) if ds.allow_patterns else None)
    for archive in ds.archives:
        extract_archive(raw / archive, raw)
    return import_dataset(name, raw, out, strict=strict)


def extract_archive(archive: Path, dest: Path) -> None:
    """Unpack a tar archive once (a marker file records completion), refusing unsafe paths."""
    marker = dest / f".{archive.name}.extracted"
    if marker.exists() or not archive.exists():
        return
    from rich.markup import escape
    from rich.progress import Progress

    from pipelines.console import err

    with tarfile.open(archive) as tar:
        members = tar.getmembers()
        with Progress(console=err, transient=True) as progress:
            task = progress.add_task(f"unpacking {escape(archive.name)}", total=len(members))
            for member in members:
                target = (dest / member.name).resolve()
                if not str(target).startswith(str(dest.resolve())) or member.issym() or member.islnk():
                    raise DataError(f"{archive}: unsafe member '{member.name}'",
                                    hint="the archive is corrupt or hostile; download it again")
                tar.extract(member, dest, filter="data")
                progress.advance(task)
    marker.write_text("ok\n")


# -- import: published layout -> canonical records -----------------------------------------------


@dataclass
class _MediaIndex:
    """Finds a file under ``root`` from a path recorded on another machine."""

    root: Path
    by_name: dict[str, list[Path]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for dirpath, _, files in os.walk(self.root):
            for f in files:
                if f.lower().endswith(IMAGE_EXT + VIDEO_EXT):
                    self.by_name.setdefault(f, []).append(Path(dirpath) / f)

    def resolve(self, recorded: str) -> Path | None:
        direct = [self.root / recorded, self.root / "images" / recorded,
                  self.root / "videos" / recorded]
        for p in direct:
            if p.is_file():
                return p
        parts = Path(recorded).parts
        best, best_score = None, 0
        for cand in self.by_name.get(Path(recorded).name, []):
            rel = cand.relative_to(self.root).parts
            score = 0
            while score < min(len(rel), len(parts)) and rel[-1 - score] == parts[-1 - score]:
                score += 1
            if score > best_score:
                best, best_score = cand, score
        return best


def _load_rows(from_dir: Path, patterns: Iterable[str]) -> list[tuple[str, int, Any]]:
    """Rows from every JSON list / JSONL / parquet file matching ``patterns``, with locations."""
    rows: list[tuple[str, int, Any]] = []
    files = sorted({p for pat in patterns for p in from_dir.rglob(pat)
                    if "/." not in str(p.relative_to(from_dir))})
    for f in files:
        if f.suffix == ".json":
            from benchmarks.sources import json_records

            rows += [(str(f), i + 1, r) for i, r in enumerate(json_records(f))]
        elif f.suffix == ".jsonl":  # a line that does not parse is kept as its error
            rows += [(str(f), number, obj) for number, obj in iter_jsonl(f)]
        elif f.suffix == ".parquet":
            from benchmarks.sources import parquet_rows

            rows += [(str(f), i, r) for i, r in enumerate(parquet_rows(f), start=1)]
    return rows


_ROLE = {"user": "user", "human": "user", "observation": "user", "assistant": "assistant",
         "gpt": "assistant"}


def _objects(rows, report: ReadReport,
             bad: Callable[[str, str, str], None]) -> Iterator[tuple[str, int, str, dict]]:
    """``(file, line, "file:line", row)`` for each row that is a JSON object; the others are
    counted as bad."""
    for file, line, row in rows:
        where = f"{file}:{line}"
        report.read += 1
        if isinstance(row, Exception) or not isinstance(row, dict):
            bad("malformed_json", where, "row is not a JSON object")
            continue
        yield file, line, where, row


def _convert_sft(rows, media: _MediaIndex, out: Path, report: ReadReport,
                 bad: Callable[[str, str, str], None]) -> list[Conversation]:
    convs = []
    for file, line, where, row in _objects(rows, report, bad):
        turns = row.get("conversations") or row.get("messages") or []
        if not isinstance(turns, list) or not all(isinstance(t, dict) for t in turns):
            bad("invalid_row", where, "'conversations' must be a list of turn objects")
            continue
        paths = row.get("images") or []
        if not isinstance(paths, list) or not all(isinstance(p, str) for p in paths):
            bad("invalid_row", where, "'images' must be a list of paths")
            continue
        messages = []
        for t in turns:
            role = _ROLE.get(str(t.get("role", t.get("from", ""))).lower())
            content = t.get("content", t.get("value"))
            if role is None or not isinstance(content, str):
                messages = []
                break
            if messages and messages[-1].role == role:
                # Consecutive same-role turns (e.g. a system note) are joined.
                messages[-1] = Message(role=role, content=messages[-1].content + "\n" + content)
            else:
                messages.append(Message(role=role, content=content))
        if len(messages) < 2:
            bad("invalid_row", where, "no usable user/assistant turns")
            continue
        images = []
        missing = None
        for p in paths:
            found = media.resolve(p)
            if found is None:
                missing = p
                break
            images.append(str(Path(MEDIA_LINK) / found.relative_to(media.root)))
        if missing is not None:
            bad("missing_media", where, f"missing media file {missing}")
            continue
        conv = Conversation(id=str(row.get("id", f"{Path(file).stem}-{line}")),
                            data_source=str(row.get("source_dataset") or row.get("data_source")
                                            or "pyvision-image-sft"),
                            messages=messages, images=images)
        problems = conv.problems(out)
        if problems:
            bad("placeholder_mismatch" if "placeholders" in problems[0] else "invalid_row",
                where, problems[0])
            continue
        convs.append(conv)
    return convs


_OPTION_RE = re.compile(r"^\s*\(?([A-Z])[\).:]\s*(.+?)\s*$", re.MULTILINE)


def infer_answer_type(question: str, answer: str) -> tuple[str, list[str]]:
    """(answer_type, options) for RL rows that carry no type (the paper judged them by LLM)."""
    a = answer.strip()
    options = [m.group(2) for m in _OPTION_RE.finditer(question)]
    letters = [m.group(1) for m in _OPTION_RE.finditer(question)]
    if re.fullmatch(r"\(?[A-Z]\)?", a) and letters and letters == [chr(65 + i) for i in range(len(letters))]:
        return "choice", options
    if re.fullmatch(r"-?\d+(\.\d+)?", a.replace(",", "")):
        return "number", []
    if any(tok in a for tok in ("\\frac", "\\sqrt", "^", "\\pi")):
        return "math", []
    return "text", []


def _convert_rl(rows, media: _MediaIndex, out: Path, report: ReadReport,
                bad: Callable[[str, str, str], None], default_source: str) -> list[Task]:
    tasks = []
    seen: set[str] = set()
    for file, line, where, row in _objects(rows, report, bad):
        question, answer = row.get("question"), row.get("answer")
        if not isinstance(question, str) or not question.strip():
            bad("invalid_row", where, "empty or missing question")
            continue
        if isinstance(answer, (list, dict)):  # str() would make "['A']" the answer
            bad("invalid_row", where, f"'answer' must be text or a number, not "
                                      f"{type(answer).__name__}")
            continue
        if answer is None or not str(answer).strip():
            bad("empty_answer", where, "empty answer")
            continue
        recorded = row.get("image_path") or row.get("video_path")
        if recorded is not None and not isinstance(recorded, str):
            bad("invalid_row", where, "'image_path' / 'video_path' must be a path")
            continue
        found = media.resolve(recorded) if recorded else None
        if found is None:
            bad("missing_media", where, f"missing media file {recorded}")
            continue
        rel = str(Path(MEDIA_LINK) / found.relative_to(media.root))
        answer_type, options = infer_answer_type(question, str(answer))
        tid = str(row.get("id", f"{Path(file).stem}-{line}"))
        if tid in seen:
            tid = f"{Path(file).stem}-{tid}"
        seen.add(tid)
        is_video = found.suffix.lower() in VIDEO_EXT
        tasks.append(Task(
            id=tid, data_source=str(row.get("data_source") or default_source), question=question,
            images=[] if is_video else [rel], video=rel if is_video else None,
            answer=str(answer).strip(), answer_type=answer_type, options=options,
            metadata={"ability": row.get("ability"), "judge": answer_type == "text"}))
    return tasks


def _link_media(from_dir: Path, out: Path) -> None:
    link = out / MEDIA_LINK
    if link.is_symlink() or link.exists():
        if link.resolve() == from_dir.resolve():
            return
        if link.is_symlink():
            link.unlink()
        else:
            raise DataError(f"{link} exists and is not a link to {from_dir}",
                            hint="import into an empty --out folder")
    os.symlink(os.path.relpath(from_dir.resolve(), out.resolve()), link)


def import_dataset(name: str, from_dir: str | Path, out: str | Path, *,
                   strict: bool = False) -> dict[str, Any]:
    """Convert a copy of ``name`` in its published layout into canonical records in ``out``."""
    ds = get_dataset(name)
    from_dir, out = Path(from_dir), Path(out)
    if not from_dir.is_dir():
        raise DataError(f"--from-dir {from_dir} is not a folder",
                        hint=f"pass the folder holding the downloaded copy of {ds.repo_id}")
    # A failed import leaves no folder behind: the outermost folder it made is removed (an
    # existing --out, such as download's, keeps what it held). Not a temp folder renamed into
    # place: the tasks of evaluation sets carry absolute paths to their media.
    made = next((d for d in reversed((out, *out.parents)) if not d.exists()), None)
    try:
        return _import(ds, from_dir, out, strict=strict)
    except BaseException:
        if made is not None:
            shutil.rmtree(made, ignore_errors=True)
        raise


def _import(ds: HubDataset, from_dir: Path, out: Path, *, strict: bool) -> dict[str, Any]:
    start = time.monotonic()
    if ds.kind == "eval":
        return _import_eval(ds, from_dir, out, strict=strict)
    patterns = ("*.json", "*.jsonl", "*.parquet")
    rows = _load_rows(from_dir, patterns)
    if not rows:
        found = any(next(from_dir.rglob(pattern), None) for pattern in patterns)
        raise DataError(f"no rows in the data files under {from_dir} (a .json file holds a list "
                        "of rows, or an object with one)" if found else
                        f"no data files ({', '.join(patterns)}) under {from_dir}",
                        hint=f"pass the folder holding the downloaded copy of {ds.repo_id}")
    out.mkdir(parents=True, exist_ok=True)
    link = out / MEDIA_LINK
    before = os.readlink(link) if link.is_symlink() else None
    _link_media(from_dir, out)  # the rows' media are checked through it
    media = _MediaIndex(from_dir)
    report = ReadReport(str(from_dir))

    def bad(reason: str, where: str, detail: str) -> None:
        if strict:
            raise DataError(f"{where}: {detail}", hint="fix the row or import without --strict")
        report.skip(reason, where, detail)

    # Everything is converted and checked before anything is written: a failed import into an
    # --out that held an earlier import leaves that import as it was, its media link included.
    try:
        if ds.kind == "sft":
            records: list[Any] = _convert_sft(rows, media, out, report, bad)
        else:
            records = _convert_rl(rows, media, out, report, bad, ds.name)
        if not records:
            raise DataError(f"no usable rows in {from_dir} ({report.read} read; "
                            f"{report.problems[0] if report.problems else 'none matched'})",
                            hint=f"check that this is a copy of {ds.repo_id}")
    except BaseException:
        if os.path.islink(link) and os.readlink(link) != before:
            link.unlink()
            if before is not None:
                os.symlink(before, link)
        raise
    if ds.kind == "sft":
        write_conversations(out / "conversations.jsonl", records)
        output = "conversations.jsonl"
    else:
        write_tasks(out / "tasks.jsonl", records)
        output = "tasks.jsonl"
    report.kept = len(records)
    manifest = {"dataset": ds.name, "repo_id": ds.repo_id, "kind": ds.kind, "output": output,
                "from_dir": str(from_dir), "seconds": round(time.monotonic() - start, 2),
                **report.as_dict()}
    atomic_write_json(out / "manifest.json", manifest)
    return manifest


def _import_eval(ds: HubDataset, from_dir: Path, out: Path, *, strict: bool) -> dict[str, Any]:
    """Evaluation sets go through their benchmark class, which knows the official layout."""
    from benchmarks import get_benchmark

    names = {"hrbench": ["hrbench4k", "hrbench8k"]}.get(ds.name, [ds.name])
    outputs = {}
    for bench_name in names:
        bench = get_benchmark(bench_name)
        tasks = bench.load(data_dir=from_dir, cache_dir=out)
        target = out / bench_name
        write_tasks(target / "tasks.jsonl", tasks)
        outputs[bench_name] = {"tasks": len(tasks), "path": str(target / "tasks.jsonl")}
    manifest = {"dataset": ds.name, "repo_id": ds.repo_id, "kind": "eval",
                "from_dir": str(from_dir), "benchmarks": outputs}
    atomic_write_json(out / "manifest.json", manifest)
    return manifest
