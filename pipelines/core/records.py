"""The canonical task record, shared by synthetic data, real datasets, RL prompts and benchmarks.

A dataset is a folder holding ``tasks.jsonl`` (one :class:`Task` per line) and the media it
points to (conventionally under ``media/``). Media paths in a record are relative to the folder
of the JSONL file, so a dataset folder can be moved or copied as a whole; absolute paths are
allowed for data that lives elsewhere.

Fields
------
``id``           unique within the dataset.
``data_source``  where it came from (``synth/image-search``, ``vstar``, ``vsibench`` ...); the
                 reward and judge pick few-shot examples by it.
``question``     the question text as the user asks it (no prompt template, no placeholders).
``images``       image paths (input images; the prompt template decides whether they enter the
                 model's context or only the sandbox).
``video``        one video path, or None.
``answer``       the gold answer as text (a choice letter, a number, a LaTeX expression ...).
``answer_type``  ``choice`` | ``number`` | ``text`` | ``math``: selects the verifier.
``options``      option texts for ``choice`` (option i has letter ``chr(65 + i)``).
``metadata``     free-form; keys with a meaning: ``metric`` (``"mra"`` scores a ``number`` with
                 mean relative accuracy, VSI-Bench style), ``category``, ``question_type``,
                 ``benchmark`` fields needed by a benchmark's official scorer.
``split``        ``train`` | ``heldout`` | ``test``.

A multi-turn conversation for SFT (our own cold-start trajectories, or imported SFT data) is a
:class:`Conversation`, stored the same way (``conversations.jsonl`` + media): ``messages`` alternate
``user`` / ``assistant`` (interpreter turns are ``user`` turns), each image is one ``<image>``
placeholder in the text, in the order of ``images``.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from pipelines.errors import DataError
from pipelines.fsutil import atomic_write_text

AnswerType = Literal["choice", "number", "text", "math"]
TASKS_FILE = "tasks.jsonl"
CONVERSATIONS_FILE = "conversations.jsonl"
IMAGE_PLACEHOLDER = "<image>"
VIDEO_PLACEHOLDER = "<video>"


class Task(BaseModel):
    """One verifiable question about images or a video."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    id: str = Field(min_length=1)
    data_source: str = Field(min_length=1)
    question: str = Field(min_length=1)
    images: list[str] = []
    video: str | None = None
    answer: str
    answer_type: AnswerType
    options: list[str] = []
    metadata: dict[str, Any] = {}
    split: str = "train"

    @field_validator("answer")
    @classmethod
    def _answer_not_empty(cls, v: str) -> str:
        if not str(v).strip():
            raise ValueError("answer is empty")
        return v

    def media_paths(self, root: str | Path) -> list[Path]:
        """Absolute paths of this task's images and video, resolved against ``root``."""
        base = Path(root)
        paths = [Path(p) if Path(p).is_absolute() else base / p for p in self.images]
        if self.video:
            paths.append(Path(self.video) if Path(self.video).is_absolute() else base / self.video)
        return paths

    def image_paths(self, root: str | Path) -> list[Path]:
        base = Path(root)
        return [Path(p) if Path(p).is_absolute() else base / p for p in self.images]

    def video_path(self, root: str | Path) -> Path | None:
        if not self.video:
            return None
        return Path(self.video) if Path(self.video).is_absolute() else Path(root) / self.video

    @property
    def modality(self) -> Literal["image", "video", "text"]:
        return "video" if self.video else ("image" if self.images else "text")


@dataclass
class ReadReport:
    """What a validating read saw: rows read, kept, and skipped by reason (with locations)."""

    path: str
    read: int = 0
    kept: int = 0
    skipped: dict[str, int] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)

    def skip(self, reason: str, where: str, detail: str) -> None:
        self.skipped[reason] = self.skipped.get(reason, 0) + 1
        if len(self.problems) < 100:
            self.problems.append(f"{where}: {detail}")

    def as_dict(self) -> dict[str, Any]:
        return {"path": self.path, "read": self.read, "kept": self.kept,
                "skipped": dict(self.skipped), "problems": list(self.problems)}


def iter_jsonl(path: str | Path) -> Iterator[tuple[int, Any | json.JSONDecodeError]]:
    """Yield ``(line_number, parsed object or the JSON error)`` for each non-blank line.

    A UTF-8 byte-order mark at the start of the file is accepted; a line that is not UTF-8 is
    reported like malformed JSON (a ``JSONDecodeError`` whose ``msg`` says which byte).
    """
    try:
        fh = open(path, "rb")  # noqa: SIM115 - closed below; decoded line by line
    except OSError as exc:
        raise DataError(f"cannot read {path} ({exc.strerror})", hint="check its permissions") from None
    with fh:
        for number, raw in enumerate(fh, start=1):
            if number == 1 and raw.startswith(b"\xef\xbb\xbf"):
                raw = raw[3:]
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                yield number, json.JSONDecodeError(
                    f"not UTF-8 text: byte 0x{raw[exc.start]:02x}", raw.decode("latin-1"),
                    exc.start)
                continue
            if not line.strip():
                continue
            try:
                yield number, json.loads(line)
            except json.JSONDecodeError as exc:
                yield number, exc


def read_tasks(path: str | Path, *, strict: bool = False,
               check_media: bool = True) -> tuple[list[Task], ReadReport]:
    """Read and validate a tasks JSONL file (or a dataset folder holding ``tasks.jsonl``).

    Each bad row (malformed JSON, a schema error, missing media, an empty answer) is reported
    with file and line. With ``strict`` the first one raises :class:`DataError`; otherwise it
    is skipped and counted in the returned :class:`ReadReport`.
    """
    p = Path(path)
    if p.is_dir():
        p = p / TASKS_FILE
    if not p.is_file():
        raise DataError(f"tasks file not found: {p}",
                        hint="run `pyvision data synth` or `pyvision data import` first")
    root = p.parent
    report = ReadReport(str(p))
    tasks: list[Task] = []
    seen: set[str] = set()

    def bad(reason: str, where: str, detail: str) -> None:
        if strict:
            raise DataError(f"{where}: {detail}", hint=f"fix or remove the row (`pyvision data "
                            f"validate {p}` lists every bad row)")
        report.skip(reason, where, detail)

    for number, obj in iter_jsonl(p):
        report.read += 1
        where = f"{p}:{number}"
        if isinstance(obj, Exception):
            bad("malformed_json", where, f"malformed JSON ({obj.msg} at column {obj.colno})")
            continue
        try:
            task = Task.model_validate(obj)
        except ValidationError as exc:
            e = exc.errors()[0]
            loc = ".".join(str(x) for x in e["loc"]) or "row"
            reason = "empty_answer" if loc == "answer" else "invalid_row"
            bad(reason, where, f"invalid field '{loc}': {e['msg']}")
            continue
        if task.id in seen:
            bad("duplicate_id", where, f"duplicate id '{task.id}'")
            continue
        if check_media:
            missing = [str(m) for m in task.media_paths(root) if not m.is_file()]
            if missing:
                bad("missing_media", where, f"missing media file {missing[0]}")
                continue
        if task.answer_type == "choice" and task.options and not _choice_in_range(task):
            bad("invalid_row", where,
                f"choice answer '{task.answer}' is not a letter of its {len(task.options)} options")
            continue
        seen.add(task.id)
        tasks.append(task)
    report.kept = len(tasks)
    return tasks, report


def _choice_in_range(task: Task) -> bool:
    a = task.answer.strip().strip("()").upper()
    return len(a) == 1 and 0 <= ord(a) - 65 < len(task.options)


def write_tasks(path: str | Path, tasks: Iterable[Task]) -> Path:
    """Write tasks as JSONL atomically (a reader never sees a half-written file)."""
    text = "".join(t.model_dump_json() + "\n" for t in tasks)
    return atomic_write_text(path, text)


class Message(BaseModel):
    """One chat message; images appear as ``<image>`` placeholders in ``content``."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    role: Literal["user", "assistant"]
    content: str


class Conversation(BaseModel):
    """A multi-turn SFT example in the PyVision protocol."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    id: str = Field(min_length=1)
    data_source: str = Field(min_length=1)
    messages: list[Message] = Field(min_length=2)
    images: list[str] = []
    videos: list[str] = []
    metadata: dict[str, Any] = {}

    def problems(self, root: str | Path | None = None) -> list[str]:
        """What makes this conversation unusable for SFT (empty list when it is fine)."""
        out = []
        if self.messages[0].role != "user":
            out.append("first message is not from the user")
        for a, b in zip(self.messages, self.messages[1:]):
            if a.role == b.role:
                out.append(f"two consecutive '{a.role}' messages")
                break
        if self.messages[-1].role != "assistant":
            out.append("last message is not from the assistant")
        n_img = sum(m.content.count(IMAGE_PLACEHOLDER) for m in self.messages)
        if n_img != len(self.images):
            out.append(f"{n_img} {IMAGE_PLACEHOLDER} placeholders but {len(self.images)} images")
        n_vid = sum(m.content.count(VIDEO_PLACEHOLDER) for m in self.messages)
        if n_vid != len(self.videos):
            out.append(f"{n_vid} {VIDEO_PLACEHOLDER} placeholders but {len(self.videos)} videos")
        if root is not None:
            base = Path(root)
            for p in [*self.images, *self.videos]:
                full = Path(p) if Path(p).is_absolute() else base / p
                if not full.is_file():
                    out.append(f"missing media file {full}")
                    break
        return out


def read_conversations(path: str | Path, *, strict: bool = False,
                       check_media: bool = True) -> tuple[list[Conversation], ReadReport]:
    """Read and validate a conversations JSONL file (or a folder holding one)."""
    p = Path(path)
    if p.is_dir():
        p = p / CONVERSATIONS_FILE
    if not p.is_file():
        raise DataError(f"conversations file not found: {p}",
                        hint="run `pyvision data trajectories` or `pyvision data import` first")
    report = ReadReport(str(p))
    out: list[Conversation] = []
    for number, obj in iter_jsonl(p):
        report.read += 1
        where = f"{p}:{number}"

        def bad(reason: str, detail: str) -> None:
            if strict:  # `where` is this row's: bad() is called within the iteration
                raise DataError(f"{where}: {detail}",  # noqa: B023
                                hint=f"fix or remove the row (`pyvision data validate {p}` "
                                     "lists every bad row)")
            report.skip(reason, where, detail)  # noqa: B023

        if isinstance(obj, Exception):
            bad("malformed_json", f"malformed JSON ({obj.msg} at column {obj.colno})")
            continue
        try:
            conv = Conversation.model_validate(obj)
        except ValidationError as exc:
            e = exc.errors()[0]
            loc = ".".join(str(x) for x in e["loc"]) or "row"
            bad("invalid_row", f"invalid field '{loc}': {e['msg']}")
            continue
        problems = conv.problems(p.parent if check_media else None)
        if problems:
            reason = ("missing_media" if problems[0].startswith("missing media") else
                      "placeholder_mismatch" if "placeholders" in problems[0] else "invalid_row")
            bad(reason, problems[0])
            continue
        out.append(conv)
    report.kept = len(out)
    return out, report


def write_conversations(path: str | Path, conversations: Iterable[Conversation]) -> Path:
    return atomic_write_text(path, "".join(c.model_dump_json() + "\n" for c in conversations))
