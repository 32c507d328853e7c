"""The process that runs inside the sandbox: a zygote that forks one worker per sandbox.

This file is executed by the sandboxed interpreter (``python -I -B _zygote.py CONTROL_FD MODE``)
and imports nothing from the project: inside the sandbox only the Python runtime and this file
are visible. It speaks two protocols:

* control (zygote <-> host, AF_UNIX SOCK_SEQPACKET on CONTROL_FD): JSON messages; ``spawn``
  carries one end of a fresh socketpair (SCM_RIGHTS) plus the limits; ``kill`` ends a sandbox;
  the zygote reports ``exit`` events with the worker's exit code or signal.
* worker (worker <-> host, AF_UNIX SOCK_STREAM): frames of ``4-byte big-endian length + JSON``,
  followed by ``length + raw bytes`` blobs for media and for shown images (raw RGB pixels at the
  size the model will see them: never encoded here nor decoded by the host).

Worker set-up, in ``strict`` mode: new user, mount, pid, network, IPC and UTS namespaces (so no
sibling sandbox is visible, addressable or reachable), a private size-limited tmpfs on /tmp, an
empty tmpfs over /proc, every capability dropped, no_new_privs, non-dumpable, rlimits, and pid 1
of its own pid namespace: when it is killed, every process it started dies with it. In
``rlimit`` mode the rlimits, every capability dropped, no_new_privs, a process group of its own
(in the zygote's session, which has no terminal), Landlock and a working directory of its own
apply (``isolation``'s docstring says what each mode refuses).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import io
import json
import mmap
import os
import random
import resource
import select
import shutil
import signal
import socket
import struct
import sys
import tempfile
import termios
import threading
import time
import traceback
import weakref
from collections.abc import Callable
from typing import Any, NamedTuple

CLONE_NEWNS = 0x00020000
CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000
MS_REC, MS_PRIVATE, MS_NOSUID, MS_NODEV, MS_BIND = 0x4000, 0x40000, 0x2, 0x4, 0x1000
PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_CAPBSET_DROP, PR_SET_NO_NEW_PRIVS = 1, 4, 24, 38
PR_SET_SECUREBITS, PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL = 28, 47, 4
# The securebits a worker sets, each with its lock (none can be unset again): NOROOT (uid 0
# gains no capability by exec) 0x1|0x2, NO_SETUID_FIXUP (nor by changing uids) 0x4|0x8,
# KEEP_CAPS off and locked 0x20, NO_CAP_AMBIENT_RAISE 0x40|0x80.
SECUREBITS_LOCKED_DOWN = 0xEF
MAX_FRAME = 256 * 1024 * 1024
# Frames above this size (media, pixels) are sent and received without intermediate copies.
BIG_FRAME = 256 * 1024
# A call's frame: this tag, then the code as UTF-8 (lone surrogates passed through), no JSON.
RUN_TAG = b"R"
LENGTH = struct.Struct(">I")  # a frame's length prefix

libc = ctypes.CDLL(None, use_errno=True)


def _check(ret: int, what: str) -> None:
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


# -- framing -------------------------------------------------------------------------------------


def send_frame(sock: socket.socket, payload: bytes) -> None:
    if len(payload) <= BIG_FRAME:
        sock.sendall(struct.pack(">I", len(payload)) + payload)  # one send
    else:  # pixels: not copied once more just to prepend four bytes
        sock.sendall(struct.pack(">I", len(payload)))
        sock.sendall(payload)


def recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(min(n - len(buf), 1 << 20))
        if not chunk:
            raise EOFError("peer closed")
        buf += chunk
    return bytes(buf)


def recv_frame(sock: socket.socket) -> bytes:
    (n,) = struct.unpack(">I", recv_exact(sock, 4))
    if n > MAX_FRAME:
        raise ValueError("frame too large")
    return recv_exact(sock, n)


def whole_frame(chunk: bytes, limit: int = MAX_FRAME) -> bytes | None:
    """The payload when ``chunk`` (what one read returned) is exactly one frame of at most
    ``limit`` bytes, as a call's request or reply usually is; None otherwise."""
    if len(chunk) >= 4:
        (n,) = LENGTH.unpack_from(chunk)
        if len(chunk) == n + 4 and n <= limit:
            return chunk[4:]
    return None


def read_in_place(buf: bytearray, n: int, recv_into) -> bytearray:
    """A big frame of ``n`` bytes: what ``buf`` already holds (then cleared), and the rest
    received straight into place. ``recv_into(view)`` returns how many bytes it read, 0 when the
    peer closed, None when nothing was there yet (it is asked again)."""
    out = bytearray(n)
    got = len(buf)
    out[:got] = buf
    buf.clear()
    view = memoryview(out)
    while got < n:
        k = recv_into(view[got:])
        if k is None:
            continue
        if not k:
            raise EOFError("peer closed")
        got += k
    return out


class FrameReader:
    """``recv_frame`` with a read-ahead buffer: a small frame (a call's code) costs one
    ``recv`` instead of two."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buf = bytearray()

    def _take(self, n: int) -> bytes | bytearray:
        if n - len(self.buf) > BIG_FRAME:  # media: received in place, not grown and sliced
            return read_in_place(self.buf, n, self.sock.recv_into)
        while len(self.buf) < n:
            chunk = self.sock.recv(max(n - len(self.buf), 65536))
            if not chunk:
                raise EOFError("peer closed")
            self.buf += chunk
        out = bytes(self.buf[:n])
        del self.buf[:n]
        return out

    def frame(self) -> bytes | bytearray:
        if not self.buf:  # the usual request: one frame, whole in one read, taken as it came
            chunk = self.sock.recv(65536)
            if not chunk:
                raise EOFError("peer closed")
            if (payload := whole_frame(chunk)) is not None:
                return payload
            self.buf += chunk
        (n,) = struct.unpack(">I", self._take(4))
        if n > MAX_FRAME:
            raise ValueError("frame too large")
        return self._take(n)


# -- bounded output capture -----------------------------------------------------------------------
#
# A call's output lives in a buffer laid out as OUTPUT_HEADER (characters written, head bytes,
# tail bytes written) + the head (the first ``limit // 2`` characters, UTF-8) + a ring holding the
# last ``limit - limit // 2`` characters. The worker's buffer is shared memory (a memfd the host
# holds too), so what the code printed before a timeout, a crash, ``os._exit`` or a memory kill
# is still readable by the host after the process is gone. The host reads it with
# ``render_output``, treating every byte as untrusted (the code can scribble on its own memory).

OUTPUT_HEADER = struct.Struct("<QQQ")


def output_buffer_size(limit: int) -> int:
    """Bytes of the output buffer for ``limit`` characters (4 bytes each, UTF-8's widest)."""
    return OUTPUT_HEADER.size + 4 * max(limit, 2)


def _output_layout(limit: int) -> tuple[int, int, int]:
    """(head characters, head capacity in bytes, tail characters)."""
    limit = max(limit, 2)
    half = limit // 2
    return half, 4 * half, limit - half


def render_output(buf: bytes, limit: int) -> tuple[str, bool]:
    """The text an output buffer holds: head, a truncation marker if needed, tail."""
    half, head_cap, tail_chars = _output_layout(limit)
    data = bytes(buf[:output_buffer_size(limit)]).ljust(output_buffer_size(limit), b"\0")
    total, head_bytes, tail_written = OUTPUT_HEADER.unpack_from(data)
    start = OUTPUT_HEADER.size
    head = data[start:start + min(head_bytes, head_cap)].decode("utf-8", "replace")[:half]
    ring = data[start + head_cap:]
    if tail_written <= len(ring):
        raw = ring[:tail_written]
    else:
        pos = tail_written % len(ring)
        raw = ring[pos:] + ring[:pos]
    tail = raw.decode("utf-8", "ignore")[-tail_chars:]  # the ring may cut one character
    kept = len(head) + len(tail)
    if total <= kept:
        return head + tail, False
    return f"{head}\n... [truncated {total - kept} characters] ...\n{tail}", True


class _BinaryOut(io.RawIOBase):
    """``sys.stdout.buffer``: bytes decoded as UTF-8 (split characters joined) into the text."""

    def __init__(self, text: BoundedText) -> None:
        import codecs

        self.text = text
        self.decoder = codecs.getincrementaldecoder("utf-8")("replace")

    def writable(self) -> bool:
        return True

    def write(self, b) -> int:  # type: ignore[override]
        data = bytes(b)
        self.text.write(self.decoder.decode(data))
        return len(data)


class BoundedText(io.TextIOBase):
    """Keeps the first and last ``limit // 2`` characters of everything written, counts the rest,
    in an output buffer (see ``render_output``): ``buf`` when given (shared memory), else its own.
    """

    encoding = "utf-8"
    errors = "replace"

    def __init__(self, limit: int, buf=None) -> None:
        self.limit = max(limit, 2)
        self.half, self.head_cap, self.tail_chars = _output_layout(self.limit)
        size = output_buffer_size(self.limit)
        self.buf = memoryview(buf if buf is not None else bytearray(size))[:size]
        self.ring_start = OUTPUT_HEADER.size + self.head_cap
        self.ring_size = size - self.ring_start
        self.lock = threading.Lock()
        self._binary: _BinaryOut | None = None
        self.reset()

    def reset(self) -> None:
        """Empty, for the next call (the buffer is reused: no allocation per call)."""
        self.total = self.head_chars = self.head_bytes = self.tail_written = 0
        self._binary = None
        self._publish()

    @property
    def buffer(self) -> _BinaryOut:  # type: ignore[override]
        if self._binary is None:  # made on first use: most calls never write bytes
            self._binary = _BinaryOut(self)
        return self._binary

    def _publish(self) -> None:
        OUTPUT_HEADER.pack_into(self.buf, 0, self.total, self.head_bytes, self.tail_written)

    def writable(self) -> bool:
        return True

    def write(self, s) -> int:  # type: ignore[override]
        if not isinstance(s, str):
            s = str(s)
        n = len(s)
        with self.lock:
            if self.head_chars < self.half:
                take = s[: self.half - self.head_chars]
                data = take.encode("utf-8", "replace")
                at = OUTPUT_HEADER.size + self.head_bytes
                self.buf[at:at + len(data)] = data
                self.head_chars += len(take)
                self.head_bytes += len(data)
                s = s[len(take):]
            if s:
                data = s[-self.tail_chars:].encode("utf-8", "replace")
                size = len(data)
                pos = self.tail_written % self.ring_size
                at = self.ring_start + pos
                if pos + size <= self.ring_size:
                    self.buf[at:at + size] = data
                else:
                    first = self.ring_size - pos
                    self.buf[at:at + first] = data[:first]
                    self.buf[self.ring_start:self.ring_start + size - first] = data[first:]
                self.tail_written += size
            self.total += n
            OUTPUT_HEADER.pack_into(self.buf, 0, self.total, self.head_bytes, self.tail_written)
        return n

    def getvalue(self) -> tuple[str, bool]:
        with self.lock:
            if self.tail_written == 0 and self.total == self.head_chars:
                # Everything fits in the head (the common case): no copy of the whole buffer.
                at = OUTPUT_HEADER.size
                return bytes(self.buf[at:at + self.head_bytes]).decode("utf-8", "replace"), False
            return render_output(self.buf, self.limit)

    def flush(self) -> None:
        return None


# -- isolation steps ----------------------------------------------------------------------------


def _write(path: str, text: str) -> None:
    with open(path, "w") as fh:
        fh.write(text)


def enter_namespaces(tmp_mb: int) -> None:
    """New user/mount/pid/net/ipc/uts namespaces mapping our uid to itself; private /tmp."""
    uid, gid = os.getuid(), os.getgid()
    libc.prctl(PR_SET_DUMPABLE, 1, 0, 0, 0)  # /proc/self/*_map must be writable by us
    _check(libc.unshare(CLONE_NEWUSER | CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWNET | CLONE_NEWIPC
                        | CLONE_NEWUTS), "unshare")
    _write("/proc/self/setgroups", "deny")
    _write("/proc/self/uid_map", f"{uid} {uid} 1\n")
    _write("/proc/self/gid_map", f"{gid} {gid} 1\n")
    _check(libc.mount(b"none", b"/", None, MS_REC | MS_PRIVATE, None), "make mounts private")
    # A Python runtime under /tmp (a checkout or venv in a temporary folder) would vanish under
    # the private /tmp: hold it by descriptor and bind it back (read-only, as bwrap mounted it).
    held = [(p, os.open(p, os.O_PATH | os.O_DIRECTORY)) for p in _runtime_under_tmp()]
    opts = f"size={tmp_mb}m,mode=1777".encode()
    _check(libc.mount(b"tmpfs", b"/tmp", b"tmpfs", MS_NOSUID | MS_NODEV, opts), "mount /tmp")
    for path, fd in held:
        os.makedirs(path, exist_ok=True)
        _check(libc.mount(f"/proc/self/fd/{fd}".encode(), path.encode(), None, MS_BIND | MS_REC,
                          None), f"bind {path}")
        os.close(fd)


def _runtime_under_tmp() -> list[str]:
    """The interpreter's folders that lie under /tmp, outermost only."""
    found = {os.path.realpath(p) for p in (sys.prefix, sys.base_prefix,
                                           os.path.dirname(sys.executable), *sys.path)
             if p and os.path.isdir(p)}
    under = sorted(p for p in found if p.startswith("/tmp/"))
    return [p for p in under if not any(p != q and p.startswith(q + "/") for q in under)]


def prefer_for_oom_kill() -> None:
    """Ask the kernel's OOM killer to end this process (and every one it starts, which inherit
    the setting) before any other: no cgroup bounds a sandbox's processes together, so when the
    machine runs out of memory it is the sandbox that ends, not the evaluation or the training
    that runs it. Raising one's own score needs no privilege; without a writable /proc (a
    kernel without it) the kernel's own choice stands."""
    try:
        with open("/proc/self/oom_score_adj", "w") as f:
            f.write("1000")
    except OSError:
        return


def hide_proc() -> None:
    """Cover /proc with an empty tmpfs: nothing about other processes is readable."""
    _check(libc.mount(b"tmpfs", b"/proc", b"tmpfs", MS_NOSUID | MS_NODEV, b"size=16k,mode=555"),
           "hide /proc")


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32),
                ("inheritable", ctypes.c_uint32)]


def drop_capabilities() -> None:
    """Empty every capability set, lock root's special rules off and forbid regaining
    privileges: neither this process nor a program it starts (one owned by root, setuid or with
    file capabilities too) holds a capability. In order: the securebits
    (``SECUREBITS_LOCKED_DOWN``) and the bounding set, which need CAP_SETPCAP, then the ambient
    set, then the effective, permitted and inheritable sets, then no_new_privs. A process without
    CAP_SETPCAP (a user other than root, in rlimit mode) sets no securebits and keeps its
    bounding set; it holds no capability to lose, and no_new_privs keeps an exec from granting
    one."""
    libc.prctl(PR_SET_SECUREBITS, SECUREBITS_LOCKED_DOWN, 0, 0, 0)
    for cap in range(64):
        if libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) != 0 and ctypes.get_errno() == errno.EINVAL:
            break  # past the last capability this kernel knows
    libc.prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0)  # (capset clears it too)
    header = _CapHeader(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3: two words per set
    data = (_CapData * 2)()
    _check(libc.capset(ctypes.byref(header), ctypes.byref(data)), "capset")
    _check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")


class _SockFilter(ctypes.Structure):
    _fields_ = [("code", ctypes.c_ushort), ("jt", ctypes.c_ubyte), ("jf", ctypes.c_ubyte),
                ("k", ctypes.c_uint32)]


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(_SockFilter))]


PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 22, 2
SECCOMP_RET_ALLOW, SECCOMP_RET_ERRNO = 0x7FFF0000, 0x00050000
SECCOMP_RET_KILL_PROCESS = 0x80000000  # Linux 4.14+ (before: the thread alone)


class SyscallNumbers(NamedTuple):
    """One architecture's audit value (the one seccomp reports), the calls the filter refuses in
    every mode (``denied``) and those whose arguments it checks or that it refuses in rlimit
    mode only."""

    arch: int
    denied: tuple[int, ...]
    socket: int
    socketpair: int
    connect: int
    prctl: int
    ioctl: int
    setpriority: int
    ioprio_set: int


# What the seccomp filter refuses with EPERM in every mode, per architecture:
# - memory that RLIMIT_AS does not count once unmapped: memfd_create and memfd_secret (pages of a
#   file held by a descriptor) and SysV shmget (a segment outlives its mapping);
# - io_uring_setup: a ring's operations open sockets and files without the system calls below;
# - socket() and socketpair() for any family but AF_UNIX (the socket library's own, as for the
#   worker's link to the host): no network, even in rlimit mode, which has no network namespace
#   (socketpair makes AF_TIPC sockets too, Linux 4.12+);
# - prctl(PR_SET_PDEATHSIG): the worker's death signal is what ends it (pid 1 of its namespace,
#   with every process it started) when the zygote kills its intermediate at a timeout or close.
SECCOMP_RULES = {
    "x86_64": SyscallNumbers(0xC000003E, (319, 447, 29, 425), socket=41, socketpair=53,
                             connect=42, prctl=157, ioctl=16, setpriority=141, ioprio_set=251),
    "aarch64": SyscallNumbers(0xC00000B7, (279, 447, 194, 425), socket=198, socketpair=199,
                              connect=203, prctl=167, ioctl=29, setpriority=140, ioprio_set=30),
}
# Allowed in every mode on the caller alone (a pid of 0): the calls that set a process's limits
# or scheduling by its pid. In rlimit mode the code runs as the user's uid in the host's pid
# namespace; the kernel lets a process set these for any process of its uid, and Landlock
# mediates none of them. So the code could lower the host's RLIMIT_CPU (SIGXCPU kills it once
# it has used that much), RLIMIT_AS or RLIMIT_NOFILE, renice it or every process of the user's
# (``setpriority(PRIO_USER, ...)``), or move its CPUs, policy or I/O class; its pid is
# ``os.getppid()`` or a scan away. (On a root host, whose processes hold capabilities the code
# dropped, the kernel refuses all but prlimit64 without CAP_SYS_NICE.) prlimit64,
# sched_setparam, sched_setscheduler, sched_setaffinity and sched_setattr are allowed with a pid
# of 0 only, which is what glibc's setrlimit/getrlimit, ``os.sched_setaffinity(0, ...)`` and
# ``os.sched_setscheduler(0, ...)`` make; setpriority with PRIO_PROCESS and 0 only (``os.nice``),
# ioprio_set with IOPRIO_WHO_PROCESS and 0 only (their numbers are in ``SyscallNumbers``). The
# caller's own pid or a thread's id is refused too (``resource.prlimit(os.getpid(), ...)``,
# psutil's setters, ``pthread_setaffinity_np``), and so is reading another process's limits with
# prlimit64: harmless, but it would need a second path through the filter (pid 0, or a null new
# limit), and nothing the sandbox runs needs it. The kernel takes a pid (``pid_t``) and
# ``which``/``who`` (``int``) as the low 32 bits of their registers, whatever the upper half
# holds, so the filter checks the low word alone: what the kernel acts on. Left allowed: x86_64's
# setrlimit and both architectures' getrlimit/setrlimit, which act on the caller only, and the
# calls on another process's memory (migrate_pages, move_pages, process_madvise, kcmp,
# process_vm_readv/writev, pidfd_getfd, perf_event_open), which the kernel allows only where
# ptrace_may_access does, and Landlock's ptrace hook refuses a process outside the sandbox's
# domain. In bubblewrap mode the code sees its own processes only; the rule holds there too so
# that code gets the same answers in both modes. Numbers from the kernel's
# arch/x86/entry/syscalls/syscall_64.tbl and scripts/syscall.tbl (asm-generic, aarch64):
# prlimit64 sched_setparam sched_setscheduler sched_setaffinity sched_setattr.
SECCOMP_SELF_ONLY_CALLS = {
    "x86_64": (302, 142, 144, 203, 314),
    "aarch64": (261, 118, 119, 122, 274),
}
_PRIO_PROCESS, _IOPRIO_WHO_PROCESS = 0, 1
# Refused too in every mode: System V IPC, POSIX message queues and the kernel's keyrings. In
# rlimit mode the code has the user's uid in the host's IPC namespace, and Landlock does not
# mediate these: it could read, send to and remove the user's System V message queues and
# semaphores and (by id) shared-memory segments, remove the user's POSIX message queues
# (mq_unlink; Landlock refuses opening one, but only once mq_open has created it), and make
# queues and semaphore sets whose kernel memory no rlimit counts, which outlive the sandbox
# (in bubblewrap mode they end with its IPC namespace). Keyrings have no namespace: the session
# keyring the host started with is the worker's in bubblewrap mode too (as the user or as uid
# 65534), with the keys the user keeps there (Kerberos tickets, a secret service's). shmat
# shmctl, semget semop semctl semtimedop, msgget msgsnd msgrcv msgctl, mq_open mq_unlink,
# add_key request_key keyctl (shmget is in SECCOMP_RULES; shmdt, which only detaches, and the
# mq_* calls on a descriptor mq_open would have given, are not refused). Numbers from the
# kernel's arch/x86/entry/syscalls/syscall_64.tbl and scripts/syscall.tbl (asm-generic,
# aarch64). Nothing the sandbox runs uses them: multiprocessing's locks are POSIX semaphores.
SECCOMP_IPC_CALLS = {
    "x86_64": (30, 31, 64, 65, 66, 220, 68, 69, 70, 71, 240, 241, 248, 249, 250),
    "aarch64": (196, 195, 190, 193, 191, 192, 186, 189, 188, 187, 180, 181, 217, 218, 219),
}
# Refused too in rlimit mode, where a process group is all that ends a sandbox's processes:
# setpgid and setsid, so that nothing the code starts can leave the group the zygote kills.
SECCOMP_GROUP_CALLS = {"x86_64": (109, 112), "aarch64": (154, 157)}
# Refused too in rlimit mode, where the code runs as the user's uid and Landlock (which mediates
# opening, creating, removing and truncating files, not their metadata) is all that confines its
# files: the calls that change a file's mode, owner, times or extended attributes, which else
# work on any file of the user's, outside the sandbox's folder too (a private key made
# world-readable, a file's times reset). By path or descriptor, old and new forms alike:
# chmod fchmod fchmodat fchmodat2, chown fchown lchown fchownat, utime utimes futimesat
# utimensat, setxattr lsetxattr fsetxattr setxattrat, removexattr lremovexattr fremovexattr
# removexattrat, and file_setattr (an inode's fsxattr flags). aarch64 has no chmod, chown, lchown,
# utime, utimes or futimesat: its C library makes them of the *at calls. Numbers from the
# kernel's arch/x86/entry/syscalls/syscall_64.tbl and scripts/syscall.tbl (asm-generic, aarch64);
# those from 452 on (Linux 6.6 to 6.17) are the same on both, and refusing one a kernel lacks
# changes nothing (EPERM instead of ENOSYS).
# This refuses them in the code's own folder too: files the code writes (``open``, PIL's and
# numpy's ``save``, ``savefig``) are unaffected, as are ``os.mkdir``'s and ``os.open``'s modes and
# ``shutil.copyfile``, but ``shutil.copy`` (``copymode``), ``shutil.copy2`` and ``copystat``
# (``utime``), ``os.chmod``, ``os.utime``, ``Path.touch`` of an existing file and
# ``tarfile.extractall`` of a member's mode or time raise PermissionError. That is accepted:
# the code has no need to set a mode or a time in its throwaway folder, and copying is
# ``copyfile``. Not in bubblewrap mode, where every host file is a read-only bind (EROFS) not
# owned by the sandbox's uid, and only the sandbox's own tmpfs is writable.
SECCOMP_FILE_META_CALLS = {
    "x86_64": (90, 91, 268, 452, 92, 93, 94, 260, 132, 235, 261, 280,
               188, 189, 190, 463, 197, 198, 199, 466, 469),
    "aarch64": (52, 53, 452, 55, 54, 88, 5, 6, 7, 463, 14, 15, 16, 466, 469),
}
# With them, the ioctl() commands that change an inode's flags, which the owner of a file may
# use on any descriptor of it, one opened read-only too (Landlock's ioctl right covers devices
# only): chattr's FS_IOC_SETFLAGS (nodump, noatime, nocow, sync...; as root immutable and
# append-only too) and its 32-bit form, FS_IOC_FSSETXATTR (the same flags, the project id),
# FS_IOC_SETVERSION and its 32-bit and ext4 forms (the inode's generation), and
# FS_IOC_ENABLE_VERITY (makes a file's content unchangeable for good). The same numbers on
# x86_64 and aarch64; the kernel reads the command as 32 bits, and so does the filter.
SECCOMP_FILE_META_IOCTLS = (0x40086602, 0x40046602, 0x401C5820, 0x40087602, 0x40047602,
                            0x40086604, 0x40806685)
_X32_BIT = 0x40000000  # x86_64's x32 ABI: the same calls by other numbers; Python never uses it
_AF_UNIX = 1
_SOCK_TYPE_MASK, _SOCK_STREAM, _SOCK_SEQPACKET = 0xF, 1, 5  # (above: SOCK_NONBLOCK, SOCK_CLOEXEC)


def _arg(i: int) -> int:
    """Where the low word of a call's argument ``i`` is in seccomp_data (after nr, arch and the
    instruction pointer; little-endian, as x86_64 and aarch64 are)."""
    return 16 + 8 * i


# A check of one argument: (where its word is in seccomp_data, a mask to apply to it first or 0,
# values, whether the call is allowed only with one of them (else: refused with any of them)).
# A call with several checks is allowed only if it passes every one.
ArgCheck = tuple[int, int, tuple[int, ...], bool]


def seccomp_rules(machine: str, keep_group: bool = False, keep_file_meta: bool = False,
                  keep_host_sockets: bool = False
                  ) -> tuple[int, tuple[int, ...], tuple[tuple[int, tuple[ArgCheck, ...]], ...]]:
    """What the filter checks on ``machine``: its audit value, the calls it refuses and the calls
    whose arguments it checks. Every mode: ``SECCOMP_RULES``, ``SECCOMP_IPC_CALLS`` and
    ``SECCOMP_SELF_ONLY_CALLS`` (and setpriority and ioprio_set on the caller only); rlimit
    mode adds, with ``keep_group``, ``SECCOMP_GROUP_CALLS``, with ``keep_file_meta``,
    ``SECCOMP_FILE_META_CALLS`` and ``SECCOMP_FILE_META_IOCTLS``, and with ``keep_host_sockets``
    socket() for every family, AF_UNIX too, connect(), and socketpair() of a type but
    SOCK_STREAM and SOCK_SEQPACKET.

    The host's services (an ssh-agent, a D-Bus session bus, docker.sock, /dev/log) listen on
    Unix sockets that the user's uid, the code's in rlimit mode, may reach, and neither Landlock
    nor any namespace mediates connecting to one or sending to one. So the code makes no socket
    of its own there: a stream or seqpacket pair ignores an address given with sendto/sendmsg
    (or refuses it) and cannot be connected anew, but a datagram pair sends to the address it is
    given and can be connected to another. What the worker itself needs is unchanged: its link to
    the host is a stream socket made before the filter (sent and received on, descriptors
    passed over it). Code that listens on a Unix socket of its own (``multiprocessing.Manager``,
    Python 3.14's default forkserver) fails there; ``multiprocessing.Pipe`` (fork, pipes) and
    asyncio's loop (a stream pair) work. (``multiprocessing.Pool`` fails in rlimit mode anyway:
    its locks are POSIX semaphores in ``/dev/shm``, which Landlock keeps the code from creating.)
    Not in bubblewrap mode, whose file system and network namespace hold no socket of the
    host's."""
    calls = SECCOMP_RULES[machine]
    denied = calls.denied + SECCOMP_IPC_CALLS[machine]
    unix_only: ArgCheck = (_arg(0), 0, (_AF_UNIX,), True)
    pair: tuple[ArgCheck, ...] = (unix_only,)
    checked = [(calls.prctl, ((_arg(0), 0, (PR_SET_PDEATHSIG,), False),))]
    own: ArgCheck = (_arg(0), 0, (0,), True)  # a pid of 0 (the low word: see above)
    checked += [(nr, (own,)) for nr in SECCOMP_SELF_ONLY_CALLS[machine]]
    for nr, which in ((calls.setpriority, _PRIO_PROCESS), (calls.ioprio_set, _IOPRIO_WHO_PROCESS)):
        checked.append((nr, ((_arg(0), 0, (which,), True), (_arg(1), 0, (0,), True))))
    if keep_group:
        denied += SECCOMP_GROUP_CALLS[machine]
    if keep_file_meta:
        denied += SECCOMP_FILE_META_CALLS[machine]
        checked.append((calls.ioctl, ((_arg(1), 0, SECCOMP_FILE_META_IOCTLS, False),)))
    if keep_host_sockets:
        denied += (calls.socket, calls.connect)
        pair += ((_arg(1), _SOCK_TYPE_MASK, (_SOCK_STREAM, _SOCK_SEQPACKET), True),)
    else:
        checked.append((calls.socket, (unix_only,)))
    checked.append((calls.socketpair, pair))
    return calls.arch, denied, tuple(checked)


def seccomp_program(arch: int, denied: tuple[int, ...],
                    checked: tuple[tuple[int, tuple[ArgCheck, ...]], ...] = ()
                    ) -> list[tuple[int, int, int, int]]:
    """The classic-BPF program (code, jt, jf, k) that refuses ``denied`` with EPERM on ``arch``,
    and each call of ``checked`` (``(nr, checks)``, see ``seccomp_rules``) whose arguments fail
    one of its checks, and allows every other call of ``arch``.

    A call made under another architecture kills the process (SECCOMP_RET_KILL_PROCESS): the
    numbers above are ``arch``'s alone, and an x86_64 kernel with IA32 emulation runs i386 calls
    (``int 0x80`` from a page below 4 GB, machine code that ctypes and mmap let the code write)
    under AUDIT_ARCH_I386, with other numbers, so allowing them bypassed every rule (i386 chmod is
    15). Killing rather than EPERM: no code the sandbox runs makes such a call, and the host reports
    the killed worker as crashed (SIGSYS). A number with x86_64's x32 bit (0x40000000: an x32
    call, made under AUDIT_ARCH_X86_64 itself, the same calls by other numbers; no aarch64 call
    has such a number) is refused with EPERM.

    Jumps are written to labels and counted at the end (a jump skips that many instructions;
    each fits in a byte). A checked call's block loads its arguments and ends in its own ALLOW,
    so a call that skips a block still has its number loaded for the next one."""
    ld_abs, alu_and, jeq, jge, ret = 0x20, 0x54, 0x15, 0x35, 0x06
    prog: list[list] = [[ld_abs, 0, 0, 4],  # seccomp_data.arch
                        [jeq, 1, 0, arch],  # this architecture: past the KILL
                        [ret, 0, 0, SECCOMP_RET_KILL_PROCESS],  # another (i386 on x86_64)
                        [ld_abs, 0, 0, 0],  # seccomp_data.nr
                        [jge, "deny", 0, _X32_BIT]]  # an x32 call
    prog += [[jeq, "deny", 0, nr] for nr in denied]
    labels: dict[str, int] = {}
    for i, (nr, checks) in enumerate(checked):
        prog.append([jeq, 0, f"call {i + 1}", nr])  # another call: to the next block
        for j, (where, mask, values, only) in enumerate(checks):
            passed = f"call {i} check {j + 1}"
            prog.append([ld_abs, 0, 0, where])
            if mask:
                prog.append([alu_and, 0, 0, mask])
            for n, value in enumerate(values):
                if not only:  # one of these: DENY, else on
                    prog.append([jeq, "deny", 0, value])
                elif n == len(values) - 1:  # none of these: DENY
                    prog.append([jeq, passed, "deny", value])
                else:
                    prog.append([jeq, passed, 0, value])
            labels[passed] = len(prog)
        prog.append([ret, 0, 0, SECCOMP_RET_ALLOW])  # every check passed
        labels[f"call {i + 1}"] = len(prog)
    prog.append([ret, 0, 0, SECCOMP_RET_ALLOW])  # any other call
    labels["deny"] = len(prog)
    prog.append([ret, 0, 0, SECCOMP_RET_ERRNO | 1])  # EPERM
    for at, ins in enumerate(prog):
        for field in (1, 2):
            if isinstance(ins[field], str):
                ins[field] = labels[ins[field]] - (at + 1)
                if not 0 <= ins[field] <= 255:
                    raise ValueError(f"a jump of {ins[field]} at {at} does not fit in a byte")
    return [tuple(ins) for ins in prog]  # type: ignore[misc]


def install_seccomp_filter(keep_group: bool = False, keep_file_meta: bool = False,
                           keep_host_sockets: bool = False) -> bool:
    """Install the seccomp filter of ``seccomp_rules`` (the flags are its own) for this process
    and the threads and processes it starts after; False where it cannot (another architecture,
    a kernel without seccomp), and the limits stay the rlimits (and in strict mode the
    namespaces) alone."""
    import platform

    if platform.machine() not in SECCOMP_RULES:
        return False
    program = seccomp_program(*seccomp_rules(platform.machine(), keep_group, keep_file_meta,
                                             keep_host_sockets))
    filters = (_SockFilter * len(program))(*(_SockFilter(*ins) for ins in program))
    fprog = _SockFprog(len(program), filters)
    if libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        return False
    return libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(fprog), 0, 0) == 0


# Landlock (Linux 5.13+, no privilege needed): what confines a worker's files, signals and
# abstract Unix sockets in rlimit mode, where no namespace does. The system calls have the same
# numbers on x86_64 and aarch64.
_LANDLOCK_CREATE_RULESET, _LANDLOCK_ADD_RULE, _LANDLOCK_RESTRICT_SELF = 444, 445, 446
_FS_EXECUTE, _FS_WRITE_FILE, _FS_READ_FILE, _FS_READ_DIR = 1, 2, 4, 8
_FS_ABI1 = (1 << 13) - 1  # execute ... make_sym: every right of the first ABI
_FS_REFER, _FS_TRUNCATE = 1 << 13, 1 << 14  # ABI 2, ABI 3
_SCOPE_ABSTRACT_UNIX_SOCKET, _SCOPE_SIGNAL = 1, 2  # ABI 6
_FILE_RIGHTS = _FS_EXECUTE | _FS_WRITE_FILE | _FS_READ_FILE | _FS_TRUNCATE
# What a confined worker may read, as bubblewrap's read-only binds give the strict sandbox
# (the interpreter and its import folders are added at run time): the system's libraries, the
# loader's cache and the harmless devices.
_LANDLOCK_READABLE = ("/usr/lib", "/usr/lib64", "/usr/local/lib", "/lib", "/lib64",
                      "/etc/ld.so.cache", "/dev/null", "/dev/zero", "/dev/urandom", "/dev/random")


class _RulesetAttr(ctypes.Structure):
    _fields_ = [("handled_access_fs", ctypes.c_uint64), ("handled_access_net", ctypes.c_uint64),
                ("scoped", ctypes.c_uint64)]


class _PathBeneathAttr(ctypes.Structure):
    _pack_ = 1
    _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


def landlock_abi() -> int:
    """The Landlock ABI version this kernel offers; 0 where it has none (or it is disabled)."""
    version = libc.syscall(_LANDLOCK_CREATE_RULESET, None, 0, 1)  # LANDLOCK_CREATE_RULESET_VERSION
    return max(int(version), 0)


def readable_paths(roots: list[str] | tuple[str, ...] = ()) -> list[str]:
    """The folders and files a confined worker may read: this interpreter's prefixes, its site
    folders, ``roots`` (the host's import roots, ``isolation.import_roots``) and
    ``_LANDLOCK_READABLE``; as bubblewrap binds, never another folder on the import path, such as
    the checkout a ``.pth`` file of an editable install adds (``-I`` only keeps out the working
    directory and PYTHONPATH)."""
    paths = {sys.prefix, sys.base_prefix, sys.exec_prefix,
             os.path.dirname(os.path.realpath(sys.executable)), *_LANDLOCK_READABLE, *roots}
    paths.update(p for p in sys.path if os.path.isabs(p) and "-packages" in p)
    return sorted(p for p in paths if os.path.exists(p))


def confine_files(readable: list[str], writable: str) -> bool:
    """Confine this process and what it starts with Landlock: ``readable`` read-only (and
    executable), ``writable`` (its working folder) fully, nothing else of the file system; with
    ABI 6, no signal to a process outside (the host, the zygote, the user's other processes:
    ``kill(-1, ...)`` included) and no abstract Unix socket outside. False where the kernel has
    no Landlock: the rlimits alone apply. Call it before any thread starts (only the caller and
    what it starts later are confined)."""
    abi = landlock_abi()
    if abi < 1:
        return False
    fs = _FS_ABI1 | (_FS_REFER if abi >= 2 else 0) | (_FS_TRUNCATE if abi >= 3 else 0)
    scoped = _SCOPE_ABSTRACT_UNIX_SOCKET | _SCOPE_SIGNAL if abi >= 6 else 0
    attr = _RulesetAttr(fs, 0, scoped)
    size = ctypes.sizeof(_RulesetAttr) if scoped else 8  # older kernels take the first field only
    ruleset = libc.syscall(_LANDLOCK_CREATE_RULESET, ctypes.byref(attr), size, 0)
    if ruleset < 0:
        return False
    try:
        read = _FS_EXECUTE | _FS_READ_FILE | _FS_READ_DIR
        rules = [(p, read) for p in readable] + [(writable, fs)]
        for path, access in rules:
            try:
                fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
            except OSError:
                continue  # gone meanwhile: nothing to allow
            try:
                if not os.path.isdir(path):  # a file takes file rights only
                    access &= _FILE_RIGHTS
                    if path == "/dev/null":  # subprocess.DEVNULL opens it for writing
                        access |= _FS_WRITE_FILE
                rule = _PathBeneathAttr(access & fs, fd)
                _check(libc.syscall(_LANDLOCK_ADD_RULE, ruleset, 1, ctypes.byref(rule), 0),
                       f"landlock rule for {path}")
            finally:
                os.close(fd)
        _check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")
        _check(libc.syscall(_LANDLOCK_RESTRICT_SELF, ruleset, 0), "landlock_restrict_self")
    finally:
        os.close(ruleset)
    return True


def apply_rlimits(limits: dict, mode: str) -> None:
    mb = 1024 * 1024
    resource.setrlimit(resource.RLIMIT_AS, (limits["memory_mb"] * mb,) * 2)
    cpu = int(limits["cpu_seconds"])
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
    nproc = process_limit(limits["max_processes"], mode, os.getuid(), tasks_of_user)
    resource.setrlimit(resource.RLIMIT_NPROC, (nproc,) * 2)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limits["max_file_mb"] * mb,) * 2)
    resource.setrlimit(resource.RLIMIT_NOFILE, (limits["max_open_files"],) * 2)
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def process_limit(max_processes: int, mode: str, uid: int, tasks: Callable[[int], int]) -> int:
    """The RLIMIT_NPROC that lets a sandbox start ``max_processes`` processes and threads.

    The kernel counts a user's tasks, not a process tree's. In strict mode each sandbox is its own
    user namespace, where the count starts at its own tasks, and as root nothing is enforced, so
    the limit is ``max_processes``. In rlimit mode as any other user the count holds every task of
    that user on the machine (a Ray node, the training job, the other sandboxes): a bare limit of
    16 failed every sandbox's first thread wherever the user already ran 16 tasks. There the
    limit is the user's tasks now plus ``max_processes``: still a bound on a fork bomb, shared
    with the user's other processes, as everything is in a mode that is no security boundary."""
    if mode == "strict" or uid == 0:
        return max_processes
    return tasks(uid) + max_processes


def tasks_of_user(uid: int) -> int:
    """Tasks (processes and their threads) whose real uid is ``uid``: what RLIMIT_NPROC counts."""
    count = 0
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/status", "rb") as fh:
                status = fh.read()
        except OSError:  # ended meanwhile, or not readable
            continue
        fields = dict(line.split(b":", 1) for line in status.splitlines() if b":" in line)
        if int(fields.get(b"Uid", b"-1").split()[0]) == uid:
            count += int(fields.get(b"Threads", b"1"))
    return count


# -- the runtime the model's code sees ----------------------------------------------------------


def open_image(blob: bytes, Image: Any, np: Any) -> Any:
    """``image_clue_N`` from an image file's bytes: the pixels the model was shown in its context
    (``pipelines.core.media.to_rgb``, which this copies: the zygote imports nothing from the
    project; the two must match, as ``tests/pipelines/core/test_media.py`` checks). An "RGB" or
    "L" image is kept as it is; transparent pixels go on white; a greyscale image of more than
    8 bits is scaled to 8 (:func:`grey_to_8bit`); anything else is converted to "RGB"."""
    img = Image.open(io.BytesIO(blob))
    img.load()
    if img.mode in ("I", "F") or img.mode.startswith("I;16"):
        return grey_to_8bit(img, Image, np).convert("RGB")
    if img.mode in ("RGBA", "LA", "PA", "RGBa", "La") or "transparency" in img.info:
        rgba = img.convert("RGBA")
        img = Image.new("RGB", rgba.size, (255, 255, 255))
        img.paste(rgba, mask=rgba.getchannel("A"))
    elif img.mode not in ("RGB", "L"):
        img = img.convert("RGB")
    return img


def grey_to_8bit(image: Any, Image: Any, np: Any) -> Any:
    """``pipelines.core.media.grey_to_8bit``, copied (the two must match; see there for the
    scaling): "I;16"/"I" ``v >> 8`` (clipped to 0..65535), "F" in [0, 1] ``round(v * 255)``,
    else Pillow's 0..255 scale, a transparency key on white."""
    a = np.asarray(image)
    if image.mode == "F":
        finite = a[np.isfinite(a)]
        if finite.size and finite.min() >= 0.0 and finite.max() <= 1.0:
            unit = np.nan_to_num(a.astype(np.float64), nan=0.0, posinf=1.0, neginf=0.0)
            return Image.fromarray(np.rint(unit * 255.0).astype(np.uint8))
        return Image.fromarray(np.nan_to_num(a, nan=0.0).astype(np.float32)).convert("L")
    wide = np.clip(a.astype(np.int64), 0, 65535)
    out = (wide >> 8).astype(np.uint8)
    key = image.info.get("transparency")
    if isinstance(key, int) and not isinstance(key, bool):
        out[a == key] = 255
    return Image.fromarray(out)


def smart_resize(height: int, width: int, factor: int = 28, min_pixels: int = 3136,
                 max_pixels: int = 2_000_000) -> tuple[int, int]:
    """Qwen2-VL's resize rule: sides rounded to multiples of ``factor``, area within bounds.

    The same arithmetic as ``qwen_vl_utils.smart_resize`` (checked by a test), without importing
    that package, which pulls in torchvision (seconds of start-up). It lives here, in the one file
    the isolated runtime can import, so that the runtime and the agent loop share it.
    """
    import math

    h_bar = max(factor, round(height / factor) * factor)
    w_bar = max(factor, round(width / factor) * factor)
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def _preload() -> dict:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    from PIL import Image, ImageDraw, ImageEnhance, ImageFilter, ImageOps

    mods = {"np": np, "numpy": np, "plt": plt, "matplotlib": matplotlib, "Image": Image,
            "ImageDraw": ImageDraw, "ImageEnhance": ImageEnhance, "ImageFilter": ImageFilter,
            "ImageOps": ImageOps, "io": io, "math": __import__("math")}
    try:
        import scipy.ndimage  # noqa: F401 - warm the import for measuring/counting code
    except ImportError:
        pass
    try:
        import decord

        _decode_on_one_thread(decord)
        mods["decord"] = decord
    except ImportError:
        pass
    return mods


# Decoder threads of a sandbox's video readers. decord's default (num_threads=0) lets FFmpeg start
# one per CPU plus one: 17 on a 16-core GPU node, past the sandbox's process limit
# (max_processes, 16), where opening the video then fails with EAGAIN ("Resource temporarily
# unavailable"). Sandboxes run side by side, one per trajectory, so one thread each is enough.
DECODE_THREADS = 1


def _decode_on_one_thread(decord) -> None:
    """Make ``decord.VideoReader`` decode on ``DECODE_THREADS`` unless the caller names
    ``num_threads``: the reader of the task's video and any the model's code opens. Called once,
    by the zygote's :func:`_preload`."""
    base = decord.VideoReader

    class VideoReader(base):  # type: ignore[misc, valid-type]
        __doc__ = base.__doc__

        def __init__(self, uri, *args, **kwargs):
            if len(args) < 4:  # (ctx, width, height, num_threads) positionally names the threads
                kwargs.setdefault("num_threads", DECODE_THREADS)
            super().__init__(uri, *args, **kwargs)

    decord.VideoReader = VideoReader


def _warm_up(preloaded: dict) -> None:
    """Do once, in the zygote, what every sandbox's first image would otherwise pay for: pyplot's
    backend, the Agg renderer and the font it draws text with, PIL's crop and resize. Then
    freeze what exists (``gc.freeze``): the collector no longer walks the inherited objects in
    each worker, which would copy their pages (time on the first calls, memory per sandbox).
    Nothing of it is visible to the code: the figure is closed, no setting is changed. It costs
    about 0.7 MB PSS per live sandbox (64 sandboxes: 1,319 instead of 1,267 MB); without the
    drawn text and line it would cost 0.2 MB, but a sandbox's first plot would not be warm."""
    import gc

    plt, np, Image = preloaded["plt"], preloaded["np"], preloaded["Image"]
    img = Image.new("RGB", (64, 48), (120, 60, 30))
    img = img.crop((8, 8, 40, 32)).resize((48, 36))
    fig = plt.figure(figsize=(2, 2), dpi=50)
    try:
        ax = fig.add_subplot()
        ax.imshow(np.asarray(img))
        ax.plot([0, 30], [0, 20])
        ax.set_title("warm")
        ax.text(2, 2, "up")
        fig.canvas.draw()
        ax.axis("off")
        ax.apply_aspect()
    finally:
        plt.close(fig)
    PyplotDefaults.get()
    gc.collect()
    gc.freeze()


SHRINK_REDUCING_GAP = 1.0
"""Pillow's ``reducing_gap`` for a composed figure's image: shrunk by a factor ``f`` >= 2, it is
first reduced ``int(f)`` times by box averaging (cheap), and the filter does the rest."""

# Matplotlib interpolations whose picture a PIL filter of the same kind reproduces (used when a
# figure that is one image is composed without matplotlib; see ``Runtime._single_image``).
PIL_FILTERS = {"nearest": "NEAREST", "none": "NEAREST", "bilinear": "BILINEAR",
               "bicubic": "BICUBIC", "lanczos": "LANCZOS", "hanning": "HAMMING",
               "hamming": "HAMMING"}


class PyplotDefaults:
    """What a default pyplot figure with one ``imshow`` looks like, read once from matplotlib
    itself (in the zygote's warm-up): the settings it is drawn with and where its Axes sits
    before the image's aspect shrinks it. Only valid while ``rcParams`` equal ``rc``."""

    _cached: PyplotDefaults | None = None

    def __init__(self) -> None:
        import matplotlib
        from matplotlib.figure import Figure

        self.rc = _raw_settings(matplotlib.rcParams)
        fig = Figure()  # as pyplot makes one, without its registry
        ax = fig.add_subplot()
        self.position = ax.get_position(original=True).frozen()  # the subplot parameters
        self.facecolor = fig.patch.get_facecolor()
        self.figsize, self.dpi = tuple(float(v) for v in fig.get_size_inches()), float(fig.dpi)
        self.anchor = ax.get_anchor()
        # What the deferred path reproduces: an opaque, borderless figure whose imshow keeps the
        # image's aspect by shrinking the Axes box (anything else is left to matplotlib).
        patch = fig.patch
        self.usable = (self.rc["image.aspect"] == "equal" and ax.get_adjustable() == "box"
                       and patch.get_visible() and patch.get_linewidth() == 0
                       and self.facecolor[3] == 1 and not self.rc["figure.hooks"]
                       and fig.get_layout_engine() is None)

    @classmethod
    def get(cls) -> PyplotDefaults:
        if cls._cached is None:
            cls._cached = cls()
        return cls._cached

    def hold(self) -> bool:
        """Whether matplotlib's settings are still the ones these defaults were read under."""
        import matplotlib

        rc = matplotlib.rcParams  # a dict subclass: compared as one, not key by key in Python
        return self.usable and (dict.__eq__(rc, self.rc) if isinstance(rc, dict)
                                else dict(rc) == self.rc)


def _raw_settings(rc) -> dict:
    """A copy of matplotlib's ``rcParams`` as stored (no validation or lookup on the way)."""
    return dict(dict.items(rc)) if isinstance(rc, dict) else dict(rc)


class _Record:
    """The pyplot calls deferred for one figure, what they set (its size and dpi, the image
    and its ``(h, w)``, whether the axis is off), and whether that figure was shown or closed
    since (then replaying it makes the figure and closes it again)."""

    __slots__ = ("axis_off", "calls", "closed", "dpi", "figsize", "pixels", "shape")

    def __init__(self, figsize: tuple[float, float], dpi: float) -> None:
        # Each call's returned object, held weakly: a proxy holds its record, and a record that
        # held its proxies would live (with its image) until the cyclic collector ran.
        self.calls: list[tuple[str, tuple, dict, weakref.ref[_Deferred] | None]] = []
        self.closed = False
        self.figsize, self.dpi = figsize, dpi
        self.pixels = self.shape = None
        self.axis_off = False


class _Deferred:
    """What a deferred pyplot call returned: the real object, made on first use."""

    __slots__ = ("__weakref__", "_pyplot", "_real", "_record")

    def __init__(self, pyplot: DeferredPyplot, record: _Record) -> None:
        object.__setattr__(self, "_pyplot", pyplot)
        object.__setattr__(self, "_record", record)
        object.__setattr__(self, "_real", None)

    def _resolve(self):
        if self._real is None:
            self._pyplot.replay(self._record)
        return self._real

    @property
    def __class__(self):  # isinstance(fig, Figure) holds, as for the real object
        return type(self._resolve())

    def __getattr__(self, name: str):
        return getattr(self._resolve(), name)

    def __setattr__(self, name: str, value) -> None:
        setattr(self._resolve(), name, value)

    def __eq__(self, other) -> bool:
        return self._resolve() == resolve(other)

    def __hash__(self) -> int:
        return hash(self._resolve())

    def __repr__(self) -> str:
        return repr(self._resolve())

    def __dir__(self):
        return dir(self._resolve())


def resolve(obj):
    """``obj``, or the real object a deferred pyplot call stands for."""
    return obj._resolve() if type(obj) is _Deferred else obj


class DeferredPyplot:
    """``plt.figure(figsize=...)``, ``plt.imshow(image)``, ``plt.axis("off")``, ``plt.show()``
    without building matplotlib's figure: the calls are recorded, and ``show`` composes the
    picture with PIL at the context size, as ``Runtime._compose`` does for such a figure built by
    matplotlib (the Axes box from matplotlib's own ``Bbox`` arithmetic on the default subplot
    position). Building the figure and its Axes is most of such a call's time.

    Only exactly that sequence is deferred, and only under matplotlib's default settings, with no
    other figure open, for an RGB image (a PIL image or a uint8 array, copied as ``imshow``
    copies it) and no other arguments. Anything else first replays the recorded calls on the
    real pyplot and then runs as it would have: every pyplot function that reaches the current
    figure goes through ``gcf``/``gca``/``gci`` or the registry functions wrapped here, and the
    objects the deferred calls returned become the real ones on first use (a figure shown or
    closed since is made and closed again). Calls pyplot makes internally are never deferred."""

    # Pyplot's functions that reach the current figure or the figure registry without going
    # through ``gcf``/``gca``, or that make figures of their own (kept from returning deferred
    # ones).
    WRAPPED = ("gcf", "gca", "gci", "get_fignums", "fignum_exists", "get_figlabels", "subplots",
               "subplot_mosaic", "subplot", "subplot2grid", "axes")

    def __init__(self, plt, runtime: Runtime) -> None:
        self.plt = plt
        self.runtime = runtime
        self.enabled = True  # False: every call goes to matplotlib at once (tests, benchmarks)
        self.record: _Record | None = None  # the figure being recorded
        self._depth = 0  # > 0 inside a real pyplot call: nothing is deferred or replayed there
        self.orig = {name: getattr(plt, name)
                     for name in ("figure", "imshow", "axis", "close", *self.WRAPPED)}
        for name in self.WRAPPED:
            setattr(plt, name, self._passthrough(self.orig[name]))
        plt.figure, plt.imshow, plt.axis, plt.close = self.figure, self.imshow, self.axis, self.close

    @property
    def pending(self) -> bool:
        return self.record is not None

    def _call(self, fn, args, kwargs):
        self._depth += 1
        try:
            return fn(*[resolve(a) for a in args], **{k: resolve(v) for k, v in kwargs.items()})
        finally:
            self._depth -= 1

    def _passthrough(self, fn):
        def wrapper(*args, **kwargs):
            if not self._depth:
                self.materialize()
            return self._call(fn, args, kwargs)

        wrapper.__name__, wrapper.__doc__, wrapper.__wrapped__ = fn.__name__, fn.__doc__, fn
        return wrapper

    def _may_defer(self) -> bool:
        return (self.enabled and self.runtime.compose_single_images and not self._depth
                and not self.runtime._open_figures and PyplotDefaults.get().hold())

    def _defer(self, name: str, args: tuple, kwargs: dict, returns: bool):
        proxy = _Deferred(self, self.record) if returns else None
        self.record.calls.append((name, args, kwargs,
                                  weakref.ref(proxy) if proxy is not None else None))
        return proxy

    def _names(self) -> list[str]:
        return [c[0] for c in self.record.calls] if self.record else []

    def figure(self, *args, **kwargs):
        if not self._depth and not self.pending and not args \
                and set(kwargs) <= {"figsize", "dpi"} and self._may_defer():
            defaults = PyplotDefaults.get()
            figsize, dpi = kwargs.get("figsize"), kwargs.get("dpi")
            size = defaults.figsize if figsize is None else _positive_numbers(figsize, 2)
            dots = (defaults.dpi,) if dpi is None else _positive_numbers([dpi], 1)
            if size is not None and dots is not None:
                self.record = _Record(size, dots[0])
                return self._defer("figure", (), dict(kwargs), True)
        if not self._depth:
            self.materialize()
        return self._call(self.orig["figure"], args, kwargs)

    def imshow(self, X, *args, **kwargs):
        if not self._depth and not args and not kwargs and self._names() in ([], ["figure"]) \
                and self._may_defer():
            pixels = self._rgb(X)
            if pixels is not None:
                if not self.pending:
                    defaults = PyplotDefaults.get()
                    self.record = _Record(defaults.figsize, defaults.dpi)
                self.record.pixels = pixels
                self.record.shape = (pixels.shape[:2] if hasattr(pixels, "shape")
                                     else pixels.size[::-1])
                return self._defer("imshow", (pixels,), {}, True)
        if not self._depth:
            self.materialize()
        return self._call(self.orig["imshow"], (X, *args), kwargs)

    def axis(self, *args, **kwargs):
        off = len(args) == 1 and (args[0] is False or (isinstance(args[0], str) and args[0] == "off"))
        if off and not self._depth and not kwargs and self._names()[-1:] == ["imshow"] \
                and self._may_defer():
            import numpy as np

            self.record.axis_off = True
            self._defer("axis", args, {}, False)
            h, w = self.record.shape
            return tuple(np.float64(v) for v in (-0.5, w - 0.5, h - 0.5, -0.5))
        if not self._depth:
            self.materialize()
        return self._call(self.orig["axis"], args, kwargs)

    def close(self, fig=None):
        """``plt.close``: closing the recorded figure (``None``, ``"all"`` or its own object)
        forgets it without making it."""
        if self._depth or not self.pending:
            mine = False
        elif type(fig) is _Deferred:  # (isinstance would make it real)
            name, _, _, ref = self.record.calls[0]
            mine = name == "figure" and ref is not None and ref() is fig
        else:
            mine = fig is None or (isinstance(fig, str) and fig == "all")
        if mine:
            self.discard()
            if fig is None or type(fig) is _Deferred:
                return None
        elif not self._depth:
            self.materialize()
        return self._call(self.orig["close"], (fig,), {})

    def _rgb(self, X):
        """A copy of ``X`` when it is an RGB image (``imshow`` keeps a copy too): an array, or
        a PIL image (copied as one, not converted)."""
        import numpy as np

        if isinstance(X, self.runtime.Image.Image):
            return X.copy() if X.mode == "RGB" and min(X.size) >= 1 else None
        if type(X) is np.ndarray and X.dtype == np.uint8 and X.ndim == 3 and X.shape[2] == 3 \
                and min(X.shape[:2]) >= 1:
            return X.copy()
        return None

    def complete(self) -> bool:
        """Whether the recorded calls are a whole bare one-image figure, ready to compose."""
        return (self.record is not None and self.record.axis_off
                and PyplotDefaults.get().hold())

    @staticmethod
    def box(record: _Record):
        """The recorded image's Axes box in figure fractions, as ``Axes.apply_aspect`` places
        it (the same ``Bbox`` methods on the same numbers)."""
        defaults = PyplotDefaults.get()
        (fw, fh), dpi = record.figsize, record.dpi
        fig_aspect = (fh * dpi) / (fw * dpi)
        h, w = record.shape
        xsize = max(abs((w - 0.5) - (-0.5)), 1e-30)
        ysize = max(abs((h - 0.5) - (-0.5)), 1e-30)
        pb = defaults.position.frozen()
        shrunk = pb.shrunk_to_aspect(1.0 * (ysize / xsize), pb, fig_aspect)
        return shrunk.anchored(defaults.anchor, pb).extents

    def _take(self) -> _Record | None:
        record, self.record = self.record, None
        return record

    def discard(self) -> None:
        """The recorded figure was shown (or closed): forget it; its objects, used later, are
        made as they would be then (closed)."""
        record = self._take()
        if record is not None:
            record.closed = True

    def materialize(self) -> None:
        """Make the recorded calls on the real pyplot now."""
        record = self._take()
        if record is not None:
            self.replay(record)

    def replay(self, record: _Record) -> None:
        """Make ``record``'s calls on the real pyplot, under the settings they were made with,
        on a figure of their own (none was open when they were recorded)."""
        import matplotlib

        if record is self.record:
            self._take()
        if not record.calls:
            return
        calls, record.calls = record.calls, []
        defaults = PyplotDefaults.get()
        rc = contextlib.nullcontext() if defaults.hold() else matplotlib.rc_context(
            {k: v for k, v in defaults.rc.items() if k != "backend"})
        with rc:
            if calls[0][0] != "figure":
                fig = self._call(self.orig["figure"], (), {})
            for name, args, kwargs, proxy in calls:
                real = self._call(self.orig[name], args, kwargs)
                if name == "figure":
                    fig = real
                if proxy is not None and (alive := proxy()) is not None:
                    object.__setattr__(alive, "_real", real)
            if record.closed:
                self._call(self.orig["close"], (fig,), {})


def _positive_numbers(values, n: int) -> tuple[float, ...] | None:
    """``values`` as ``n`` finite positive floats, or None."""
    import math
    import numbers

    try:
        if len(values) != n or not all(isinstance(v, numbers.Real) and not isinstance(v, bool)
                                       for v in values):
            return None
    except TypeError:
        return None
    out = tuple(float(v) for v in values)
    return out if all(math.isfinite(v) and v > 0 for v in out) else None


class Runtime:
    """Persistent globals, image capture and bounded output for one sandbox."""

    MAX_ASPECT = 200
    # Figures that are one image in a bare Axes are composed with PIL (``_single_image``).
    compose_single_images = True
    # Large images in figures matplotlib draws are given to it shrunk (``_shrink_images``);
    # how many were, counted for the tests.
    shrink_drawn_images = True
    shrunk_images = 0

    def __init__(self, preloaded: dict, limits: dict, output=None) -> None:
        self.limits = limits
        self.output = output
        self.plt = preloaded["plt"]
        from matplotlib._pylab_helpers import Gcf

        self._open_figures = Gcf.figs  # pyplot's registry: checked per call without a copy
        self.Image = preloaded["Image"]
        self.images: list[tuple[dict, bytes]] = []  # (spec, raw pixels) of this call's images
        self.dropped = 0
        self.out = BoundedText(int(limits["max_output_chars"]), output)
        self.globals: dict = {"__name__": "__main__", "__builtins__": __builtins__, **preloaded}
        self.globals["display"] = self.display
        runtime = self

        def _plt_show(*_args, **_kwargs):
            runtime.capture_figures()

        def _pil_show(img, *_args, **_kwargs):
            runtime.add_pil(img)

        self.plt.show = _plt_show
        self.Image.Image.show = _pil_show
        self.pyplot = DeferredPyplot(self.plt, self)

    def _check_aspect(self, w: float, h: float) -> None:
        if min(w, h) <= 0 or max(w, h) / min(w, h) >= self.MAX_ASPECT:
            raise ValueError(f"image aspect ratio {w}x{h} is too extreme to show "
                             f"(must be below {self.MAX_ASPECT}:1)")

    def _room(self) -> bool:
        """Whether one more image fits in this call; the ones that do not are counted."""
        if len(self.images) < self.limits["max_images_per_call"]:
            return True
        self.dropped += 1
        return False

    def _fit(self, w: float, h: float, what: str) -> float:
        """The factor that brings a ``w`` x ``h`` image within the shown-pixel limit (1.0 when it
        fits), saying so in the output when it shrinks it."""
        most = self.limits["max_image_pixels"]
        if w * h <= most:
            return 1.0
        scale = (most / (w * h)) ** 0.5 * 0.999  # rounding must not cross the limit
        print(f"[sandbox: {what} {int(w)}x{int(h)} downscaled to {int(w * scale)}x"
              f"{int(h * scale)} to be shown (at most {most} pixels)]")
        return scale

    def _keep(self, img) -> None:
        """Queue ``img`` (RGB, final size) for the host as raw pixels: one copy, no encoding."""
        raw = img.tobytes()
        most = self.limits["max_image_bytes"]
        if len(raw) > most:
            print(f"[sandbox: an image was not shown: it has {len(raw)} bytes of pixels, more "
                  f"than {most}]")
        else:
            self.images.append(({"mode": "RGB", "size": list(img.size)}, raw))

    def _context_size(self, w: float, h: float) -> tuple[int, int] | None:
        """The size the model will see an image of ``w`` x ``h`` at (the vision processor's resize
        rule with the agent's pixel bounds), or None when the sandbox was not told the bounds."""
        bounds = self.limits.get("context_pixels")
        if not bounds:
            return None
        factor = bounds[2] if len(bounds) > 2 else 28
        ch, cw = smart_resize(int(h), int(w), factor=factor, min_pixels=bounds[0],
                              max_pixels=bounds[1])
        return cw, ch

    def _to_context(self, img, size: tuple[int, int] | None = None):
        """``img`` in RGB at its context size (or ``size``): the resize the agent loop would do,
        done here so that only the small image travels back."""
        size = size or self._context_size(*img.size)
        if img.mode != "RGB":
            img = img.convert("RGB")
        if size is None or size == img.size:
            return img
        return img.resize(size, self.Image.Resampling.BICUBIC)

    def add_pil(self, img) -> None:
        w, h = img.size
        self._check_aspect(w, h)
        if not self._room():
            return
        scale = self._fit(w, h, "image")
        if scale < 1.0:
            img = img.resize((max(1, int(w * scale)), max(1, int(h * scale))),
                             self.Image.Resampling.BILINEAR, reducing_gap=2.0)
        self._keep(self._to_context(img))

    def _figure_sizes(self, w: float, h: float, dpi: float):
        """For a ``w`` x ``h`` pixel figure at ``dpi``: the dpi it is shown at (within the shown-
        pixel limit), its size in the context (None when unknown) and its canvas size then."""
        shown_dpi = dpi * self._fit(w, h, "figure")
        size = self._context_size(w * shown_dpi / dpi, h * shown_dpi / dpi)
        return shown_dpi, size, (int(w * shown_dpi / dpi), int(h * shown_dpi / dpi))

    def add_deferred(self) -> bool:
        """Show the one-image figure ``DeferredPyplot`` recorded, composed without matplotlib;
        False (nothing shown, the record kept) when it cannot be composed."""
        import numpy as np

        pyplot, record = self.pyplot, self.pyplot.record
        dpi = record.dpi
        w, h = np.array(record.figsize) * dpi  # as ``fig.get_size_inches() * fig.dpi``
        try:
            self._check_aspect(w, h)
        except ValueError:
            pyplot.discard()
            raise
        if not self._room():
            pyplot.discard()
            return True
        _, size, canvas_size = self._figure_sizes(w, h, dpi)
        defaults = PyplotDefaults.get()
        try:
            picture = self._paint(record.pixels, pyplot.box(record),
                                  defaults.rc["image.interpolation"], defaults.facecolor,
                                  canvas_size, size or canvas_size)
        except Exception:  # noqa: BLE001 - an unforeseen case is drawn by matplotlib instead
            picture = None
        if picture is None:
            return False
        pyplot.discard()
        self._keep(picture)
        return True

    def add_figure(self, fig) -> None:
        try:
            w, h = fig.get_size_inches() * fig.dpi
            self._check_aspect(w, h)
            if not self._room():
                return
            dpi, size, canvas_size = self._figure_sizes(w, h, fig.dpi)
            if self.compose_single_images:
                composed = self._single_image(fig, canvas_size, size or canvas_size)
                if composed is not None:
                    self._keep(composed)
                    return
            if size is not None:
                # Drawn at about the size the model will see (never below it), not at full size
                # and then shrunk: a 640x480 figure seen at 112x84 costs a fifth of the drawing.
                dpi = min(dpi, fig.dpi * max(size[0] / w, size[1] / h) * 1.25)
            # Rendered into Agg's buffer and taken as pixels: no PNG written and read back.
            canvas = fig.canvas
            if not hasattr(canvas, "buffer_rgba"):
                from matplotlib.backends.backend_agg import FigureCanvasAgg

                canvas = FigureCanvasAgg(fig)
            fig.set_dpi(dpi)
            if self.shrink_drawn_images:
                self._shrink_images(fig)
            canvas.draw()
            rgba = self.Image.frombuffer("RGBA", canvas.get_width_height(),
                                         canvas.buffer_rgba(), "raw", "RGBA", 0, 1)
            self._keep(self._to_context(rgba, size))
        finally:
            self.plt.close(fig)

    def _shrink_images(self, fig) -> None:
        """Give matplotlib a box-averaged copy of each large RGB image it is about to shrink.

        ``plt.imshow(image); plt.show()`` with the axes on is drawn by matplotlib, which
        resamples the whole image into an Axes of a few dozen pixels at the context size: 24 of
        a 1024x768 image's ~55 ms, and most of the call for a 4K or 8K one. An image shown
        at most ``1 / (2 f)`` display pixels per image pixel is replaced by its ``f`` x ``f``
        box average (its extent kept), so matplotlib still downsamples at least twice with its
        own anti-aliasing: the same picture to 0.1-0.4 of 255 on average (test_sandbox). The
        bound holds wherever a layout puts the Axes (it uses the whole figure's size and the
        view's zoom). Only uint8 RGB data at the default interpolation, not masked, on a plain
        data transform; anything else, or anything unforeseen, is drawn as it is. The figure is
        closed after it is shown, so the code never sees the copy."""
        import numpy as np

        fw, fh = fig.get_size_inches() * fig.dpi
        for ax in fig.axes:
            for im in ax.get_images():
                try:
                    data = im.get_array()
                    if (im.get_interpolation() != "auto" or im.get_interpolation_stage() != "auto"
                            or im.get_transform() is not ax.transData
                            or not ax.transData.is_affine or np.ma.is_masked(data)):
                        continue
                    data = np.asarray(data)
                    if data.dtype != np.uint8 or data.ndim != 3 or data.shape[2] != 3:
                        continue
                    h, w = data.shape[:2]
                    x0, x1, y0, y1 = im.get_extent()
                    (vx0, vx1), (vy0, vy1) = ax.get_xlim(), ax.get_ylim()
                    zoom_x, zoom_y = abs(x1 - x0) / abs(vx1 - vx0), abs(y1 - y0) / abs(vy1 - vy0)
                    per_pixel = max(fw * zoom_x / w, fh * zoom_y / h)
                    f = int(1 / (2 * per_pixel)) if per_pixel > 0 else 0
                    if f < 2:
                        continue
                    small = np.asarray(self.Image.fromarray(data).reduce(f))
                    im.set_extent((x0, x1, y0, y1))  # (it autoscales the view to this image:
                    ax.set_xlim((vx0, vx1), auto=None)  # the view it had is put back)
                    ax.set_ylim((vy0, vy1), auto=None)
                    im.set_data(small)
                    self.shrunk_images += 1
                except Exception:  # noqa: BLE001, S112 - drawn as it is
                    continue

    def _single_image(self, fig, canvas_size: tuple[int, int], size: tuple[int, int]):
        """The picture of ``fig`` at ``size`` composed directly with PIL, or None when the figure
        is anything but one image filling one bare Axes (axis off, no title, no other artist).

        That is what ``plt.imshow(crop); plt.axis("off"); plt.show()`` draws: the figure's
        background with the image resampled into the Axes box. Matplotlib takes most of the
        time of such a call to draw it (Axes, masked arrays, its own resampler at the figure's
        size, then a second resize to the context size); here the image is resampled once,
        straight to where it lands at the context size. The result has the figure's size and
        layout, and the image's placement and interpolation (PIL's filter of the same kind);
        anything this does not reproduce goes through matplotlib (``add_figure``).
        """
        try:
            return self._compose(fig, canvas_size, size)
        except Exception:  # noqa: BLE001 - an unforeseen figure is drawn by matplotlib instead
            return None

    def _compose(self, fig, canvas_size: tuple[int, int], size: tuple[int, int]):
        import numpy as np
        from matplotlib.layout_engine import PlaceHolderLayoutEngine

        engine = fig.get_layout_engine()  # one that runs at draw time moves the Axes
        if len(fig.axes) != 1 or not (engine is None or isinstance(engine, PlaceHolderLayoutEngine)):
            return None
        ax = fig.axes[0]
        if fig.get_children() != [fig.patch, ax] or len(ax.images) != 1:
            return None
        im = ax.images[0]
        title_free = all(not t.get_visible() or not t.get_text()
                         for t in (ax.title, ax._left_title, ax._right_title))
        bare = (not ax.axison and ax.get_visible() and ax.name == "rectilinear"
                and ax.get_axes_locator() is None and not ax.child_axes and ax.legend_ is None
                and ax.get_xscale() == ax.get_yscale() == "linear" and title_free
                and all(a is im or a in ax.spines.values() or a in ax._axis_map.values()
                        or a in (ax.title, ax._left_title, ax._right_title, ax.patch)
                        for a in ax.get_children()))
        patch = fig.patch
        if not bare or not patch.get_visible() or patch.get_linewidth() != 0 \
                or fig.get_agg_filter() is not None or ax.get_agg_filter() is not None:
            return None
        r, g, b, a = patch.get_facecolor()
        if a != 1:
            return None
        if not im.get_visible() or im.get_alpha() not in (None, 1) or im.get_clip_path() is not None \
                or im.get_agg_filter() is not None or im.get_transform() is not ax.transData \
                or im.get_path_effects():
            return None
        # The image must fill the Axes box exactly: its extent is the view (same orientation).
        ax.apply_aspect()
        left, right, bottom, top = im.get_extent()
        if tuple(ax.get_xlim()) != (left, right) or tuple(ax.get_ylim()) != (bottom, top):
            return None
        if im.clipbox is not None and not np.allclose(im.clipbox.extents, ax.bbox.extents):
            return None
        pixels = self._rgb_pixels(im)
        if pixels is None:
            return None
        # The Axes box in figure fractions, after the aspect.
        return self._paint(pixels, ax.get_position().extents, im.get_interpolation(),
                           (r, g, b), canvas_size, size)

    def _paint(self, pixels, extents, interp: str, facecolor, canvas_size: tuple[int, int],
               size: tuple[int, int]):
        """The figure at ``size``: its background, and ``pixels`` (an RGB array or PIL image)
        resampled into the Axes box ``extents`` (figure fractions) with the PIL filter of
        matplotlib's ``interp``; None when no PIL filter reproduces it."""
        import numpy as np

        Image = self.Image
        src = pixels if isinstance(pixels, Image.Image) else Image.fromarray(pixels)
        iw, ih = src.size
        x0, y0, x1, y1 = extents
        # Matplotlib's choice for "auto"/"antialiased", at the size it would draw the figure.
        if interp in ("auto", "antialiased"):
            dx, dy = (x1 - x0) * canvas_size[0], (y1 - y0) * canvas_size[1]
            near_x = dx > 3 * iw or np.isclose(dx, iw) or np.isclose(dx, 2 * iw)
            near_y = dy > 3 * ih or np.isclose(dy, ih) or np.isclose(dy, 2 * ih)
            interp = "nearest" if near_x and near_y else "hanning"
        if interp not in PIL_FILTERS:
            return None
        W, H = size
        bx0, bx1 = int(np.floor(x0 * W + 0.5)), int(np.floor(x1 * W + 0.5))
        by0, by1 = int(np.floor((1 - y1) * H + 0.5)), int(np.floor((1 - y0) * H + 0.5))
        if bx1 <= bx0 or by1 <= by0:
            return None
        box = (bx1 - bx0, by1 - by0)
        if box != src.size:
            resample = getattr(Image.Resampling, PIL_FILTERS[interp])
            # Shrunk 2x or more: reduced by the whole factor first (a box average), then
            # filtered (as ``Image.thumbnail`` does); 1.8 against 2.9 ms for a crop zoomed to
            # 768 px and shown at 302 px, and as close to what matplotlib draws (a test bounds
            # the difference). Nearest-neighbour images are never averaged.
            gap = SHRINK_REDUCING_GAP if resample != Image.Resampling.NEAREST else None
            src = src.resize(box, resample, reducing_gap=gap)
        if box == (W, H):
            return src
        r, g, b = facecolor[:3]
        out = Image.new("RGB", (W, H), (round(r * 255), round(g * 255), round(b * 255)))
        out.paste(src, (bx0, by0))
        return out

    @staticmethod
    def _rgb_pixels(im):
        """An image artist's pixels as an (H, W, 3) uint8 array, top row first, as matplotlib
        would colour them (colormap and norm for scalar data); None for anything with
        transparency or invalid values (those go through matplotlib)."""
        import numpy as np

        A = im.get_array()
        if A is None or A.ndim not in (2, 3) or A.size == 0 or np.ma.is_masked(A):
            return None
        data = np.ma.getdata(A)
        if data.ndim == 2:
            if data.dtype.kind not in "uif":
                return None
            rgba = im.to_rgba(data, bytes=True)
        elif data.shape[2] in (3, 4):
            if data.dtype == np.uint8:
                rgba = data
            elif data.dtype.kind == "f":
                # In [0, 1] only: matplotlib clips anything else, with a warning in the output.
                if not (np.isfinite(data).all() and data.min() >= 0 and data.max() <= 1):
                    return None
                rgba = (data * 255).astype(np.uint8)  # as matplotlib's to_rgba converts it
            else:
                return None
        else:
            return None
        if rgba.shape[2] == 4:
            if not (rgba[..., 3] == 255).all():
                return None
            rgba = rgba[..., :3]
        if im.origin == "lower":
            rgba = rgba[::-1]
        return np.ascontiguousarray(rgba)

    def capture_figures(self) -> None:
        if self.pyplot.complete() and not self.add_deferred():
            self.pyplot.materialize()  # then drawn below, as matplotlib's figure
        for num in self.plt.get_fignums():
            self.add_figure(self.plt.figure(num))

    def display(self, obj) -> None:
        """Show a PIL image, a numpy array or a matplotlib figure to the model."""
        obj = resolve(obj)
        if isinstance(obj, self.Image.Image):
            self.add_pil(obj)
        elif hasattr(obj, "savefig"):
            self.add_figure(obj)
        elif hasattr(obj, "shape") and hasattr(obj, "dtype"):
            self.add_pil(self.Image.fromarray(obj))
        else:
            print(repr(obj))

    def run(self, code: str) -> dict:
        limit = int(self.limits["max_output_chars"])
        out = self.out
        out.reset()
        self.images = []
        self.dropped = 0
        old_out, old_err = sys.stdout, sys.stderr
        sys.stdout = sys.stderr = out
        _pumps.set_sink(out)
        start = time.monotonic()
        status, error = "ok", ""
        try:
            compiled = compile(code, "<code>", "exec")
            exec(compiled, self.globals)  # noqa: S102 - running the model's code is the point
            # Figures drawn but never shown are closed, not leaked into the next call.
            if self._open_figures or self.pyplot.pending:
                self.plt.close("all")
        except MemoryError:
            status, error = "oom", "MemoryError: the code exceeded the sandbox's memory limit"
        except SystemExit as exc:
            status, error = "error", (f"SystemExit: {exc.code!r} (sys.exit() ends nothing here; "
                                      "the runtime keeps its state)")
        except BaseException:  # noqa: BLE001 - every user error becomes a result
            status = "error"
            etype, value, tb = sys.exc_info()
            frames = [f for f in traceback.extract_tb(tb) if f.filename == "<code>"]
            lines = code.splitlines()
            for f in frames:
                if f.lineno and 0 < f.lineno <= len(lines):
                    f._line = lines[f.lineno - 1]  # type: ignore[attr-defined]
            error = "Traceback (most recent call last):\n" + "".join(
                traceback.format_list(frames)) + "".join(
                traceback.format_exception_only(etype, value))
            with contextlib.suppress(Exception):
                self.plt.close("all")
        finally:
            sys.stdout, sys.stderr = old_out, old_err
        _pumps.drain()
        _pumps.set_sink(None)
        if self.dropped:
            n, most = self.dropped, self.limits["max_images_per_call"]
            out.write(f"[sandbox: {n} image{'s' if n > 1 else ''} beyond the limit of {most} per "
                      f"call {'were' if n > 1 else 'was'} not shown]\n")
        text, truncated = out.getvalue()
        err_text, err_trunc = error, False
        if len(error) > limit:
            err = BoundedText(limit)
            err.write(error)
            err_text, err_trunc = err.getvalue()
        return {"status": status, "stdout": text, "stderr": err_text,
                "truncated": truncated or err_trunc, "duration_s": time.monotonic() - start,
                "images": self.images}


_NO_BYTES = bytes(4)  # a C int 0, as FIONREAD fills it


class _FdPumps:
    """Routes bytes written to fds 1 and 2 (C code, child processes) to the current call's sink.

    ``drain`` makes sure everything written before the call ended has reached the sink. When the
    pipe is empty and the reader holds nothing back (the reader reads and emits under
    ``io_lock``, so "empty" cannot be seen while bytes are in flight between the two), that is
    already true and costs nothing. Otherwise it writes a marker into the pipe and waits until the
    reader has passed it: the pipe is FIFO, so everything written before has then been emitted.
    """

    MARKER = b"\x00pyvision-drain\x00"

    def __init__(self) -> None:
        self.sink: BoundedText | None = None
        self.lock = threading.Lock()      # the sink
        self.io_lock = threading.Lock()   # a read and its emit, as one step
        self.drained = threading.Event()
        self.write_fd: int | None = None
        self.read_fd: int | None = None
        self.carry = b""

    def set_sink(self, sink: BoundedText | None) -> None:
        with self.lock:
            self.sink = sink

    def _idle(self) -> bool:
        """Nothing in the pipe (FIONREAD leaves the zero int as it was) and nothing held back by
        the reader."""
        with self.io_lock:
            return fcntl.ioctl(self.read_fd, termios.FIONREAD, _NO_BYTES) == _NO_BYTES \
                and not self.carry

    def drain(self, timeout_s: float = 1.0) -> None:
        if self.write_fd is None:
            return
        libc.fflush(None)
        try:
            if self._idle():
                return
        except OSError:
            pass  # the quick check could not tell: drain the pipe the full way below
        self.drained.clear()
        try:
            os.write(self.write_fd, self.MARKER)
        except OSError:
            return
        self.drained.wait(timeout_s)

    def start(self) -> None:
        r, w = os.pipe()
        # A private write end for markers, so user code closing fd 1 cannot block draining.
        self.write_fd = os.dup(w)
        self.read_fd = r
        os.dup2(w, 1)
        os.dup2(w, 2)
        os.close(w)
        threading.Thread(target=self._loop, args=(r,), daemon=True).start()

    def _emit(self, data: bytes) -> None:
        with self.lock:
            if self.sink is not None and data:
                self.sink.write(data.decode("utf-8", "replace"))

    def _loop(self, fd: int) -> None:
        keep = len(self.MARKER) - 1
        while True:
            try:
                select.select([fd], [], [])  # wait without taking the bytes
            except OSError:
                return
            with self.io_lock:
                try:
                    data = os.read(fd, 65536)
                except OSError:
                    return
                if not data:
                    return
                data = self.carry + data
                while (i := data.find(self.MARKER)) >= 0:
                    self._emit(data[:i])
                    data = data[i + len(self.MARKER):]
                    self.drained.set()
                # Hold back only what may be the start of a marker (a NUL and what follows it):
                # everything else reaches the sink now, so a process killed in the middle of a
                # call still leaves its output there.
                cut = next((i for i in range(max(0, len(data) - keep), len(data))
                            if self.MARKER.startswith(data[i:])), len(data))
                self._emit(data[:cut])
                self.carry = data[cut:]


_pumps = _FdPumps()


# -- worker ------------------------------------------------------------------------------------


SETUP_FAILED = 72


def _setup_failed(setup_fd: int, sid: str, message: str) -> None:
    """End a worker that could not load its media: the reason goes to the host's zygote log."""
    os.write(setup_fd, f"sandbox worker {sid}: {message}\n".encode("utf-8", "replace"))
    os._exit(SETUP_FAILED)


def worker_main(sock: socket.socket, limits: dict, preloaded: dict, mode: str, workdir: str,
                setup_fd: int, sid: str, output_fd: int) -> None:
    """Load the media, then run code until the host hangs up. ``setup_fd`` is the zygote's
    stderr, open only until the media are loaded (the code's own output is captured).
    ``output_fd`` is the shared output buffer: handed to the host once the media are loaded,
    before any of the code runs, then closed here (the mapping stays)."""
    output = mmap.mmap(output_fd, output_buffer_size(int(limits["max_output_chars"])))
    frames = FrameReader(sock)
    init = json.loads(frames.frame())
    os.chdir(workdir)
    os.environ.clear()
    os.environ.update({"HOME": workdir, "TMPDIR": workdir, "PATH": "/usr/bin:/bin",
                       "MPLCONFIGDIR": workdir, "OMP_NUM_THREADS": "1", "LANG": "C.UTF-8"})
    # What TMPDIR says, for the code's tempfile calls too: the module read its folder once, in
    # the zygote (``mkdtemp`` of each rlimit sandbox's folder), which the worker may not write.
    tempfile.tempdir = workdir
    # Every sandbox starts from the same random state (the zygote's was drawn from the OS when it
    # imported the modules), so code that samples gives the same numbers on every run.
    random.seed(0)
    preloaded["np"].random.seed(0)
    runtime = Runtime(preloaded, limits, output)
    Image = preloaded["Image"]
    for spec in init.get("media", []):
        blob = frames.frame()
        if spec["kind"] == "image_raw":
            runtime.globals[spec["name"]] = Image.frombytes(spec["mode"], tuple(spec["size"]), blob)
        elif spec["kind"] == "image":
            runtime.globals[spec["name"]] = open_image(blob, Image, preloaded["np"])
        else:
            path = os.path.join(workdir, f"{spec['name']}{spec.get('suffix', '.mp4')}")
            with open(path, "wb") as fh:
                fh.write(blob)
            del blob
            if "decord" not in preloaded:
                _setup_failed(setup_fd, sid, f"decord is not importable in the sandbox "
                                             f"({sys.executable}), so {spec['name']} cannot be "
                                             "opened")
            try:
                runtime.globals[spec["name"]] = preloaded["decord"].VideoReader(path)
            except Exception as exc:  # noqa: BLE001 - decord raises its own DECORDError
                _setup_failed(setup_fd, sid, f"decord cannot open {spec['name']}: {exc}")
    os.close(setup_fd)
    send_frame(sock, json.dumps({"ready": True}).encode())
    socket.send_fds(sock, [b"o"], [output_fd])
    os.close(output_fd)
    while True:
        try:
            msg = frames.frame()
        except EOFError:
            os._exit(0)
        if msg[:1] != RUN_TAG:
            continue
        result = runtime.run(msg[1:].decode("utf-8", "surrogatepass"))
        if mode == "strict":
            end_strays()
        images = result.pop("images")
        result["images"] = [spec for spec, _ in images]
        send_frame(sock, json.dumps(result).encode())
        for _, blob in images:
            send_frame(sock, blob)


def end_strays(wait_s: float = 1.0) -> None:
    """End every process a call left running and reap it. Called by the worker, pid 1 of the
    sandbox's own pid namespace (strict mode only: elsewhere ``kill(-1)`` would reach every
    process of the uid): a fork that outlived the call would keep its own CPU and memory limits
    and run on unseen. Repeated until ``kill(-1)`` finds no process (one forking in a loop can
    slip past a single pass). Threads of the runtime itself are left alone."""
    until = time.monotonic() + wait_s
    while True:
        try:
            os.kill(-1, signal.SIGKILL)  # every process of the namespace but its init, this one
        except (ProcessLookupError, PermissionError):
            return  # none left
        with contextlib.suppress(ChildProcessError):
            while os.waitpid(-1, os.WNOHANG)[0] > 0:
                pass
        if time.monotonic() > until:
            return  # still dying (or reaped elsewhere): the next call ends them
        time.sleep(0.001)


def _close_fds_except(keep: set[int]) -> None:
    """Close every descriptor from 3 up except ``keep``: the ones /proc/self/fd lists (a few; a
    loop of ~4,000 failing closes cost each sandbox about 4 ms of CPU), else every number up to
    the descriptor limit with ``os.closerange`` (without the close_range system call, kernels
    before 5.9, that is one close a number)."""
    try:
        opened = [int(fd) for fd in os.listdir("/proc/self/fd")]
    except (OSError, ValueError):
        opened = None
    if opened is not None:
        for fd in opened:  # (listdir's own descriptor is among them, already closed)
            if fd >= 3 and fd not in keep:
                with contextlib.suppress(OSError):
                    os.close(fd)
        return
    low = 3
    for fd in sorted(k for k in keep if k >= 3):
        os.closerange(low, fd)
        low = fd + 1
    os.closerange(low, max(os.sysconf("SC_OPEN_MAX"), 4096))


def spawn(conn_fd: int, limits: dict, preloaded: dict, mode: str, control_fd: int,
          sid: str, workdir: str | None = None) -> int:
    """Fork the processes of one sandbox; return the pid the zygote tracks. ``workdir``: the
    worker's own folder in rlimit mode (made by the zygote, which removes it when the sandbox
    ends)."""
    pid = os.fork()
    if pid:
        os.close(conn_fd)
        return pid
    # Intermediate: leaves the zygote's namespaces, then forks the worker (pid 1 of a new pid ns).
    code = 70
    try:
        os.close(control_fd)
        _close_fds_except({0, 1, 2, conn_fd})
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.close(devnull)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        # A process group of its own: kill(0, ...) from the code cannot reach the zygote's group
        # (same uid, so the kernel would allow it). Not a session of its own: the zygote's (which
        # has no terminal) stays every sandbox's, so where the kernel groups CPU time by session
        # (autogroup scheduling, on by default in most distributions) all the sandboxes together
        # weigh as much as the process that runs them, not each one as much (with a session
        # each, eight sandboxes looping left the evaluating process a ninth of the CPU).
        os.setpgid(0, 0)
        if mode == "strict":
            enter_namespaces(int(limits.get("tmp_mb", 256)))
        worker = os.fork()
        if worker == 0:
            libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
            if mode == "strict":
                # pid 1 of its own namespace: killing it ends every process it started. In
                # rlimit mode it stays in the intermediate's group, which the zygote kills.
                os.setpgid(0, 0)
            sock = socket.socket(fileno=conn_fd)
            prefer_for_oom_kill()  # while /proc is there and the process dumpable
            if mode == "strict":
                hide_proc()
                workdir = "/tmp"
            else:  # its own folder under the zygote's temporary one, the only one it may write
                workdir = workdir or tempfile.mkdtemp(prefix="pyvision-sbx-")
                confine_files(READABLE, workdir)
            # Sized before the file-size rlimit applies (it bounds memfds too).
            output_fd = os.memfd_create("pyvision-output", os.MFD_CLOEXEC)
            os.ftruncate(output_fd, output_buffer_size(int(limits["max_output_chars"])))
            apply_rlimits(limits, mode)
            # In every mode: rlimit mode runs as the host's uid, every capability of a root host
            # with it. After the rlimits (a root host may set one above its hard limit, which
            # needs CAP_SYS_RESOURCE), Landlock and the folder; before the code.
            drop_capabilities()
            # After the output buffer's memfd, before any thread; after the folder is made
            # (nothing from here on sets a mode, an owner or a time).
            rlimit = mode != "strict"
            install_seccomp_filter(keep_group=rlimit, keep_file_meta=rlimit,
                                   keep_host_sockets=rlimit)
            libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)
            setup_fd = os.dup(2)
            try:
                _pumps.start()
            except RuntimeError as exc:  # no thread: the process limit is reached already
                _setup_failed(setup_fd, sid, f"the runtime cannot start its output thread ({exc}: "
                                             f"{os.strerror(errno.EAGAIN)})")
            try:
                worker_main(sock, limits, preloaded, mode, workdir, setup_fd, sid, output_fd)
            finally:
                os._exit(0)
        os.close(conn_fd)
        _, status = os.waitpid(worker, 0)
        if os.WIFSIGNALED(status):
            # Ended the same way, so the zygote sees the signal itself: an exit code cannot
            # tell ``os._exit(137)`` from a SIGKILL (a memory kill).
            end_by_signal(os.WTERMSIG(status))
        code = os.WEXITSTATUS(status)
    except BaseException:  # noqa: BLE001 - report set-up failures through the exit code
        traceback.print_exc()
        code = 71
    os._exit(code)


def end_by_signal(sig: int) -> None:
    """End this process by ``sig`` (its default action, no core file), or, for a signal whose
    default is not to end it, with the shell's code for it (128 + sig)."""
    with contextlib.suppress(OSError, ValueError):  # SIGKILL's action cannot be set
        signal.signal(sig, signal.SIG_DFL)
    with contextlib.suppress(OSError, ValueError):
        signal.pthread_sigmask(signal.SIG_UNBLOCK, [sig])
        os.kill(os.getpid(), sig)
    os._exit(128 + sig)


def zygote_main(control_fd: int, mode: str) -> None:
    control = socket.socket(fileno=control_fd)
    if mode == "strict" and os.getuid() == 0:
        # Started by a root host: bwrap created no user namespace, so drop to nobody here. With a
        # non-zero uid the kernel enforces RLIMIT_NPROC (it never does for uid 0).
        os.setgroups([])
        os.setresgid(65534, 65534, 65534)
        os.setresuid(65534, 65534, 65534)
    libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    preloaded = _preload()
    _warm_up(preloaded)
    children: dict[int, str] = {}
    workdirs: dict[int, str] = {}  # rlimit mode: each sandbox's folder, removed when it ends

    def hang_up() -> None:
        """The host is gone: end every sandbox (its processes, its folder) and this zygote."""
        for pid in children:
            end_sandbox(pid, mode)
        for path in workdirs.values():
            remove_tree(path)
        os._exit(0)

    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    control.send(json.dumps({"event": "ready", "uid": os.getuid(), "pid": os.getpid()}).encode())
    while True:
        ready, _, _ = select.select([control], [], [], 0.05)
        while True:
            try:  # (left a zombie: its pid, the number of its process group, is not reused yet)
                exited = os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)
            except ChildProcessError:
                break
            if exited is None:
                break
            pid = exited.si_pid
            if pid in children:  # what its worker left running ends with it
                end_sandbox(pid, mode)
            _, status = os.waitpid(pid, 0)
            if pid in workdirs:  # (symbolic links the code left in it are removed, not followed)
                remove_tree(workdirs.pop(pid))
            sid = children.pop(pid, None)
            if sid is not None:
                info = {"signal": os.WTERMSIG(status)} if os.WIFSIGNALED(status) \
                    else {"code": os.WEXITSTATUS(status)}
                try:
                    control.send(json.dumps({"event": "exit", "id": sid, **info}).encode())
                except OSError:
                    hang_up()
        if not ready:
            continue
        try:
            data, fds, _, _ = socket.recv_fds(control, 65536, 4)
        except OSError:
            hang_up()
        if not data:
            hang_up()
        msg = json.loads(data)
        if msg["op"] == "spawn" and fds:
            workdir = None
            if mode != "strict":
                with contextlib.suppress(OSError):  # (else the worker tries, and says why)
                    workdir = tempfile.mkdtemp(prefix="pyvision-sbx-")
            pid = spawn(fds[0], msg["limits"], preloaded, mode, control.fileno(), msg["id"],
                        workdir)
            children[pid] = msg["id"]
            if workdir:
                workdirs[pid] = workdir
            control.send(json.dumps({"event": "spawned", "id": msg["id"]}).encode())
        elif msg["op"] == "kill":
            for pid, sid in children.items():
                if sid == msg["id"]:
                    end_sandbox(pid, mode)


def end_sandbox(pid: int, mode: str) -> None:
    """SIGKILL the sandbox whose intermediate is ``pid``: in strict mode the worker, pid 1 of its
    namespace, dies with it and takes every process with it; in rlimit mode every process the
    code started is in the intermediate's process group (the seccomp filter refuses leaving it),
    which is killed whole, even once the intermediate has exited (a zombie, not yet reaped)."""
    if mode != "strict":
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGKILL)  # the intermediate leads the group
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


def remove_tree(root: str) -> None:
    """Remove the folder ``root`` and everything in it as far as its owner may, never raising.

    A sandbox's folder holds what its code left, once the code is gone: a folder it made
    unreadable or unwritable (``os.mkdir(d, 0)``; ``os.chmod`` where no seccomp filter refuses
    it), which the owner cannot list or empty (root
    can), is given back the owner's rwx and its removal retried, once a path. Nothing outside
    ``root`` is touched: symbolic links are removed, never followed, chmodded or descended into,
    and no folder above ``root`` changes."""
    inside = os.path.join(root, "")
    tried: set[str] = set()

    def retry(func: Callable, path: str, exc_info: tuple) -> None:
        if not isinstance(exc_info[1], PermissionError) or path in tried \
                or not (path == root or path.startswith(inside)):
            return
        tried.add(path)
        if path != root:  # its folder, inside root: listing and emptying it is what failed
            _owner_may_empty(os.path.dirname(path))
        if _owner_may_empty(path):  # a folder (not a link to one): its entries, then itself
            shutil.rmtree(path, onerror=retry)
        else:
            with contextlib.suppress(OSError):
                os.unlink(path)

    shutil.rmtree(root, onerror=retry)


def _owner_may_empty(path: str) -> bool:
    """Give the owner rwx on the folder ``path``; False, changing nothing, when it is not a
    folder (a symbolic link, whatever it points to, is not) or cannot be changed. The folder is
    opened without following a link (O_PATH: no permission on it needed) and changed through
    that descriptor, so a link put in its place is never followed."""
    try:
        fd = os.open(path, os.O_PATH | os.O_NOFOLLOW | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        os.chmod(f"/proc/self/fd/{fd}", (os.fstat(fd).st_mode & 0o7777) | 0o700)
    except OSError:
        return False
    finally:
        os.close(fd)
    return True


def extend_import_path(entries: str) -> None:
    """Add the host's import roots (os.pathsep-separated) ahead of the interpreter's own site
    folders, as PYTHONPATH would have placed them; ``-I`` left them out."""
    extra = [p for p in entries.split(os.pathsep) if p and p not in sys.path]
    at = next((i for i, p in enumerate(sys.path) if "-packages" in p), len(sys.path))
    sys.path[at:at] = extra


# What confined workers may read (rlimit mode): set once the import path is complete.
READABLE: list[str] = []

if __name__ == "__main__":
    roots = sys.argv[3] if len(sys.argv) > 3 else ""
    extend_import_path(roots)
    READABLE = readable_paths([p for p in roots.split(os.pathsep) if p])
    zygote_main(int(sys.argv[1]), sys.argv[2])
