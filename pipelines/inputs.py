"""Checks of what a user passes in, made before anything is written.

A command checks its inputs (text files, model folders, output folders, the store path) first, so
that a bad one ends in one line naming it (exit 2) and leaves nothing behind: no store, no run
directory, no half-written output. Everything here is cheap and imports no ML library: a model
folder is checked by reading ``config.json`` and the safetensors headers, not by loading it.
"""

from __future__ import annotations

import json
import os
import re
import struct
import tempfile
import threading
from pathlib import Path
from typing import Any

from pipelines.errors import UserError, decode_utf8, malformed_json, require_file

_HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*")
_MAX_SAFETENSORS_HEADER = 100 * 1024 * 1024  # the format's own limit
WEIGHT_GLOBS = ("*.safetensors", "*.bin")


# -- text ------------------------------------------------------------------------------------------


def read_text(path: str | Path, what: str, hint: str | None = None) -> str:
    """The UTF-8 text of the file ``path`` (``what`` names it in errors: missing, a folder, not
    UTF-8, unreadable)."""
    p = require_file(path, what, hint)
    try:
        data = p.read_bytes()
    except OSError as exc:
        raise UserError(f"cannot read {what} {p} ({exc.strerror})",
                        hint="check its permissions") from None
    return decode_utf8(data, p)


def read_json(path: str | Path, what: str, hint: str | None = None, *,
              error: type[UserError] = UserError) -> Any:
    """The JSON value in the file ``path``: :func:`read_text`'s errors, and JSON that does not
    parse as ``error`` at its line and column, with ``hint``."""
    text = read_text(path, what, hint)
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise error(f"{path}:{exc.lineno}: {malformed_json(exc)}", hint=hint) from None


# -- output locations ----------------------------------------------------------------------------


def _nearest_existing(path: Path) -> Path:
    for candidate in (path, *path.parents):
        if candidate.exists():
            return candidate
    return Path("/")


def check_writable_dir(path: str | Path, what: str) -> Path:
    """``path`` is a folder that exists or can be created, and can be written to; nothing is
    created (a probe file in the nearest existing folder is removed at once)."""
    p = Path(path).expanduser()
    if p.exists() and not p.is_dir():
        raise UserError(f"{what} {p} is a file, not a folder", hint="pass a folder path")
    base = _nearest_existing(p)
    if not base.is_dir():
        raise UserError(f"cannot create {what} {p}: {base} is a file",
                        hint="pass a path whose parent folders are folders")
    try:
        fd, probe = tempfile.mkstemp(prefix=".pyvision-probe-", dir=base)
    except OSError as exc:
        raise UserError(f"cannot write {what} {p}: {base} is not writable ({exc.strerror})",
                        hint="pass a folder you can write to") from None
    os.close(fd)
    os.unlink(probe)
    return p


def check_output_file(path: str | Path, what: str) -> Path:
    """``path`` can be written as a file: not a folder, its folder writable (or creatable)."""
    p = Path(path).expanduser()
    if p.is_dir():
        raise UserError(f"{what} {p} is a folder, not a file", hint="pass a file path")
    check_writable_dir(p.parent, f"the folder of {what}")
    if p.exists() and not os.access(p, os.W_OK):
        raise UserError(f"{what} {p} is read-only", hint="pass a file you can write to")
    return p


def _size(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"  # pragma: no cover


def check_free_space(path: str | Path, need: int, what: str, hint: str) -> None:
    """The disk that will hold ``path`` has ``need`` bytes free (checked before writing)."""
    import shutil

    base = _nearest_existing(Path(path).expanduser())
    free = shutil.disk_usage(base).free
    if need > free:
        raise UserError(f"{what} need about {_size(need)} of disk, but {base} has {_size(free)} "
                        "free", hint=hint)


# -- the store -----------------------------------------------------------------------------------


def check_store_path(path: Path, *, write: bool) -> None:
    """The store at ``path`` can be opened (read-only, or for writing), without creating it."""
    hint = "pass --store FILE (or set PYVISION_STORE) to another DuckDB file"
    if path.is_dir():
        raise UserError(f"store {path} is a folder, not a DuckDB file", hint=hint)
    if path.exists():
        try:
            with path.open("rb") as fh:
                head = fh.read(12)
        except OSError as exc:
            raise UserError(f"cannot read the store {path} ({exc.strerror})", hint=hint) from None
        if len(head) < 12 or head[8:12] != b"DUCK":
            raise UserError(f"{path} is not a DuckDB database (the store is one)", hint=hint)
        if write:
            try:
                os.close(os.open(path, os.O_RDWR))
            except OSError as exc:
                raise UserError(f"store {path} is read-only ({exc.strerror})", hint=hint) from None
            folder = path.parent.resolve()
            if not os.access(folder, os.W_OK | os.X_OK):
                raise UserError(f"the store's folder {folder} is read-only (DuckDB writes its "
                                "journal there)", hint=hint)
        return
    if not write:
        raise UserError(f"store not found: {path}",
                        hint="run a stage first, or pass --store / set PYVISION_STORE")
    check_writable_dir(path.parent, "the store's folder")


# -- models --------------------------------------------------------------------------------------


def safetensors_problem(path: Path) -> str | None:
    """Why ``path`` is not a complete safetensors file (header and sizes), or None."""
    try:
        size = path.stat().st_size
        with path.open("rb") as fh:
            head = fh.read(8)
            if len(head) < 8:
                return f"{path.name} is truncated ({size} bytes)"
            (n,) = struct.unpack("<Q", head)
            if n < 2 or n > _MAX_SAFETENSORS_HEADER or 8 + n > size:
                return f"{path.name} has no valid safetensors header"
            header = json.loads(fh.read(n).decode("utf-8"))
    except OSError as exc:
        return f"{path.name} cannot be read ({exc.strerror})"
    except (UnicodeDecodeError, json.JSONDecodeError):
        return f"{path.name} has no valid safetensors header"
    if not isinstance(header, dict):
        return f"{path.name} has no valid safetensors header"
    end = 0
    for name, info in header.items():
        if name == "__metadata__":
            continue
        offsets = info.get("data_offsets") if isinstance(info, dict) else None
        if not (isinstance(offsets, list) and len(offsets) == 2
                and all(isinstance(o, int) for o in offsets) and 0 <= offsets[0] <= offsets[1]):
            return f"{path.name}: tensor '{name}' has no valid data offsets"
        end = max(end, offsets[1])
    if 8 + n + end != size:
        return (f"{path.name} is truncated or corrupt (its header describes {8 + n + end} bytes, "
                f"the file has {size})")
    return None


# What a model folder may hold beside config.json and the weights, all JSON.
_SIDECAR_JSON = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                 "preprocessor_config.json", "processor_config.json", "video_preprocessor_config.json",
                 "generation_config.json", "chat_template.json")


def check_model(model: str, what: str = "model") -> None:
    """``model`` is a server URL, a hub id, or a local folder that looks loadable: a
    ``config.json`` object naming its ``model_type``, tokenizer and processor files that parse,
    and complete weight files (checked without loading anything)."""
    if model.startswith(("http://", "https://")):
        return
    p = Path(model).expanduser()
    fix = "pass a model folder (config.json and weights), a hub id (org/name) or a server URL"
    if not p.exists():
        if _HUB_ID.fullmatch(model):
            return  # a hub id: transformers resolves it (from the cache when offline)
        raise UserError(f"{what} not found: {model}", hint=fix)
    if not p.is_dir():
        raise UserError(f"{what} {p} is a file, not a model folder", hint=fix)
    config = p / "config.json"
    if not config.is_file():
        empty = not any(p.iterdir())
        raise UserError(f"{what} folder {p} {'is empty' if empty else 'has no config.json'}",
                        hint=fix)
    parsed = read_json(config, f"{what}'s config", hint="restore the model's config.json")
    if not isinstance(parsed, dict):
        raise UserError(f"{config} is not a JSON object", hint="restore the model's config.json")
    if not isinstance(parsed.get("model_type"), str):
        raise UserError(f"{config} has no 'model_type' (transformers picks the model class by it)",
                        hint="restore the model's config.json")
    # The tokenizer's and processor's files, read before anything is loaded or written: a torn
    # copy is a located error here, not transformers' traceback after a stage has started.
    for name in _SIDECAR_JSON:
        if (p / name).is_file():
            read_json(p / name, f"{what}'s {name}", hint="copy the model folder again")
    if (p / "chat_template.jinja").is_file():
        read_text(p / "chat_template.jinja", f"{what}'s chat template",
                  hint="copy the model folder again")
    weights = sorted(f for pattern in WEIGHT_GLOBS for f in p.glob(pattern) if f.is_file())
    if not weights:
        raise UserError(f"{what} folder {p} has no weights (*.safetensors or *.bin)", hint=fix)
    index = p / "model.safetensors.index.json"
    if index.is_file():
        try:
            shards = set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values())
        except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError,
                AttributeError):
            raise UserError(f"{index} is not a valid safetensors index",
                            hint="restore the model's files") from None
        missing = sorted(s for s in shards if not (p / s).is_file())
        if missing:
            raise UserError(f"{what} folder {p} lacks the weight file {missing[0]} that its "
                            "index names", hint="copy the whole model folder again")
    for f in weights:
        if f.suffix == ".safetensors" and (problem := safetensors_problem(f)):
            raise UserError(f"{what} folder {p}: {problem}",
                            hint="copy or save the model again")


# fd 2 is the process's, not a thread's: one quiet open at a time. Two overlapping ones would
# each save what fd 2 points at, and the later save is /dev/null; restored last, it silenced
# the process's stderr for good (every progress line and error after the first videos opened
# on the agent loop's threads).
_FD2_LOCK = threading.Lock()


def open_video(path: str | Path, *, quiet: bool = False) -> Any:
    """A decord ``VideoReader`` of ``path``.

    ``quiet``: decord's failure comes back as the exception only. Its log level does not reach
    the C++ ``LOG(ERROR)`` of a file that will not open, which would otherwise put a line of its
    own above a one-line error; so fd 2 points at /dev/null for the open. That is the whole
    process's stderr, whatever thread writes to it: only checks of a command's inputs, made
    before its work starts (and nothing else prints), open quietly; the agent loop's threads
    open videos that were checked already."""
    import decord
    import decord.logging

    decord.logging.set_level(decord.logging.QUIET)
    if not quiet:
        return decord.VideoReader(str(path))
    with _FD2_LOCK:
        saved, null = os.dup(2), os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(null, 2)
            return decord.VideoReader(str(path))
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            os.close(null)
