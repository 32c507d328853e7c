"""How the sandbox is confined: the isolation mode and the bubblewrap command line.

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
  started with it (double-forked daemons included); when a call returns, pid 1 ends every
  process the call left running. A seccomp filter refuses ``memfd_create``, ``memfd_secret``
  and ``shmget``, whose memory the address-space limit does not count, ``io_uring_setup``,
  ``socket`` and ``socketpair`` for every family but ``AF_UNIX``, ``prctl(PR_SET_PDEATHSIG)``
  (the death signal that ends pid 1 when its parent is killed), and System V IPC, POSIX message
  queues and the kernel's keyrings (``_zygote.SECCOMP_IPC_CALLS``): no namespace separates the
  keyrings, so the host's session keyring is the sandbox's too, and in rlimit mode the IPC
  objects are the host's. It allows ``prlimit64``, ``setpriority``, ``ioprio_set`` and the
  ``sched_set*`` calls on the calling process only (a pid of 0,
  ``_zygote.SECCOMP_SELF_ONLY_CALLS``): in rlimit mode the code could else set the limits,
  nice value, CPUs or policy of any process of the user's, the host that runs it too (an
  ``RLIMIT_CPU`` of 1 second kills it).
- The code shares the worker's process, so it can forge the worker's reply: the host holds every
  reply to the limits itself (field types, output length, header size, the shown images' pixels
  and aspect, the call's deadline) and reads anything else as a crash, never an exception.
- Media reaches the sandbox as bytes over its socket and is decoded inside it, so a malicious image
  or video is parsed by the sandboxed process, not by the host.

What is not isolated
- The kernel is shared (a kernel exploit escapes; the seccomp filter refuses a few calls only).
- CPU time is limited per sandbox but not scheduled fairly between sandboxes; the host's memory is
  only protected by per-process address-space limits (no cgroup memory accounting), so during
  one call a sandbox's processes together may use up to ``max_processes`` x ``memory_mb``.
  Should that exhaust the machine, the kernel's OOM killer ends sandbox processes first: each
  worker sets its ``oom_score_adj`` to 1000, which the processes it starts inherit.
- Images returned by the code are checked (raw RGB pixels whose byte count matches their
  bounded size; nothing is decoded on the host) but are the code's choice: it can show the model
  anything it can draw.

Without bubblewrap (``isolation: rlimit``, or ``auto`` when bwrap is missing or cannot create
namespaces) the rlimits, the seccomp filter, a kill of the process group that holds every process
the code starts, and a working folder of its own apply. The filter refuses there, besides the
calls above: ``setsid`` and ``setpgid``; any change to a file's mode, owner, times, extended
attributes or inode flags (chattr's ioctls); and every socket of the code's own: ``socket`` for
every family, ``AF_UNIX`` too, ``connect``, and ``socketpair`` but of a stream or seqpacket type
(which reaches no address). So the code reaches no network and no Unix socket a local service
left open to the user (an ssh-agent, a D-Bus session bus, docker.sock, ``/dev/log``), which
neither Landlock nor a namespace would keep it from; code that listens on a Unix socket of its
own (``multiprocessing.Manager``) fails there (``_zygote.seccomp_rules``). Where the kernel has
Landlock (5.13+, no privilege needed) each worker is confined with it: it may read only the
runtime (``_zygote.readable_paths``: the interpreter, its site folders and the host's import
roots, never another folder on its import path such as an editable install's checkout, the
system's libraries) and write only its own folder, and with Landlock ABI 6 it can signal no
process outside the sandbox. A loud warning says which applies. The mode is still weaker than
bubblewrap: the code runs as the user's uid in the host's namespaces; without Landlock it is
**no security boundary** at all (the code can read and write the user's files, and through
``/proc`` the environment of the user's other processes, and signal them). Its process limit is
shared too: for a user other than root the kernel counts all of that user's tasks, so a sandbox
may start ``max_processes`` beyond those the user runs when it starts
(``_zygote.process_limit``).

A root host in rlimit mode: the code runs as uid 0, but each worker drops every capability
before it runs, as in bubblewrap mode (``_zygote.drop_capabilities``: the bounding and ambient
sets too, and securebits locked, so nothing it starts regains one). So it cannot mount, reboot,
freeze a file system, load a module, set the clock or the hostname, or pass by a file's
permissions. It still owns root's files, which only Landlock keeps it from, and the kernel
enforces no process limit (``RLIMIT_NPROC``) for uid 0, with capabilities or without.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import threading
import warnings
from functools import lru_cache
from pathlib import Path
from typing import Literal

from pipelines.config.sandbox import SandboxConfig
from pipelines.errors import UserError

# Where the zygote script is mounted inside the sandbox.
SANDBOX_ZYGOTE_PATH = "/opt/pyvision/zygote.py"


# One probe per process, and one answer: the agent loop's threads start sandboxes together, and
# probes run side by side could disagree (one timing out under load) and leave some trajectories
# under bubblewrap and others under rlimits only.
_PROBE_LOCK = threading.Lock()


def bwrap_available() -> bool:
    """True when bubblewrap exists and can create the namespaces the sandbox uses (probed once
    per process)."""
    with _PROBE_LOCK:
        return _probe_bwrap()


def interpreter() -> str:
    """This interpreter as bubblewrap starts it: ``sys.executable`` with its folder resolved.

    bubblewrap binds the runtime's real folders (``_runtime_paths``), so a venv reached through a
    symlinked folder (a home that is a link to a larger disk, a checkout whose ``.venv`` links to
    another) is not at ``sys.executable``'s path inside, and the probe failed: the sandbox fell
    back to rlimit mode. The file itself is not resolved: a venv's ``python`` is a link to the base
    interpreter, and only started by the venv's own path does it find the venv's site folders."""
    folder, name = os.path.split(sys.executable)
    return os.path.join(os.path.realpath(folder), name)


@lru_cache(maxsize=1)
def _probe_bwrap() -> bool:
    path = shutil.which("bwrap")
    if not path:
        return False
    try:
        proc = subprocess.run([path, *(bwrap_args()), "--", interpreter(), "-I", "-c", "0"],
                              capture_output=True, timeout=30, check=False)
    except (OSError, subprocess.SubprocessError):
        return False
    return proc.returncode == 0


_warned_rlimit = False


def isolation_mode(config: SandboxConfig | None = None) -> Literal["bwrap", "rlimit"]:
    """What ``config.isolation`` resolves to on this machine (the rlimit warning once)."""
    with _PROBE_LOCK:
        return _isolation_mode(config or SandboxConfig())


def _isolation_mode(cfg: SandboxConfig) -> Literal["bwrap", "rlimit"]:
    global _warned_rlimit
    if cfg.isolation == "rlimit":
        mode = "rlimit"
    elif _probe_bwrap():
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
        from pipelines.agent.sandbox._zygote import landlock_abi

        if landlock_abi() >= 1:
            msg = (f"SANDBOX ISOLATION IS WEAKER THAN BUBBLEWRAP: {why}, so model-written code "
                   f"runs as your user under rlimits, a system-call filter and Landlock: your "
                   f"files, the network, local Unix socket services and (on kernels with "
                   f"Landlock ABI 6) your processes are out of its reach, but it shares your "
                   f"uid and the host's namespaces; {fix}.")
        else:
            msg = (f"SANDBOX IS NOT A SECURITY BOUNDARY: {why}, so model-written code runs with "
                   f"rlimits only and can read your files and signal your processes (no "
                   f"network and no Unix socket: a system-call filter refuses them); {fix}.")
        warnings.warn(msg, RuntimeWarning, stacklevel=2)
        from pipelines.console import err

        err.print(f"[bold red]WARNING:[/] {msg}")
    return mode


# What the runtime preloads (see _zygote._preload); their import roots must reach the zygote.
PRELOADED_MODULES = ("numpy", "matplotlib", "PIL", "scipy", "decord")


def import_roots() -> list[str]:
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
             os.path.dirname(os.path.realpath(sys.executable)), *import_roots()}
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


def bwrap_args() -> list[str]:
    """bwrap's options (before ``--``) for a process that sees only the Python runtime."""
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
    for key, value in sandbox_env().items():
        args += ["--setenv", key, value]
    return args


def sandbox_env() -> dict[str, str]:
    """The sandboxed interpreter's whole environment: nothing of the host's."""
    return {"PATH": "/usr/bin:/bin", "HOME": "/tmp", "LANG": "C.UTF-8", "MPLBACKEND": "Agg",
            "MPLCONFIGDIR": "/tmp/mpl", "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1",
            "MKL_NUM_THREADS": "1", "PYTHONDONTWRITEBYTECODE": "1", "PYTHONHASHSEED": "0"}
