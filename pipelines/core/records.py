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
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from pipelines.errors import DataError, malformed_json
from pipelines.fsutil import atomic_write_text

AnswerType = Literal["choice", "number", "text", "math"]
TASKS_FILE = "tasks.jsonl"
CONVERSATIONS_FILE = "conversations.jsonl"
_Row = TypeVar("_Row", bound=BaseModel)
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


def _is_file(path: Path) -> bool:
    """``path.is_file()``, False (not an error) for a path the system cannot even look up: a
    name past the file system's length limit, a loop of links."""
    try:
        return path.is_file()
    except OSError:
        return False


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
            try:  # without its line break: an error at the line's end names this line's column
                yield number, json.loads(line.rstrip("\r\n"))
            except json.JSONDecodeError as exc:
                yield number, exc
            except RecursionError:
                yield number, json.JSONDecodeError("nested too deeply", line, 0)


_MISSING_HINTS = {
    TASKS_FILE: "run `pyvision data synth` or `pyvision data import` first",
    CONVERSATIONS_FILE: "run `pyvision data trajectories` or `pyvision data import` first",
}


def rows_file(path: str | Path, file_name: str) -> Path:
    """The JSONL file ``path`` names: itself, or ``file_name`` (``TASKS_FILE``,
    ``CONVERSATIONS_FILE``) in it when it is a folder; DataError when there is none."""
    p = Path(path)
    if p.is_dir():
        p = p / file_name
    if not p.is_file():
        raise DataError(f"{file_name.split('.')[0]} file not found: {p}",
                        hint=_MISSING_HINTS[file_name])
    return p


def _read_rows(path: str | Path, file_name: str, model: type[_Row], *, strict: bool,
               check: Callable[[_Row, Path], tuple[str, str] | None],
               field_reason: Callable[[str], str] = lambda loc: "invalid_row",
               ) -> tuple[list[_Row], ReadReport]:
    """The rows of a JSONL file (or of ``file_name`` in a folder) that parse, validate as
    ``model`` and pass ``check(row, folder)`` (None, or a ``(reason, detail)`` finding).

    Each bad row is reported with file and line: with ``strict`` the first one raises
    :class:`DataError`; otherwise it is skipped and counted in the returned :class:`ReadReport`.
    """
    p = rows_file(path, file_name)
    report = ReadReport(str(p))
    rows: list[_Row] = []
    for number, obj in iter_jsonl(p):
        report.read += 1
        finding: tuple[str, str] | None
        if isinstance(obj, Exception):
            finding = ("malformed_json", malformed_json(obj))
        else:
            try:
                row = model.model_validate(obj)
            except ValidationError as exc:
                e = exc.errors()[0]
                loc = ".".join(str(x) for x in e["loc"]) or "row"
                finding = (field_reason(loc), f"invalid field '{loc}': {e['msg']}")
            else:
                finding = check(row, p.parent)
        if finding is None:
            rows.append(row)
            continue
        where = f"{p}:{number}"
        if strict:
            raise DataError(f"{where}: {finding[1]}", hint=f"fix or remove the row (`pyvision "
                            f"data validate {p}` lists every bad row)")
        report.skip(finding[0], where, finding[1])
    report.kept = len(rows)
    return rows, report


def read_tasks(path: str | Path, *, strict: bool = False,
               check_media: bool = True) -> tuple[list[Task], ReadReport]:
    """Read and validate a tasks JSONL file (or a dataset folder holding ``tasks.jsonl``).

    Each bad row (malformed JSON, a schema error, a duplicate id, missing media, an empty
    answer, a choice answer outside its options) is reported with file and line. With
    ``strict`` the first one raises :class:`DataError`; otherwise it is skipped and counted in
    the returned :class:`ReadReport`.
    """
    seen: set[str] = set()

    def check(task: Task, root: Path) -> tuple[str, str] | None:
        if task.id in seen:
            return "duplicate_id", f"duplicate id '{task.id}'"
        if check_media:
            missing = [str(m) for m in task.media_paths(root) if not _is_file(m)]
            if missing:
                return "missing_media", f"missing media file {missing[0]}"
        if task.answer_type == "choice" and task.options and not _choice_in_range(task):
            return "invalid_row", (f"choice answer '{task.answer}' is not a letter of its "
                                   f"{len(task.options)} options")
        seen.add(task.id)
        return None

    return _read_rows(path, TASKS_FILE, Task, strict=strict, check=check,
                      field_reason=lambda loc: "empty_answer" if loc == "answer" else "invalid_row")


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
                if not _is_file(full):
                    out.append(f"missing media file {full}")
                    break
        return out


def read_conversations(path: str | Path, *, strict: bool = False,
                       check_media: bool = True) -> tuple[list[Conversation], ReadReport]:
    """Read and validate a conversations JSONL file (or a folder holding one)."""

    def check(conv: Conversation, root: Path) -> tuple[str, str] | None:
        problems = conv.problems(root if check_media else None)
        if not problems:
            return None
        reason = ("missing_media" if problems[0].startswith("missing media") else
                  "placeholder_mismatch" if "placeholders" in problems[0] else "invalid_row")
        return reason, problems[0]

    return _read_rows(path, CONVERSATIONS_FILE, Conversation, strict=strict, check=check)


def write_conversations(path: str | Path, conversations: Iterable[Conversation]) -> Path:
    return atomic_write_text(path, "".join(c.model_dump_json() + "\n" for c in conversations))
