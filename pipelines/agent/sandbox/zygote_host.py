"""The host's side of the zygote (``_zygote.py`` is the side inside the sandbox).

One zygote per host process and isolation mode imports numpy, PIL, matplotlib and decord once and
forks a worker per sandbox, so starting a sandbox costs milliseconds. This module starts it
(under bubblewrap or with rlimits only), asks it to spawn and kill workers, and collects their
exit events.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Literal

from pipelines.agent.sandbox import isolation
from pipelines.agent.sandbox._zygote import remove_tree

ZYGOTE_SCRIPT = Path(__file__).with_name("_zygote.py")


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


class Zygote:
    """One sandboxed parent process per host process and mode; forks one worker per sandbox."""

    def __init__(self, mode: Literal["bwrap", "rlimit"]) -> None:
        self.mode = mode
        # Re-entrant: a Sandbox freed by the garbage collector while this thread holds it (in
        # spawn) kills its worker from __del__, which takes it again.
        self.lock = threading.RLock()
        self.proc: subprocess.Popen | None = None
        self.control: socket.socket | None = None
        self.events: dict[str, dict] = {}
        self.exits: dict[str, dict] = {}
        self.forgotten: set[str] = set()
        self.cond = threading.Condition()
        self.stderr_tail: list[str] = []
        self.tmp_base: str | None = None
        self.hung_up = False

    def _alive(self) -> bool:
        # A closed control socket is a dead zygote already: the thread that reaps it may not
        # have yet (poll() says None while that thread's wait() holds the process), and a
        # waiter woken by the hang-up would otherwise sleep out its whole timeout.
        return self.proc is not None and not self.hung_up and self.proc.poll() is None

    def start(self) -> None:
        # A zygote that died (or hung up) is restarted here: end what is left of it first, or
        # its socket, its process and (rlimit mode) its temporary home would outlive it.
        self._release(grace_s=1.0)
        host, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        fd = child.fileno()
        roots = os.pathsep.join(isolation.import_roots())
        # -s -P (no user site, no script folder on the path) rather than -I: -I would also ignore
        # the environment's PYTHONHASHSEED, and set order would change from run to run. The
        # environment is the sandbox's own (isolation.sandbox_env), nothing of the host's.
        if self.mode == "bwrap":
            inside = isolation.SANDBOX_ZYGOTE_PATH
            argv = ["bwrap", *isolation.bwrap_args(), "--ro-bind", str(ZYGOTE_SCRIPT), inside,
                    "--", isolation.interpreter(), "-s", "-P", "-B", inside, str(fd), "strict",
                    roots]
            env = None
            cwd = None
        else:
            self.tmp_base = tempfile.mkdtemp(prefix="pyvision-sandbox-")
            argv = [sys.executable, "-s", "-P", "-B", str(ZYGOTE_SCRIPT), str(fd), "rlimit", roots]
            env = {**isolation.sandbox_env(), "HOME": self.tmp_base,
                   "MPLCONFIGDIR": self.tmp_base, "TMPDIR": self.tmp_base}
            cwd = self.tmp_base
        self.proc = _popen_from_lasting_thread(
            argv, pass_fds=[fd], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE, env=env, cwd=cwd, start_new_session=True)
        child.close()
        self.control = host
        self.hung_up = False
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
                    if self.control is control:  # not a zygote started since
                        self.hung_up = True
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
                except OSError:  # the zygote just died: its workers died with it, nothing to kill
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
            self._release(grace_s=5.0)

    def _release(self, grace_s: float) -> None:
        """Hang up on the zygote, give it ``grace_s`` to exit (then kill it), and remove its
        temporary home. Called with ``lock`` held."""
        if self.control is not None:
            # shutdown() first: close() alone leaves the socket open while the event reader
            # thread sits in recv() on it, so the zygote would never see the host hang up.
            with contextlib.suppress(OSError):
                self.control.shutdown(socket.SHUT_RDWR)
            self.control.close()
            self.control = None
        if self.proc is not None:
            try:
                self.proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
            self.proc = None
        if self.tmp_base:
            remove_tree(self.tmp_base)  # (the sandboxes' folders, which the code could lock)
            self.tmp_base = None


_ZYGOTES: dict[str, Zygote] = {}
_ZYGOTES_LOCK = threading.Lock()


def zygote_for(mode: Literal["bwrap", "rlimit"]) -> Zygote:
    """The zygote of ``mode``, made on first use (it starts on its first spawn)."""
    with _ZYGOTES_LOCK:
        if mode not in _ZYGOTES:
            _ZYGOTES[mode] = Zygote(mode)
        return _ZYGOTES[mode]


def shutdown() -> None:
    """Stop the zygotes (and with them every sandbox). Called at interpreter exit."""
    with _ZYGOTES_LOCK:
        for z in _ZYGOTES.values():
            z.shutdown()


atexit.register(shutdown)
