"""The sandbox that runs model-written Python: persistent, fast, and isolated.

Model-written code is hostile input. Each trajectory gets a :class:`Sandbox`: a persistent Python
runtime (numpy as ``np``, PIL's ``Image``, matplotlib's ``plt`` with the Agg backend, ``decord`` for
video) holding the task's media as ``image_clue_0``, ``image_clue_1``, ... or ``video_clue_0``.
``plt.show()``, ``img.show()`` and ``display(obj)`` return images (at most
``max_images_per_call``, larger than :data:`SHOWN_IMAGE_MAX_PIXELS` downscaled, each with one
note in the output); printed output is kept up to ``max_output_chars`` (head and tail, with a
marker); every call ends in an :class:`ExecResult` with status ``ok | error | timeout | oom |
crashed``. A call that times out, crashes or is killed still returns what the code printed before
(the output lives in memory the host shares), then the reason ("killed after 3 s", "killed by
SIGSEGV").

How it is fast: one *zygote* process per host process imports numpy, PIL, matplotlib and decord
once; each sandbox is a fork of it, so starting one costs milliseconds instead of the second a
cold ``import matplotlib`` takes.

What is isolated (``isolation: bwrap``, the default where bubblewrap works)
- The zygote runs under bubblewrap in new pid, network, IPC and UTS namespaces, as an unprivileged
  uid (65534; a root host is dropped to it so the kernel enforces the process limit), with an
  empty environment (no secrets), a new session (no terminal injection), and a filesystem that
  holds only the Python runtime and system libraries, read-only, plus ``/dev`` basics and a tmpfs.
  The host's home, the project, the data and every other file are simply absent.
- Each sandbox then leaves the zygote's namespaces: its own user, mount, pid, network, IPC and UTS
  namespaces, a private size-limited ``/tmp``, an empty ``/proc``, all capabilities dropped,
  ``no_new_privs``, non-dumpable. It cannot see, signal, trace or connect to other sandboxes, the
  zygote or the host process; it has no network interface but a down loopback.
- rlimits per sandbox: address space (``oom``), CPU seconds, processes, file size, open files, no
  core dumps. A wall-clock timeout kills the sandbox's pid 1, which takes every process it
  started with it (double-forked daemons included).
- Media reaches the sandbox as bytes over its socket and is decoded inside it, so a malicious image
  or video is parsed by the sandboxed process, not by the host.

What is not isolated
- The kernel is shared (a kernel exploit escapes; there is no seccomp filter).
- CPU time is limited per sandbox but not scheduled fairly between sandboxes; the host's memory is
  only protected by the per-sandbox address-space limit (no cgroup memory accounting).
- Images returned by the code are checked (raw RGB pixels whose byte count matches their
  bounded size; nothing is decoded on the host) but are the code's choice: it can show the model
  anything it can draw.

Without bubblewrap (``isolation: rlimit``, or ``auto`` when bwrap is missing or cannot create
namespaces) only the rlimits, a process-group kill and a temporary working directory apply, and a
loud warning says so: that mode is **no security boundary** (the code can read the user's files
and reach the network).
"""

from __future__ import annotations

import atexit
import contextlib
import importlib.util
import io
import json
import os
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
import uuid
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property, lru_cache
from pathlib import Path
from typing import Any, Literal, Self

from pipelines.agent.sandbox._zygote import output_buffer_size, render_output
from pipelines.config.sandbox import SandboxConfig
from pipelines.errors import DataError, UserError

Status = Literal["ok", "error", "timeout", "oom", "crashed"]
ZYGOTE_SCRIPT = Path(__file__).with_name("_zygote.py")
SANDBOX_ZYGOTE_PATH = "/opt/pyvision/zygote.py"
MAX_HEADER_BYTES = 64 * 1024 * 1024
MAX_IMAGE_BYTES = 32 * 1024 * 1024
MAX_IMAGE_PIXELS = 64 * 1024 * 1024
# Larger images are downscaled inside the sandbox before they are shown (with a note in the
# output): even incompressible RGBA pixels then fit in MAX_IMAGE_BYTES, so showing a huge image
# can neither exceed the frame limit nor cost the runtime its state.
SHOWN_IMAGE_MAX_PIXELS = 2560 * 2560
# A worker that cannot load its media writes one stderr line "sandbox worker <id>: <reason>" and
# exits with this code (as in _zygote.py, which cannot import this package).
SETUP_FAILED_EXIT = 72
SIGNAL_NAMES = {4: "SIGILL", 6: "SIGABRT", 7: "SIGBUS", 8: "SIGFPE", 9: "SIGKILL",
                11: "SIGSEGV", 24: "SIGXCPU", 25: "SIGXFSZ"}


@dataclass(frozen=True)
class ExecResult:
    """The outcome of one code call.

    ``frames`` are the shown images as RGB PIL images, already at the size the model sees them
    when the sandbox was given ``context_pixels``; they crossed from the sandbox as raw pixels.
    ``images`` are the same as PNG bytes, encoded on first use (files, JSON, thumbnails): the
    agent loop never pays for it."""

    status: Status
    stdout: str
    stderr: str
    frames: list[Any] = field(default_factory=list)
    duration_s: float = 0.0
    truncated: bool = False

    @cached_property
    def images(self) -> list[bytes]:
        out = []
        for img in self.frames:
            buf = io.BytesIO()
            img.save(buf, format="PNG")
            out.append(buf.getvalue())
        return out

    def to_json(self, image_paths: list[str] | None = None) -> dict[str, Any]:
        """JSON-ready dict; images as the given file paths (or their sizes)."""
        return {"status": self.status, "stdout": self.stdout, "stderr": self.stderr,
                "images": list(image_paths) if image_paths is not None
                else [f"<image {img.width}x{img.height}>" for img in self.frames],
                "duration_s": round(self.duration_s, 4), "truncated": self.truncated}


# -- isolation mode -------------------------------------------------------------------------------


@lru_cache(maxsize=1)
def bwrap_available() -> bool:
    """True when bubblewrap exists and can create the namespaces the sandbox uses."""
    path = shutil.which("bwrap")
    if not path:
        return False
    try:
        proc = subprocess.run([path, *(_base_bwrap_args()), "--", sys.executable, "-I", "-c", "0"],
                              capture_output=True, timeout=30, check=False)
    except (OSError, subprocess.SubprocessError):
        return False
    return proc.returncode == 0


_warned_rlimit = False


class SandboxSetupError(UserError):
    """The sandbox could not load a task's media (decord missing, a video it cannot open)."""


def isolation_mode(config: SandboxConfig | None = None) -> Literal["bwrap", "rlimit"]:
    """What ``config.isolation`` resolves to on this machine."""
    global _warned_rlimit
    cfg = config or SandboxConfig()
    if cfg.isolation == "rlimit":
        mode = "rlimit"
    elif bwrap_available():
        mode = "bwrap"
    elif cfg.isolation == "bwrap":
        raise UserError("sandbox isolation 'bwrap' was requested but bubblewrap is missing or "
                        "cannot create namespaces here",
                        hint="apt-get install bubblewrap (and enable user namespaces), or set "
                             "sandbox.isolation=auto to accept the unsafe rlimit fallback")
    else:
        mode = "rlimit"
    if mode == "rlimit" and not _warned_rlimit:
        _warned_rlimit = True
        installed = shutil.which("bwrap") is not None
        if cfg.isolation == "rlimit":
            why = "sandbox.isolation=rlimit was chosen"
            fix = ("bubblewrap is installed: use" if installed else "install bubblewrap "
                   "(apt-get install bubblewrap) and use") + " isolation auto or bwrap instead"
        elif installed:
            why = "bubblewrap is installed but cannot create namespaces here"
            fix = "enable unprivileged user namespaces for real isolation"
        else:
            why = "bubblewrap is not installed"
            fix = "install it (apt-get install bubblewrap) for real isolation"
        msg = (f"SANDBOX IS NOT A SECURITY BOUNDARY: {why}, so model-written code runs with "
               f"rlimits only and can read your files and reach the network; {fix}.")
        warnings.warn(msg, RuntimeWarning, stacklevel=2)
        from pipelines.console import err

        err.print(f"[bold red]WARNING:[/] {msg}")
    return mode


# What the runtime preloads (see _zygote._preload); their import roots must reach the zygote.
PRELOADED_MODULES = ("numpy", "matplotlib", "PIL", "scipy", "decord")


def _import_roots() -> list[str]:
    """The import-path folders the sandboxed interpreter needs, in this process's order.

    The zygote runs ``python -I``, which ignores PYTHONPATH, so libraries installed outside the
    interpreter's own site-packages (``pip install --target`` folders on PYTHONPATH, a cluster's
    module system) would be missing inside. These are the site folders on ``sys.path`` plus the
    folders that hold the preloaded libraries; never the checkout or the working directory.
    """
    needed: set[str] = set()
    for name in PRELOADED_MODULES:
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            spec = None
        if spec is None or not spec.origin:
            continue
        where = os.path.dirname(os.path.realpath(spec.origin))
        needed.add(os.path.dirname(where) if spec.submodule_search_locations else where)
    roots: list[str] = []
    for p in sys.path:
        real = os.path.realpath(p) if p else ""
        if (real and os.path.isdir(real) and real not in roots
                and ("-packages" in real or real in needed)):
            roots.append(real)
    return roots


def _runtime_paths() -> list[str]:
    """Folders the sandboxed interpreter needs, read-only: the venv, the base Python, libraries."""
    paths = {os.path.realpath(sys.prefix), os.path.realpath(sys.base_prefix),
             os.path.dirname(os.path.realpath(sys.executable)), *_import_roots()}
    for lib in ("/usr/lib", "/usr/lib64", "/usr/local/lib"):
        if os.path.isdir(lib):
            paths.add(lib)
    # Drop paths nested in others (one bind covers them).
    ordered = sorted(paths)
    return [p for p in ordered if not any(p != q and p.startswith(q + "/") for q in ordered)]


def _parent_dirs(paths: list[str]) -> list[str]:
    """World-traversable parents for bind targets (bwrap would create them 0700 as root)."""
    seen: list[str] = []
    for p in paths:
        parent = Path(p).parent
        chain = [a for a in reversed(parent.parents) if str(a) != "/"] + [parent]
        for a in chain:
            if str(a) != "/" and str(a) not in seen:
                seen.append(str(a))
    args: list[str] = []
    for d in seen:
        args += ["--perms", "0755", "--dir", d]
    return args


def _base_bwrap_args() -> list[str]:
    args = ["--die-with-parent", "--new-session", "--unshare-pid", "--unshare-net",
            "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try"]
    if os.geteuid() == 0:
        # No user namespace as root: the zygote drops to uid 65534 itself (see _zygote.py).
        args += ["--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
    else:
        args += ["--unshare-user", "--uid", "65534", "--gid", "65534"]
    # The tmpfs comes first: a runtime bound below /tmp (a checkout in a temporary folder) must
    # be mounted on top of it, not hidden by it.
    args += ["--perms", "1777", "--tmpfs", "/tmp"]
    args += _parent_dirs([*_runtime_paths(), SANDBOX_ZYGOTE_PATH])
    for p in _runtime_paths():
        args += ["--ro-bind", p, p]
    for link, target in (("/lib", "usr/lib"), ("/lib64", "usr/lib64"), ("/bin", "usr/bin")):
        if os.path.islink(link):
            args += ["--symlink", target, link]
        elif os.path.isdir(link) and link != "/bin":
            args += ["--ro-bind", link, link]
    if os.path.exists("/etc/ld.so.cache"):
        args += ["--ro-bind", "/etc/ld.so.cache", "/etc/ld.so.cache"]
    args += ["--dev", "/dev", "--proc", "/proc", "--chdir", "/tmp", "--clearenv"]
    for key, value in _sandbox_env().items():
        args += ["--setenv", key, value]
    return args


def _sandbox_env() -> dict[str, str]:
    return {"PATH": "/usr/bin:/bin", "HOME": "/tmp", "LANG": "C.UTF-8", "MPLBACKEND": "Agg",
            "MPLCONFIGDIR": "/tmp/mpl", "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1",
            "MKL_NUM_THREADS": "1", "PYTHONDONTWRITEBYTECODE": "1", "PYTHONHASHSEED": "0"}


# -- the zygote ---------------------------------------------------------------------------------


def _popen_from_lasting_thread(argv: list[str], **kwargs: Any) -> subprocess.Popen:
    """``Popen`` from a thread that lives as long as the child.

    bwrap's ``--die-with-parent`` is PR_SET_PDEATHSIG, which fires when the *thread* that forked
    the child exits: a zygote started from a short-lived thread (a ThreadPoolExecutor worker of
    an agent loop) would be killed, with every live sandbox, as soon as that thread ended.
    """
    out: dict[str, Any] = {}
    started = threading.Event()

    def parent() -> None:
        try:
            out["proc"] = subprocess.Popen(argv, **kwargs)
        except BaseException as exc:  # noqa: BLE001 - re-raised in the calling thread
            out["error"] = exc
        started.set()
        if "proc" in out:
            out["proc"].wait()

    threading.Thread(target=parent, name="sandbox-zygote-parent", daemon=True).start()
    started.wait()
    if "error" in out:
        raise out["error"]
    return out["proc"]


class _Zygote:
    """One sandboxed parent process per host process and mode; forks one worker per sandbox."""

    def __init__(self, mode: Literal["bwrap", "rlimit"]) -> None:
        self.mode = mode
        self.lock = threading.Lock()
        self.proc: subprocess.Popen | None = None
        self.control: socket.socket | None = None
        self.events: dict[str, dict] = {}
        self.exits: dict[str, dict] = {}
        self.forgotten: set[str] = set()
        self.cond = threading.Condition()
        self.stderr_tail: list[str] = []
        self.tmp_base: str | None = None

    def _alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self) -> None:
        host, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        fd = child.fileno()
        if self.mode == "bwrap":
            argv = ["bwrap", *_base_bwrap_args(), "--ro-bind", str(ZYGOTE_SCRIPT),
                    SANDBOX_ZYGOTE_PATH, "--", sys.executable, "-I", "-B",
                    SANDBOX_ZYGOTE_PATH, str(fd), "strict", os.pathsep.join(_import_roots())]
            env = None
            cwd = None
        else:
            self.tmp_base = tempfile.mkdtemp(prefix="pyvision-sandbox-")
            argv = [sys.executable, "-I", "-B", str(ZYGOTE_SCRIPT), str(fd), "rlimit",
                    os.pathsep.join(_import_roots())]
            env = {**_sandbox_env(), "HOME": self.tmp_base, "MPLCONFIGDIR": self.tmp_base,
                   "TMPDIR": self.tmp_base}
            cwd = self.tmp_base
        self.proc = _popen_from_lasting_thread(
            argv, pass_fds=[fd], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE, env=env, cwd=cwd, start_new_session=True)
        child.close()
        self.control = host
        threading.Thread(target=self._drain_stderr, daemon=True).start()
        host.settimeout(120)
        try:
            ready = json.loads(host.recv(65536) or b"{}")
        except (OSError, ValueError):
            ready = {}
        if ready.get("event") != "ready":
            self.proc.kill()
            time.sleep(0.1)
            raise RuntimeError("sandbox zygote failed to start: "
                               + " | ".join(self.stderr_tail[-10:]))
        host.settimeout(None)
        threading.Thread(target=self._read_events, daemon=True).start()

    def _drain_stderr(self) -> None:
        assert self.proc is not None and self.proc.stderr is not None
        for line in self.proc.stderr:
            self.stderr_tail.append(line.decode("utf-8", "replace").rstrip())
            del self.stderr_tail[:-50]

    def _read_events(self) -> None:
        control = self.control
        while True:
            try:
                data = control.recv(65536)  # type: ignore[union-attr]
            except OSError:
                data = b""
            if not data:
                with self.cond:
                    self.cond.notify_all()
                return
            msg = json.loads(data)
            with self.cond:
                if msg.get("event") == "exit":
                    if msg["id"] in self.forgotten:
                        self.forgotten.discard(msg["id"])
                    else:
                        self.exits[msg["id"]] = msg
                else:
                    self.events[msg.get("id", "")] = msg
                self.cond.notify_all()

    def spawn(self, sid: str, limits: dict) -> socket.socket:
        with self.lock:
            if not self._alive():
                self.start()
            host_end, worker_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
            payload = json.dumps({"op": "spawn", "id": sid, "limits": limits}).encode()
            socket.send_fds(self.control, [payload], [worker_end.fileno()])  # type: ignore[arg-type]
            worker_end.close()
        with self.cond:
            if not self.cond.wait_for(lambda: sid in self.events or not self._alive(), timeout=60):
                raise RuntimeError("sandbox zygote did not answer a spawn request")
            self.events.pop(sid, None)
        return host_end

    def kill(self, sid: str) -> None:
        with self.lock:
            if self._alive() and self.control is not None:
                try:
                    self.control.send(json.dumps({"op": "kill", "id": sid}).encode())
                except OSError:
                    pass

    def wait_exit(self, sid: str, timeout: float) -> dict | None:
        with self.cond:
            self.cond.wait_for(lambda: sid in self.exits or not self._alive(), timeout=timeout)
            return self.exits.pop(sid, None)

    def worker_failure(self, sid: str, timeout: float) -> str | None:
        """The reason worker ``sid`` gave for failing its set-up (one line on stderr)."""
        prefix = f"sandbox worker {sid}: "
        deadline = time.monotonic() + timeout
        while True:
            for line in reversed(self.stderr_tail):
                if line.startswith(prefix):
                    return line[len(prefix):]
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.02)

    def forget(self, sid: str) -> None:
        """Nobody will wait for ``sid``'s exit event: drop it now or when it arrives."""
        with self.cond:
            if self.exits.pop(sid, None) is None:
                self.forgotten.add(sid)

    def shutdown(self) -> None:
        with self.lock:
            if self.control is not None:
                # shutdown() first: close() alone leaves the socket open while the event reader
                # thread sits in recv() on it, so the zygote would never see the host hang up.
                with contextlib.suppress(OSError):
                    self.control.shutdown(socket.SHUT_RDWR)
                self.control.close()
                self.control = None
            if self.proc is not None:
                try:
                    self.proc.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                self.proc = None
            if self.tmp_base:
                shutil.rmtree(self.tmp_base, ignore_errors=True)
                self.tmp_base = None


_ZYGOTES: dict[str, _Zygote] = {}
_ZYGOTES_LOCK = threading.Lock()


def _zygote_for(mode: Literal["bwrap", "rlimit"]) -> _Zygote:
    with _ZYGOTES_LOCK:
        if mode not in _ZYGOTES:
            _ZYGOTES[mode] = _Zygote(mode)
        return _ZYGOTES[mode]


def shutdown() -> None:
    """Stop the zygotes (and with them every sandbox). Called at interpreter exit."""
    with _ZYGOTES_LOCK:
        for z in _ZYGOTES.values():
            z.shutdown()


atexit.register(shutdown)


# -- media ----------------------------------------------------------------------------------------


def _image_media(name: str, value: Any) -> tuple[dict, bytes]:
    """(spec, bytes) for an image: raw pixels for in-memory images (no encoding cost), the file's
    own bytes otherwise (decoded inside the sandbox)."""
    from PIL import Image

    if isinstance(value, Image.Image):
        img = value if value.mode in ("RGB", "RGBA", "L") else value.convert("RGB")
        return ({"name": name, "kind": "image_raw", "mode": img.mode, "size": list(img.size)},
                img.tobytes())
    return {"name": name, "kind": "image"}, _image_bytes(name, value)


def _image_bytes(name: str, value: Any) -> bytes:
    from PIL import Image, UnidentifiedImageError

    path = Path(value)
    if not path.is_file():
        raise DataError(f"image for {name} not found: {path}", hint="check the task's media paths")
    data = path.read_bytes()
    try:
        with Image.open(io.BytesIO(data)) as img:
            img.verify()
    except (UnidentifiedImageError, Image.DecompressionBombError, OSError, SyntaxError,
            ValueError) as exc:
        raise DataError(f"image for {name} is corrupt or not an image: {path} ({exc})",
                        hint="replace the file or drop the task") from None
    return data


def _video_bytes(name: str, value: Any) -> tuple[bytes, str]:
    path = Path(value)
    if not path.is_file():
        raise DataError(f"video for {name} not found: {path}", hint="check the task's media paths")
    try:
        import decord
        import decord.logging

        decord.logging.set_level(decord.logging.QUIET)  # its errors come back as one line

        reader = decord.VideoReader(str(path))
        if len(reader) == 0:
            raise ValueError("no frames")
        del reader
    except Exception as exc:  # noqa: BLE001 - any decoder failure means an unusable video
        raise DataError(f"video for {name} cannot be decoded: {path} ({exc})",
                        hint="re-encode it (e.g. H.264 mp4) or drop the task") from None
    return path.read_bytes(), path.suffix or ".mp4"


# -- the sandbox ------------------------------------------------------------------------------------


def _send_frame(sock: socket.socket, payload: bytes) -> None:
    sock.sendall(struct.pack(">I", len(payload)) + payload)


def _recv_exact(sock: socket.socket, n: int, deadline: float | None = None) -> bytes:
    """``n`` bytes; with ``deadline`` (monotonic) a TimeoutError once it passes, however the
    bytes trickle in (the code can write to its end of the socket)."""
    buf = bytearray()
    while len(buf) < n:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError
            sock.settimeout(left)
        chunk = sock.recv(min(n - len(buf), 1 << 20))
        if not chunk:
            raise EOFError
        buf += chunk
    return bytes(buf)


class _FrameReader:
    """A running sandbox's socket, non-blocking, every wait bounded by a deadline: a call costs a
    ``send``, a ``poll`` and (with the read-ahead buffer) usually one ``recv``. Made after the
    output buffer's descriptor was received (a buffered read would swallow it)."""

    def __init__(self, sock: socket.socket) -> None:
        import select

        self.sock = sock
        self.buf = bytearray()
        sock.setblocking(False)
        self.poll = select.poll()
        self.poll.register(sock, select.POLLIN)

    def _wait(self, deadline: float) -> None:
        left = deadline - time.monotonic()
        if left <= 0 or not self.poll.poll(max(1, int(left * 1000) + 1)):
            raise TimeoutError

    def send(self, payload: bytes, deadline: float) -> None:
        import select

        data = memoryview(struct.pack(">I", len(payload)) + payload)
        while data:
            try:
                data = data[self.sock.send(data):]
            except BlockingIOError:
                left = deadline - time.monotonic()
                if left <= 0 or not select.select([], [self.sock], [], left)[1]:
                    raise TimeoutError from None

    def _take(self, n: int, deadline: float) -> bytes:
        while len(self.buf) < n:
            self._wait(deadline)  # poll first: the reply is rarely there already
            try:
                chunk = self.sock.recv(max(n - len(self.buf), 65536))
            except BlockingIOError:
                continue
            if not chunk:
                raise EOFError
            self.buf += chunk
        out = bytes(self.buf[:n])
        del self.buf[:n]
        return out

    def frame(self, limit: int, deadline: float) -> bytes:
        (n,) = struct.unpack(">I", self._take(4, deadline))
        if n > limit:
            raise ValueError(f"sandbox sent a {n}-byte frame (limit {limit})")
        return self._take(n, deadline)


def _recv_frame(sock: socket.socket, limit: int, deadline: float | None = None) -> bytes:
    (n,) = struct.unpack(">I", _recv_exact(sock, 4, deadline))
    if n > limit:
        raise ValueError(f"sandbox sent a {n}-byte frame (limit {limit})")
    return _recv_exact(sock, n, deadline)


class Sandbox:
    """A persistent, isolated Python runtime for one trajectory."""

    def __init__(self, config: SandboxConfig | None = None, *,
                 images: Mapping[str, Any] | None = None,
                 videos: Mapping[str, Any] | None = None,
                 context_pixels: tuple[int, int] | None = None,
                 context_factor: int = 28) -> None:
        """``context_pixels`` (min, max): shown images come back already at the size the model
        sees them (the vision processor's resize rule, sides multiples of ``context_factor``),
        figures drawn at about that size."""
        self.config = config or SandboxConfig()
        self.context_pixels = context_pixels
        self.context_factor = context_factor
        # Bad media is reported before anything runs.
        self._media: list[tuple[dict, bytes]] = []
        for name, value in (images or {}).items():
            self._media.append(_image_media(name, value))
        for name, value in (videos or {}).items():
            data, suffix = _video_bytes(name, value)
            self._media.append(({"name": name, "kind": "video", "suffix": suffix}, data))
        self._mode = isolation_mode(self.config)
        self._zygote = _zygote_for(self._mode)
        self._sock: socket.socket | None = None
        self._output_fd: int | None = None
        self._sid = ""
        self._restarted = False
        self._closed = False
        self._start()

    @property
    def isolation(self) -> Literal["bwrap", "rlimit"]:
        return self._mode

    def _limits(self) -> dict:
        c = self.config
        media_mb = sum(len(b) for _, b in self._media) // (1024 * 1024)
        return {"memory_mb": c.memory_mb, "cpu_seconds": c.cpu_seconds,
                "max_processes": c.max_processes, "max_file_mb": c.max_file_mb,
                "max_open_files": c.max_open_files, "max_output_chars": c.max_output_chars,
                "max_images_per_call": c.max_images_per_call,
                "max_image_pixels": SHOWN_IMAGE_MAX_PIXELS, "max_image_bytes": MAX_IMAGE_BYTES,
                "context_pixels": ([*self.context_pixels, self.context_factor]
                                   if self.context_pixels else None),
                "tmp_mb": c.max_file_mb * 2 + media_mb + 16}

    def _start(self) -> None:
        self._sid = uuid.uuid4().hex
        sock = self._zygote.spawn(self._sid, self._limits())
        sock.settimeout(max(self.config.timeout_s, 30.0))
        try:
            _send_frame(sock, json.dumps({"media": [spec for spec, _ in self._media]}).encode())
            for _, blob in self._media:
                _send_frame(sock, blob)
            ready = json.loads(_recv_frame(sock, 1 << 16))
            if not ready.get("ready"):
                raise RuntimeError("sandbox worker did not become ready")
            # The worker's output buffer, shared before any code runs (see _zygote.BoundedText).
            tag, fds, _, _ = socket.recv_fds(sock, 1, 1, socket.MSG_CMSG_CLOEXEC)
            if tag != b"o" or len(fds) != 1:
                for fd in fds:
                    os.close(fd)
                raise EOFError
            self._output_fd = fds[0]
            self._frames = _FrameReader(sock)
        except (OSError, EOFError, ValueError) as exc:
            # A worker that hung up has exited (or is about to): read its exit code before a
            # kill would replace it with SIGKILL.
            info = self._zygote.wait_exit(self._sid, 1.0) if isinstance(exc, EOFError) else None
            if info is None:
                self._zygote.kill(self._sid)
                info = self._zygote.wait_exit(self._sid, 2.0)
            reason = self._zygote.worker_failure(self._sid, 0.5)
            if reason or (info and info.get("code") == SETUP_FAILED_EXIT):
                raise SandboxSetupError(
                    reason or "the sandbox could not load its media",
                    hint="install decord==0.6.0 for the Python that runs pyvision and check the "
                         "video file; `pyvision doctor` checks the sandbox") from None
            raise RuntimeError(f"sandbox failed to start ({exc}; exit {info}); zygote log: "
                               + " | ".join(self._zygote.stderr_tail[-5:])) from None
        self._sock = sock

    def run(self, code: str) -> ExecResult:
        """Run ``code`` in the persistent runtime; never raises for anything the code does."""
        if self._closed:
            raise RuntimeError("sandbox is closed")
        note = ""
        if self._sock is None:
            self._start()
            note = ("[sandbox: the runtime was restarted after the previous call failed; "
                    "variables defined earlier are gone, the media are loaded again]\n")
        sock = self._sock
        assert sock is not None
        start = time.monotonic()
        try:
            deadline = start + self.config.timeout_s
            self._frames.send(json.dumps({"type": "run", "code": code}).encode(), deadline)
            header = json.loads(self._frames.frame(MAX_HEADER_BYTES, deadline))
            if not isinstance(header, dict):
                raise ValueError("bad reply")  # noqa: TRY004 - handled as a crash below
            specs = header.get("images", [])
            if not isinstance(specs, list) or len(specs) > self.config.max_images_per_call:
                raise ValueError("bad image list")
            sent_by = time.monotonic() + max(self.config.timeout_s, 30.0)
            blobs = [self._frames.frame(MAX_IMAGE_BYTES, sent_by) for _ in specs]
        except TimeoutError:
            self._kill()
            t = self.config.timeout_s
            return self._failed("timeout", f"TimeoutError: killed after {t:g} s: the code ran "
                                f"longer than the {t:g} s limit and was stopped (with every "
                                "process it started)", note, start)
        except (EOFError, OSError, ValueError) as exc:
            info = self._zygote.wait_exit(self._sid, 2.0) or {}
            self._kill()
            return self._crash_result(info, exc, note, start)
        status = header.get("status")
        if status not in ("ok", "error", "oom"):
            status = "crashed"
        frames = [img for img in map(_frame, specs, blobs) if img is not None]
        dropped = len(specs) - len(frames)
        stderr = str(header.get("stderr", ""))
        if dropped:
            stderr += f"\n[sandbox: {dropped} invalid image(s) dropped]"
        return ExecResult(status, note + str(header.get("stdout", "")), stderr, frames,
                          float(header.get("duration_s", time.monotonic() - start)),
                          bool(header.get("truncated", False)))

    def _failed(self, status: Status, reason: str, note: str, start: float) -> ExecResult:
        """The result of a call whose process is gone: what the code printed before (from the
        shared output buffer, bounded), then the reason."""
        stdout, truncated = self._printed_before()
        return ExecResult(status, note + stdout, reason, [], time.monotonic() - start, truncated)

    def _printed_before(self) -> tuple[str, bool]:
        fd, self._output_fd = self._output_fd, None
        if fd is None:
            return "", False
        limit = self.config.max_output_chars
        try:
            return render_output(os.pread(fd, output_buffer_size(limit), 0), limit)
        except OSError:
            return "", False
        finally:
            os.close(fd)

    def _crash_result(self, info: dict, exc: Exception, note: str, start: float) -> ExecResult:
        sig = info.get("signal")
        if sig == 24:  # SIGXCPU: the CPU-seconds rlimit
            return self._failed("timeout", f"TimeoutError: killed after using "
                                f"{self.config.cpu_seconds} CPU seconds (the sandbox's CPU "
                                "limit)", note, start)
        if sig == 9 and info:
            return self._failed("oom", f"MemoryError: the sandbox process was killed by SIGKILL, "
                                f"most likely for exceeding the memory limit "
                                f"({self.config.memory_mb} MiB)", note, start)
        what = (f"was killed by {SIGNAL_NAMES.get(sig, f'signal {sig}')}" if sig
                else f"exited with code {info.get('code')}" if info else f"was lost ({exc})")
        return self._failed("crashed", f"The Python runtime crashed: it {what}. It will be "
                            "restarted on the next call, without earlier variables.", note, start)

    def _kill(self, wait: bool = True) -> None:
        self._zygote.kill(self._sid)
        if wait:  # after a timeout: make sure it is gone before a restart
            self._zygote.wait_exit(self._sid, 2.0)
        self._zygote.forget(self._sid)
        if self._sock is not None:
            self._sock.close()
        self._sock = None

    def close(self) -> None:
        """End the sandbox and every process it started (idempotent)."""
        if self._closed:
            return
        self._closed = True
        if self._sock is not None:
            self._kill(wait=False)
        if self._output_fd is not None:
            os.close(self._output_fd)
            self._output_fd = None

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # interpreter shutdown
            self.close()


def _frame(spec: Any, blob: bytes) -> Any:
    """A shown image from its raw pixels, or None when the sandbox sent anything but RGB pixels
    of a bounded size whose byte count matches it (nothing is parsed or decoded)."""
    from PIL import Image

    try:
        w, h = (int(v) for v in spec["size"])
        ok = spec["mode"] == "RGB" and w > 0 and h > 0 and w * h <= MAX_IMAGE_PIXELS \
            and len(blob) == w * h * 3
    except (TypeError, KeyError, ValueError):
        return None
    return Image.frombytes("RGB", (w, h), blob) if ok else None
