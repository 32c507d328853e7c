"""VSI-Bench: visual-spatial questions about indoor scene videos.

Data: ``nyu-visionx/VSI-Bench``, config ``full`` (as lmms-eval 0.7.3), split ``test``; columns
``id``, ``dataset`` (arkitscenes / scannet / scannetpp), ``scene_name``, ``question_type``,
``question``, ``options`` (``["A. chair", ...]`` for multiple choice, else empty),
``ground_truth``. Videos are ``<dataset>/<scene_name>.mp4``; the hub ships them as
``<dataset>.zip``.

Local copy (``--data-dir``): the rows in any layout of :mod:`benchmarks.sources`, plus the
videos as ``<data-dir>/<dataset>/<scene_name>.mp4`` (or under ``videos/``), or the official
``<dataset>.zip`` files anywhere under ``<data-dir>``, from which only the needed videos are
extracted into ``<cache_dir>/vsibench/videos/``. Without ``--data-dir`` the videos are looked
for in that cache and in lmms-eval's (``$HF_HOME/vsibench``), then the zips are fetched.

Prompt and score are lmms-eval's (``tasks/vsibench/utils.py``): multiple-choice types compare
the first space-separated word of the answer (trailing dots removed) with the letter, case
insensitive; numerical types take the first number (digits or number words, lmms-eval's exact
rule) and score mean relative accuracy over thresholds 0.50..0.95. Aggregation: the mean per
question type, the three ``object_rel_direction`` difficulties averaged into one, and
``vsibench_overall`` the mean of the per-type scores, all rounded to 6 places as lmms-eval does.
Types absent from the evaluated rows are left out (lmms-eval reports 0.0 for them but also
leaves them out of the overall).
"""

from __future__ import annotations

import os
import re
import zipfile
import zlib
from pathlib import Path
from typing import Any

from benchmarks.base import Benchmark, LoadContext, Sample, mean, require_text
from benchmarks.scoring import extract_final_answer, extract_number, mean_relative_accuracy
from benchmarks.sources import HUB_TIMEOUT_S, Row, hub_unreachable_reason, no_hub_error
from pipelines.core.records import Task
from pipelines.errors import DataError, UserError

PRE_PROMPT = "These are frames of a video."
MCA_POST_PROMPT = "Answer with the option's letter from the given choices directly."
NA_POST_PROMPT = "Please answer the question using a single word or phrase."
REL_DIRECTION_TYPES = ("object_rel_direction_easy", "object_rel_direction_medium",
                       "object_rel_direction_hard")
MCA_QUESTION_TYPES = REL_DIRECTION_TYPES + ("object_rel_distance", "route_planning",
                                            "obj_appearance_order")
NA_QUESTION_TYPES = ("object_abs_distance", "object_counting", "object_size_estimation",
                     "room_size_estimation")
_OPTION_PREFIX_RE = re.compile(r"^\s*\(?[A-Z]\)?[.:)]\s*")


def metric_key(question_type: str) -> str:
    """The per-sample key of a question type: ``<type>_accuracy`` or ``<type>_mra``."""
    suffix = "accuracy" if question_type in MCA_QUESTION_TYPES else "mra"
    return f"{question_type}_{suffix}"


def first_word(prediction: str) -> str:
    """lmms-eval's ``fuzzy_matching``: the first space-separated word, trailing dots removed."""
    return prediction.split(" ")[0].rstrip(".").strip()


class VSIBench(Benchmark):
    """VSI-Bench (lmms-eval task ``vsibench``)."""

    name = "vsibench"
    version = "1"
    hf_id = "nyu-visionx/VSI-Bench"
    hf_config = "full"
    split = "test"
    metric_names = ("vsibench_overall", "obj_appearance_order_accuracy", "object_abs_distance_mra",
                    "object_counting_mra", "object_rel_distance_accuracy",
                    "object_size_estimation_mra", "room_size_estimation_mra",
                    "route_planning_accuracy", "object_rel_direction_accuracy")
    primary_metric = "vsibench_overall"
    reference = "lmms-eval 0.7.3 tasks/vsibench"
    id_column = "id"
    required_columns = ("id", "dataset", "scene_name", "question_type", "question",
                        "ground_truth")
    media_columns = ()
    include_hints = ("test",)
    exclude_hints = ("debiased", "pruned")

    def __init__(self, mra_threshold: float = 0.5) -> None:
        """``mra_threshold``: from which MRA a numerical answer counts as right (the RL reward's
        verdict; the official scores are MRA values and do not use it)."""
        if not 0.0 <= mra_threshold <= 1.0:
            raise UserError(f"mra_threshold ({mra_threshold}) must lie in [0, 1]",
                            hint="use the reward's value (reward.mra_threshold)")
        self.mra_threshold = mra_threshold
        self._zip_index: dict[Path, dict[str, str]] = {}
        self._zips: dict[tuple[Path | None, str], Path | None] = {}

    # -- data ---------------------------------------------------------------------------------

    def prompt(self, row: dict[str, Any]) -> str:
        question_type = row["question_type"]
        if question_type in NA_QUESTION_TYPES:
            return f"{PRE_PROMPT}\n{row['question']}\n{NA_POST_PROMPT}"
        options = "Options:\n" + "\n".join(str(o) for o in (row.get("options") or []))
        return "\n".join([PRE_PROMPT, str(row["question"]), options, MCA_POST_PROMPT])

    def task_from_row(self, values: dict[str, Any], *, images: list[str] | None = None,
                      video: str | None = None) -> Task:
        row = self.raw_row(values)
        question_type = str(row["question_type"])
        if question_type not in MCA_QUESTION_TYPES + NA_QUESTION_TYPES:
            raise DataError(f"row {row.get('id')}: unknown question_type '{question_type}'",
                            hint=f"known: {', '.join(MCA_QUESTION_TYPES + NA_QUESTION_TYPES)}")
        answer = require_text(row, "ground_truth").strip()
        is_mca = question_type in MCA_QUESTION_TYPES
        options = ([_OPTION_PREFIX_RE.sub("", str(o)) for o in row.get("options") or []]
                   if is_mca else [])
        metadata = {"benchmark": self.name, "benchmark_version": self.version,
                    "question_type": question_type, "category": question_type, "row": row}
        if not is_mca:
            metadata["metric"] = "mra"
        return Task(id=str(row["id"]), data_source=self.name, question=self.prompt(row),
                    video=video, answer=answer, answer_type="choice" if is_mca else "number",
                    options=options, metadata=metadata, split="test")

    def row_media(self, row: Row, ctx: LoadContext) -> tuple[list[str], str | None]:
        dataset = str(row.values.get("dataset") or "").strip()
        scene = str(row.values.get("scene_name") or "").strip()
        if not dataset or not scene or "/" in scene or ".." in scene or "/" in dataset:
            raise DataError(f"{row.where}: bad dataset/scene_name '{dataset}'/'{scene}'",
                            hint="use the official VSI-Bench rows")
        relative = Path(dataset) / f"{scene}.mp4"
        extracted = ctx.cache_dir / self.name / "videos" / relative
        candidates = [extracted]
        if ctx.data_dir is not None:
            candidates[:0] = [ctx.data_dir / relative, ctx.data_dir / "videos" / relative]
        else:
            hf_home = Path(os.environ.get("HF_HOME", "~/.cache/huggingface")).expanduser()
            candidates.append(hf_home / "vsibench" / relative)
        for candidate in candidates:
            if candidate.is_file():
                return [], str(candidate.resolve())
        archive = self._find_zip(dataset, ctx)
        if archive is not None and self._extract(archive, dataset, scene, extracted):
            return [], str(extracted.resolve())
        raise DataError(
            f"{row.where}: video {relative} not found (looked in "
            f"{', '.join(str(c.parent) for c in candidates)}"
            + (f" and {archive}" if archive else "") + ")",
            hint="put the VSI-Bench videos in --data-dir as <dataset>/<scene_name>.mp4, or the "
                 "official <dataset>.zip files")

    def _find_zip(self, dataset: str, ctx: LoadContext) -> Path | None:
        """The official ``<dataset>.zip``: under ``--data-dir``, else fetched from the hub."""
        key = (ctx.data_dir, dataset)
        if key not in self._zips:
            self._zips[key] = self._locate_zip(dataset, ctx)
        return self._zips[key]

    def _locate_zip(self, dataset: str, ctx: LoadContext) -> Path | None:
        if ctx.data_dir is not None:
            found = sorted(ctx.data_dir.rglob(f"{dataset}.zip"))
            return found[0] if found else None
        reason = hub_unreachable_reason(self.hf_id or "", HUB_TIMEOUT_S)
        if reason is not None:
            raise no_hub_error(self.name, self.source, f"videos of {dataset}: {reason}")
        from huggingface_hub import hf_hub_download

        return Path(hf_hub_download(self.hf_id or "", f"{dataset}.zip", repo_type="dataset"))

    def _extract(self, archive: Path, dataset: str, scene: str, target: Path) -> bool:
        """Copy one scene's video out of an official zip (members are found by file name)."""
        partial = target.with_name(f".{target.name}.part")
        try:
            if archive not in self._zip_index:
                with zipfile.ZipFile(archive) as zf:
                    index: dict[str, str] = {}
                    for member in zf.namelist():
                        if member.lower().endswith(".mp4") and "__MACOSX" not in member:
                            index.setdefault(Path(member).name, member)
                    self._zip_index[archive] = index
            member = self._zip_index[archive].get(f"{scene}.mp4")
            if member is None:
                return False
            target.parent.mkdir(parents=True, exist_ok=True)
            with zipfile.ZipFile(archive) as zf, zf.open(member) as src, \
                    open(partial, "wb") as dst:
                while chunk := src.read(1 << 20):
                    dst.write(chunk)
        except (zipfile.BadZipFile, zipfile.LargeZipFile, zlib.error, EOFError,
                NotImplementedError) as exc:
            partial.unlink(missing_ok=True)
            raise DataError(f"{archive} is not a readable zip archive ({exc}), so the video of "
                            f"{dataset}/{scene} cannot be taken from it",
                            hint="download it again (it may be truncated), or put the videos "
                                 "in --data-dir as <dataset>/<scene_name>.mp4") from None
        os.replace(partial, target)
        return True

    # -- scoring ------------------------------------------------------------------------------

    def sample_score(self, task: Task, scores: dict[str, float]) -> float:
        return scores[metric_key(task.metadata["question_type"])]

    def correct_threshold(self, task: Task) -> float:
        """Numerical answers count as right from this MRA on (the paper's reward: 0.5)."""
        return 0.5 if task.metadata["question_type"] in MCA_QUESTION_TYPES else self.mra_threshold

    def score(self, task: Task, prediction: str | None) -> dict[str, float]:
        row = task.metadata["row"]
        question_type = task.metadata["question_type"]
        answer = extract_final_answer(prediction)
        if question_type in MCA_QUESTION_TYPES:
            value = 1.0 if first_word(answer).lower() == str(row["ground_truth"]).lower() else 0.0
        else:
            pred = extract_number(answer, extended=False)
            try:
                gold = float(row["ground_truth"])
            except (TypeError, ValueError):
                gold = None
            value = 0.0 if pred is None or gold is None else mean_relative_accuracy(pred, gold)
        return {metric_key(question_type): value}

    def aggregate(self, samples: list[Sample]) -> dict[str, float]:
        by_type: dict[str, list[float]] = {}
        for task, scores in samples:
            question_type = task.metadata["question_type"]
            by_type.setdefault(question_type, []).append(scores[metric_key(question_type)])
        per_type = {metric_key(t): mean(by_type[t]) for t in sorted(by_type)}
        directions = [per_type.pop(metric_key(t)) for t in REL_DIRECTION_TYPES
                      if metric_key(t) in per_type]
        if directions:
            per_type["object_rel_direction_accuracy"] = sum(directions) / len(directions)
        out = {"vsibench_overall": round(mean(per_type.values()), 6)}
        out.update({k: round(v, 6) for k, v in per_type.items()})
        return out
