"""The :class:`Sandbox` a trajectory talks to, and the :class:`ExecResult` of each call.

A sandbox is a worker forked by the zygote (``zygote_host.py``); the host sends it the task's
media and then code, over a socket of length-prefixed frames, and reads back a JSON header and the
shown images. The worker's output buffer is memory both sides share, so a call that times out or
crashes still returns what the code printed before.
"""

from __future__ import annotations

import contextlib
import errno
import io
import json
import os
import re
import signal
import socket
import struct
import threading
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Literal, Self

from pipelines.agent.sandbox._zygote import (
    BIG_FRAME,
    LENGTH,
    RUN_TAG,
    output_buffer_size,
    read_in_place,
    render_output,
    whole_frame,
)
from pipelines.agent.sandbox.isolation import isolation_mode
from pipelines.agent.sandbox.media import (
    MAX_IMAGE_BYTES,
    SHOWN_IMAGE_MAX_PIXELS,
    frame_from_pixels,
    image_media,
    video_bytes,
)
from pipelines.agent.sandbox.zygote_host import zygote_for
from pipelines.config.sandbox import SandboxConfig
from pipelines.errors import UserError

Status = Literal["ok", "error", "timeout", "oom", "crashed"]
# The reply's JSON header holds stdout and stderr, each bounded by max_output_chars (a character
# is at most 6 bytes of JSON, \uXXXX), and the shown images' specs: anything longer is forged.
HEADER_BYTES_PER_CHAR = 12
HEADER_SLACK_BYTES = 64 * 1024
# A shown image that the host keeps is RGB pixels within the shown-pixel limit (Sandbox._fits).
SHOWN_IMAGE_BYTES = SHOWN_IMAGE_MAX_PIXELS * 3
# The shown images follow the header at once; the code cannot stretch its call past its limit by
# trickling them, by more than this.
IMAGES_GRACE_S = 5.0
# What the worker's own truncation adds to a text of max_output_chars (its marker line).
_MARKER_ROOM = 96
# An object's address in its repr (``<PIL.PngImageFile ... at 0x7FE73B92D6D0>``, ``<function f at
# 0x7f...>``): it changes from run to run, and printed into the context it made two runs of one seed
# sample different tokens. Renumbered per sandbox (``at 0x1``, ``at 0x2``, in order of appearance).
_ADDRESS = re.compile(r"\bat 0x[0-9a-fA-F]{6,16}(?![0-9a-fA-F])")
# A worker that cannot load its media writes one stderr line "sandbox worker <id>: <reason>" and
# exits with this code (as in _zygote.py, which cannot import this package).
SETUP_FAILED_EXIT = 72


def _signal_name(sig: int) -> str:
    """``SIGSEGV`` for 11; ``signal 99`` for a number this platform does not name."""
    try:
        return signal.Signals(sig).name
    except ValueError:
        return f"signal {sig}"


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


class SandboxSetupError(UserError):
    """The sandbox could not load a task's media (decord missing, a video it cannot open)."""


def _send_frame(sock: socket.socket, payload: bytes) -> None:
    if len(payload) <= BIG_FRAME:
        sock.sendall(struct.pack(">I", len(payload)) + payload)  # one send
    else:  # media: not copied once more just to prepend four bytes
        sock.sendall(struct.pack(">I", len(payload)))
        sock.sendall(payload)


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
    output buffer's descriptor was received (a buffered read would swallow it).

    ``left``: how many more bytes it may receive (None: any number), set for each reply
    (:func:`reply_limit`); a frame whose length would take it past that is refused before it is
    allocated or received, and no read asks for more."""

    def __init__(self, sock: socket.socket) -> None:
        import select

        self.sock = sock
        self.buf = bytearray()
        self.limit: int | None = None
        self.left: int | None = None
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

    def expect_reply(self, limit: int | None) -> None:
        """Receive at most ``limit`` more bytes (None: no bound) until told otherwise."""
        self.limit = self.left = limit

    def _room(self, want: int, need: int) -> int:
        """How many bytes one read may ask for: ``want``, within what is left, which must hold
        the ``need`` bytes still missing."""
        if self.left is None:
            return want
        if need > self.left:
            raise ValueError(f"sandbox sent a reply past its limit of {self.limit} bytes")
        return min(want, self.left)

    def _took(self, k: int) -> None:
        if self.left is not None:
            self.left -= k

    def _take(self, n: int, deadline: float) -> bytes | bytearray:
        if n - len(self.buf) > BIG_FRAME:  # pixels: received in place, not grown and sliced
            missing = n - len(self.buf)  # (within what is left: see frame)

            def recv_into(view: memoryview) -> int | None:
                self._wait(deadline)
                try:
                    return self.sock.recv_into(view)
                except BlockingIOError:
                    return None

            out = read_in_place(self.buf, n, recv_into)
            self._took(missing)
            return out
        while len(self.buf) < n:
            self._wait(deadline)  # poll first: the reply is rarely there already
            try:
                chunk = self.sock.recv(self._room(max(n - len(self.buf), 65536),
                                                  n - len(self.buf)))
            except BlockingIOError:
                continue
            if not chunk:
                raise EOFError
            self._took(len(chunk))
            self.buf += chunk
        out = bytes(self.buf[:n])
        del self.buf[:n]
        return out

    def frame(self, limit: int, deadline: float) -> bytes | bytearray:
        if not self.buf:  # the usual reply: one frame, whole in one read, taken as it came
            self._wait(deadline)
            try:
                chunk = self.sock.recv(self._room(65536, LENGTH.size))
            except BlockingIOError:
                chunk = b""
            else:
                if not chunk:
                    raise EOFError
                self._took(len(chunk))
            if (payload := whole_frame(chunk, limit)) is not None:
                return payload
            self.buf += chunk
        (n,) = struct.unpack(">I", self._take(4, deadline))
        if n > limit:
            raise ValueError(f"sandbox sent a {n}-byte frame (limit {limit})")
        if self.left is not None and n - len(self.buf) > self.left:  # before it is allocated
            raise ValueError(f"sandbox sent a {n}-byte frame past its reply's limit of "
                             f"{self.limit} bytes")
        return self._take(n, deadline)


def reply_limit(config: SandboxConfig) -> int:
    """The most bytes the host receives for one call's reply, its frames' length prefixes
    included: the header (stdout and stderr at ``max_output_chars``, the image specs) and
    ``max_images_per_call`` shown images at the shown-pixel limit, all a real worker can send.
    A reply that would take more (the code can write forged frames to the socket) is refused as
    its frames' lengths arrive, before anything past the limit is received or allocated. (Each
    image frame is also held to ``MAX_IMAGE_BYTES``; that alone let a forged reply take
    ``max_images_per_call`` x 32 MiB, 1.7 times this limit with the defaults.)"""
    return (LENGTH.size + _header_limit(config)
            + config.max_images_per_call * (LENGTH.size + SHOWN_IMAGE_BYTES))


def _header_limit(config: SandboxConfig) -> int:
    return HEADER_BYTES_PER_CHAR * config.max_output_chars + HEADER_SLACK_BYTES


def _recv_frame(sock: socket.socket, limit: int, deadline: float | None = None) -> bytes:
    (n,) = struct.unpack(">I", _recv_exact(sock, 4, deadline))
    if n > limit:
        raise ValueError(f"sandbox sent a {n}-byte frame (limit {limit})")
    return _recv_exact(sock, n, deadline)


def _bounded(text: Any, limit: int) -> tuple[str, bool]:
    """``text`` as the worker would have bounded it (head, marker, tail) where it is longer than
    that could be, and as valid Unicode (a lone surrogate, which JSON can carry but no tokenizer
    or UTF-8 file takes, is "?" as the worker writes it); a value that is not text is dropped."""
    if not isinstance(text, str):
        return "", text is not None
    if not text.isascii():
        text = text.encode("utf-8", "replace").decode("utf-8")
    if len(text) <= limit + _MARKER_ROOM:
        return text, False
    half = limit // 2
    return (f"{text[:half]}\n... [truncated {len(text) - 2 * half} characters] ...\n"
            f"{text[-half:]}"), True


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
            self._media.append(image_media(name, value))
        for name, value in (videos or {}).items():
            data, suffix = video_bytes(name, value)
            self._media.append(({"name": name, "kind": "video", "suffix": suffix}, data))
        self._mode = isolation_mode(self.config)
        self._zygote = zygote_for(self._mode)
        self._sock: socket.socket | None = None
        self._output_fd: int | None = None
        self._sid = ""
        self._restarted = False
        self._closed = False
        self._addresses: dict[str, str] = {}
        # The worker's socket and output buffer change hands under this lock: the agent loop may
        # close a sandbox (its exception path) while a pool thread is in ``run``.
        self._state = threading.Lock()
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
                raise SandboxSetupError(reason or "the sandbox could not load its media",
                                        hint=self._setup_hint(reason)) from None
            raise RuntimeError(f"sandbox failed to start ({exc}; exit {info}); zygote log: "
                               + " | ".join(self._zygote.stderr_tail[-5:])) from None
        self._sock = sock

    def _setup_hint(self, reason: str | None) -> str:
        if reason and os.strerror(errno.EAGAIN) in reason:  # out of processes and threads
            n = self.config.max_processes
            return (f"sandbox.max_processes ({n}) bounds the processes and threads a sandbox "
                    f"runs; raise it, e.g. --set sandbox.max_processes={max(2 * n, 16)}")
        return ("install decord==0.6.0 for the Python that runs pyvision and check the video "
                "file; `pyvision doctor` checks the sandbox")

    def run(self, code: str) -> ExecResult:
        """Run ``code`` in the persistent runtime; never raises for anything the code does."""
        note = ""
        with self._state:  # a close() now waits for this restart, then ends the new worker
            if self._closed:
                raise RuntimeError("sandbox is closed")
            if self._sock is None:
                self._start()
                note = ("[sandbox: the runtime was restarted after the previous call failed; "
                        "variables defined earlier are gone, the media are loaded again]\n")
            sock = self._sock
        assert sock is not None
        start = time.monotonic()
        header_limit = _header_limit(self.config)
        try:
            deadline = start + self.config.timeout_s
            self._frames.send(RUN_TAG + code.encode("utf-8", "surrogatepass"), deadline)
            # The whole reply, text and images, is held to one bound as it is received.
            self._frames.expect_reply(reply_limit(self.config))
            header = json.loads(self._frames.frame(header_limit, deadline))
            if not isinstance(header, dict):
                raise ValueError("bad reply")  # noqa: TRY004 - handled as a crash below
            specs = header.get("images", [])
            if not isinstance(specs, list) or len(specs) > self.config.max_images_per_call:
                raise ValueError("bad image list")
            blobs = []
            if specs:  # (no deadline to compute for the calls that show nothing)
                sent_by = max(deadline, time.monotonic() + 1.0)
                sent_by = min(sent_by, time.monotonic() + IMAGES_GRACE_S)
                blobs = [self._frames.frame(MAX_IMAGE_BYTES, sent_by) for _ in specs]
        except TimeoutError:
            self._kill()
            t = self.config.timeout_s
            return self._failed("timeout", f"TimeoutError: killed after {t:g} s: the code ran "
                                f"longer than the {t:g} s limit and was stopped (with every "
                                "process it started)", note, start)
        except (EOFError, OSError, ValueError, RecursionError) as exc:
            # RecursionError: a forged header nested past the parser's depth. The code can write
            # any bytes to its end of the socket, so every reply is read as untrusted.
            if self._closed:  # close() ended the worker from another thread: nothing to wait for
                return self._failed("crashed", "The sandbox was closed while the code ran.",
                                    note, start)
            # A hang-up: the worker is exiting, and its exit says how it died. A bad reply: it
            # is alive (the code forged it), so it is ended now rather than waited for.
            hung_up = isinstance(exc, (EOFError, OSError))
            info = (self._zygote.wait_exit(self._sid, 2.0) if hung_up else None) or {}
            self._kill(wait=not info)  # an exit already read: nothing left to wait for
            return self._crash_result(info, exc, note, start)
        return self._reply(header, specs, blobs, note, start)

    def _reply(self, header: dict, specs: list, blobs: list, note: str,
               start: float) -> ExecResult:
        """The result a reply describes, held to the limits on this side of the socket: the
        worker enforces them, but the code shares its process and can forge what it sends (a
        field of the wrong type, text past the output limit, an image of any size)."""
        limit = self.config.max_output_chars
        status = header.get("status")
        if status not in ("ok", "error", "oom"):
            status = "crashed"
        stdout, cut_out = _bounded(header.get("stdout"), limit)
        stderr, cut_err = _bounded(header.get("stderr"), limit)
        frames = [img for img in map(frame_from_pixels, specs, blobs)
                  if img is not None and self._fits(img)]
        dropped = len(specs) - len(frames)
        if dropped:
            stderr += f"\n[sandbox: {dropped} invalid image(s) dropped]"
        took = time.monotonic() - start
        duration = header.get("duration_s")
        if not isinstance(duration, (int, float)) or not 0 <= duration <= took + 1.0:
            duration = took
        truncated = header.get("truncated") is True or cut_out or cut_err
        return ExecResult(status, note + self._steady(stdout), self._steady(stderr), frames,
                          float(duration), truncated)

    def _steady(self, text: str) -> str:
        """``text`` with each object address renumbered (the same address, the same number, for
        the sandbox's life), so the same code prints the same text on every run."""
        def number(match: re.Match) -> str:
            return self._addresses.setdefault(match[0].lower(), f"at 0x{len(self._addresses) + 1:x}")
        return _ADDRESS.sub(number, text)

    @staticmethod
    def _fits(img: Any) -> bool:
        """A shown image within the bounds the worker keeps to: the shown-pixel limit, and the
        aspect bound with room for the context resize's rounding (a 199:1 image 41 pixels high
        arrives 28 high); the agent loop then brings it to its context size, as every image."""
        from pipelines.agent.sandbox._zygote import Runtime

        w, h = img.size
        return w * h <= SHOWN_IMAGE_MAX_PIXELS and max(w, h) < 2 * Runtime.MAX_ASPECT * min(w, h)

    def _failed(self, status: Status, reason: str, note: str, start: float) -> ExecResult:
        """The result of a call whose process is gone: what the code printed before (from the
        shared output buffer, bounded), then the reason."""
        stdout, truncated = self._printed_before()
        return ExecResult(status, note + self._steady(stdout), reason, [],
                          time.monotonic() - start, truncated)

    def _printed_before(self) -> tuple[str, bool]:
        with self._state:  # whoever takes the descriptor closes it
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
        what = (f"was killed by {_signal_name(sig)}" if sig
                else f"exited with code {info.get('code')}" if info else f"was lost ({exc})")
        return self._failed("crashed", f"The Python runtime crashed: it {what}. It will be "
                            "restarted on the next call, without earlier variables.", note, start)

    def _kill(self, wait: bool = True) -> None:
        self._zygote.kill(self._sid)
        if wait:  # after a timeout: make sure it is gone before a restart
            self._zygote.wait_exit(self._sid, 2.0)
        self._zygote.forget(self._sid)
        with self._state:
            sock, self._sock = self._sock, None
        if sock is not None:
            sock.close()

    def close(self) -> None:
        """End the sandbox and every process it started (idempotent; safe while another thread
        is in ``run``, whose call then ends as a crash)."""
        with self._state:
            if self._closed:
                return
            self._closed = True
            running = self._sock is not None
            fd, self._output_fd = self._output_fd, None
        if running:
            self._kill(wait=False)
        if fd is not None:
            os.close(fd)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # interpreter shutdown
            self.close()
