"""A trajectory: everything one episode did, serialisable, plus the token trace RL trains on."""

from __future__ import annotations

import copy
import hashlib
import io
import json
import re
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Literal

from pipelines.core.records import Conversation, Message

SCHEMA_VERSION = 1
StopReason = Literal["answered", "max_turns", "context_overflow", "image_limit",
                     "no_code_nor_answer", "tool_error", "prompt_too_long"]
STOP_REASONS: tuple[str, ...] = StopReason.__args__  # type: ignore[attr-defined]
# Stops by a limit of the environment (turns, context / response tokens), not by the model:
# what over-turn masking (`rl.mask_truncated`) keeps out of the loss.
TRUNCATED_STOPS = frozenset({"max_turns", "context_overflow"})


_PLAIN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}")


def media_stem(conv_id: str) -> str:
    """The start of a conversation's image file names: its id where that is a plain file name, a
    hash of it otherwise (an id from a dataset may hold ``/``, start with ``..`` or be too long
    for a file name)."""
    if _PLAIN_NAME.fullmatch(conv_id):
        return conv_id
    return "conv-" + hashlib.sha256(conv_id.encode()).hexdigest()[:16]


@dataclass
class ToolResult:
    status: str
    stdout: str
    stderr: str
    duration_s: float
    n_images: int
    truncated: bool


@dataclass
class Turn:
    assistant: str                       # the model's text for this turn
    code: str | None = None              # the code it asked to run
    result: ToolResult | None = None     # what the sandbox returned
    observation: list[dict] | None = None  # the interpreter turn's content parts (no pixels)
    image_indices: list[int] = field(default_factory=list)  # into Trajectory.images
    finish: str = ""                     # why generation stopped: code | eos | length


@dataclass
class TokenTrace:
    """What the policy saw and produced, token for token (in-process policies only)."""

    input_ids: list[int]
    prompt_len: int
    response_mask: list[int]   # over input_ids[prompt_len:]; 1 exactly on model tokens
    logprobs: list[float]      # one per model token (sampling-time log-probs)
    images: list[Any]          # PIL images in context order, as resized for the model
    # One per model token when tokens were sampled at different temperatures
    # (`agent.code_temperature`); empty: every token at the rollout temperature.
    temperatures: list[float] = field(default_factory=list)


@dataclass
class Trajectory:
    task_id: str
    data_source: str
    variant: str
    prompt_version: str
    prompt_hash: str
    mode: str
    prompt: list[dict] = field(default_factory=list)  # first user turn; images as {"type": "image", "index": i}
    turns: list[Turn] = field(default_factory=list)
    final_answer: str | None = None
    raw_answer: str | None = None
    stop_reason: StopReason | None = None
    tool_calls: int = 0
    successful_calls: int = 0
    failed_calls: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    observation_tokens: int = 0
    visual_tokens: int = 0
    generation_s: float = 0.0
    tool_s: float = 0.0
    total_s: float = 0.0
    sample_index: int = 0                 # rollout number within its group
    group_index: int = 0                  # position of the task in the request
    request_usage: dict[str, float] | None = None  # remote policies: tokens billed, cost if reported
    images: list[Any] = field(default_factory=list, repr=False)  # PIL: prompt images, then figures
    trace: TokenTrace | None = field(default=None, repr=False)

    @property
    def num_turns(self) -> int:
        return len(self.turns)

    @property
    def produced_image(self) -> bool:
        return any(t.image_indices for t in self.turns)

    @property
    def answer_chars(self) -> int:
        return len(self.raw_answer or "")

    def to_json(self) -> dict[str, Any]:
        """Everything but pixels and the token trace, with a schema version."""
        # Field by field: asdict() would deep-copy the PIL images and the token trace first.
        data = {f.name: getattr(self, f.name) for f in fields(self)
                if f.name not in ("images", "trace")}
        data["prompt"] = copy.deepcopy(self.prompt)
        data["turns"] = [asdict(t) for t in self.turns]
        data["schema_version"] = SCHEMA_VERSION
        data["num_turns"] = self.num_turns
        return data

    def save(self, directory: str | Path) -> Path:
        """Write ``trajectory.json`` and the images as ``image_<i>.png`` into ``directory``."""
        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        data = self.to_json()
        data["image_files"] = []
        for i, img in enumerate(self.images):
            name = f"image_{i}.png"
            img.save(out / name)
            data["image_files"].append(name)
        (out / "trajectory.json").write_text(json.dumps(data, indent=2, default=str) + "\n")
        return out / "trajectory.json"

    @classmethod
    def load(cls, directory: str | Path, *, images: bool = True) -> Trajectory:
        """The trajectory :meth:`save` wrote into ``directory`` (with ``images``, opened from its
        PNGs; never the token trace)."""
        from PIL import Image

        root = Path(directory)
        data = json.loads((root / "trajectory.json").read_text(encoding="utf-8"))
        names = {f.name for f in fields(cls)} - {"images", "trace", "turns"}
        traj = cls(**{k: v for k, v in data.items() if k in names})
        for t in data.get("turns", []):
            result = ToolResult(**t["result"]) if t.get("result") else None
            traj.turns.append(Turn(**{**t, "result": result}))
        for name in data.get("image_files", []) if images else []:
            with Image.open(root / name) as img:
                img.load()
                traj.images.append(img.convert("RGB"))
        return traj

    def to_conversation(self, conv_id: str, media_dir: Path, rel_prefix: str = "") -> Conversation:
        """The trajectory as an SFT conversation; images are written to ``media_dir`` as PNG.

        ``rel_prefix`` is how the conversation file refers to ``media_dir`` (e.g. ``media/``).
        """
        media_dir.mkdir(parents=True, exist_ok=True)
        paths: list[str] = []
        stem = media_stem(conv_id)

        def text_of(parts: list[dict]) -> str:
            out = []
            for p in parts:
                if p.get("type") == "text":
                    out.append(p["text"])
                else:
                    idx = p["index"]
                    name = f"{stem}_{idx}.png"
                    buf = io.BytesIO()
                    self.images[idx].save(buf, format="PNG")
                    (media_dir / name).write_bytes(buf.getvalue())
                    paths.append(rel_prefix + name)
                    out.append("<image>")
            return "".join(out)

        messages = [Message(role="user", content=text_of(self.prompt))]
        for turn in self.turns:
            messages.append(Message(role="assistant", content=turn.assistant))
            if turn.observation is not None:
                messages.append(Message(role="user", content=text_of(turn.observation)))
        return Conversation(id=conv_id, data_source=self.data_source, messages=messages,
                            images=paths, metadata={"task_id": self.task_id,
                                                    "prompt_version": self.prompt_version,
                                                    "stop_reason": self.stop_reason})
