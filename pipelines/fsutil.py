"""Writes that are all-or-nothing: a file or folder appears complete or not at all."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any


def _umask() -> int:
    """This process's umask, read without changing it (``os.umask`` would, for every thread)."""
    try:
        with open("/proc/self/status", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    return 0o022


def new_file_mode(path: Path) -> int:
    """The mode a file written in place of ``path`` gets: the one ``path`` has, else what
    ``open()`` would give a new file (0666 less the umask), not ``mkstemp``'s 0600, which left
    reports and manifests unreadable to a web server or a colleague."""
    try:
        return path.stat().st_mode & 0o7777
    except OSError:
        return 0o666 & ~_umask()


def publish_dir_mode(path: Path) -> None:
    """Give a temporary folder from ``mkdtemp`` (0700) the mode ``mkdir`` would have given it."""
    os.chmod(path, 0o777 & ~_umask())


def atomic_write_bytes(path: str | Path, data: bytes) -> Path:
    """Write ``data`` to ``path`` through a temp file in the same folder and an atomic rename.
    A failed write (a full disk) names ``path`` in its OSError."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, new_file_mode(path))
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException as exc:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        if isinstance(exc, OSError) and exc.errno is not None and exc.filename is None:
            raise OSError(exc.errno, exc.strerror, str(path)) from exc
        raise
    return path


def atomic_write_text(path: str | Path, text: str) -> Path:
    """Write ``text`` (UTF-8) to ``path`` as :func:`atomic_write_bytes` does."""
    return atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_json(path: str | Path, obj: Any) -> Path:
    return atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=False, default=str) + "\n")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale_temp_dirs(path: Path) -> list[Path]:
    """Remove the temp folders that earlier writers of ``path`` left behind when they were
    killed (SIGKILL, a power cut): ``.<name>.<pid>.<random>.tmp`` whose process is gone."""
    removed = []
    prefix = f".{path.name}."
    for tmp in path.parent.glob(f"{glob_escape(prefix)}*.tmp"):
        middle = tmp.name[len(prefix):-len(".tmp")]
        pid = middle.split(".", 1)[0]
        if tmp.is_dir() and pid.isdigit() and "." in middle and not _pid_alive(int(pid)):
            shutil.rmtree(tmp, ignore_errors=True)
            removed.append(tmp)
    return removed


def glob_escape(text: str) -> str:
    """``text`` with glob wildcards escaped."""
    import glob

    return glob.escape(text)


@contextlib.contextmanager
def atomic_dir(path: str | Path, *, overwrite: bool = False) -> Iterator[Path]:
    """Yield a temp folder beside ``path``; on success it is renamed to ``path``.

    On an exception (Ctrl-C and, in the CLI, SIGTERM included) the temp folder is removed and
    ``path`` is untouched, so a crashed or interrupted writer never leaves a half-written output
    behind. The temp folder's name carries the writer's pid: one left by a writer killed outright
    is removed by the next writer of the same ``path``.

    An existing empty folder at ``path`` (one made beforehand, e.g. by `mkdir`) holds nothing to
    lose, so it is replaced even without ``overwrite``; anything else there needs ``overwrite``.
    """
    path = Path(path)
    made = [d for d in (path.parent, *path.parent.parents) if not d.exists()]
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temp_dirs(path)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.{os.getpid()}.", suffix=".tmp",
                                dir=path.parent))
    try:
        publish_dir_mode(tmp)
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        for folder in made:  # deepest first; only the empty folders made for this output
            with contextlib.suppress(OSError):
                folder.rmdir()
        raise
    if path.is_dir() and not path.is_symlink() and not any(path.iterdir()):
        path.rmdir()  # only now, so that a failed write leaves the folder as it was
    if path.exists():
        if not overwrite:
            shutil.rmtree(tmp, ignore_errors=True)
            raise FileExistsError(f"{path} exists")
        old = path.with_name(f".{path.name}.old")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(path, old)
        os.replace(tmp, path)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, path)


WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
_CHUNK = 1 << 20


def weights_fingerprint(model: str | Path) -> str | None:
    """A short digest of a local model folder's weight files; None for anything else (a hub id,
    a served model), whose identity the caller cannot check.

    Small files (up to 64 MiB) are hashed whole. Larger ones contribute their size, their first
    and last MiB and three MiB from the middle: retraining rewrites every tensor, so any of them
    changes, while a 15 GB checkpoint is not read in full.
    """
    import hashlib

    root = Path(model)
    if not root.is_dir():
        return None
    # Top level only, as from_pretrained reads it: checkpoint-N/ folders inside do not count.
    files = sorted(p for p in root.iterdir() if p.is_file() and p.name.endswith(WEIGHT_SUFFIXES))
    if not files:
        return None
    digest = hashlib.sha256()
    for path in files:
        size = path.stat().st_size
        digest.update(f"{path.name}\0{size}\0".encode())
        with path.open("rb") as fh:
            if size <= 64 * _CHUNK:
                for block in iter(lambda: fh.read(8 * _CHUNK), b""):
                    digest.update(block)
                continue
            for offset in (0, size // 4, size // 2, 3 * size // 4, size - _CHUNK):
                fh.seek(offset)
                digest.update(fh.read(_CHUNK))
    return digest.hexdigest()[:16]


def keep_failed_log(log: Path, out: Path) -> Path:
    """A copy of a failed merge's ``log`` beside ``out``, where the error can point (the log was
    written in the output's temp folder, which goes with the failure)."""
    kept = out.parent / f"{out.name}.merge-failed.log"
    shutil.copy(log, kept)
    return kept
