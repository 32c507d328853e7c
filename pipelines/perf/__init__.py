"""Benchmarks of the project's own speed (`pyvision perf ...`), printed as JSON.

Performance targets are checked here, by measurement, rather than by timed tests that would
flake on a busy machine.
"""

from __future__ import annotations

import os
import statistics
from pathlib import Path


def summary_ms(samples_s: list[float]) -> dict[str, float]:
    """Median and 95th percentile of durations given in seconds, as milliseconds."""
    ms = sorted(s * 1000 for s in samples_s)
    p95 = ms[min(len(ms) - 1, max(0, round(0.95 * (len(ms) - 1))))]
    return {"median": round(statistics.median(ms), 3), "p95": round(p95, 3), "n": len(ms)}


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity where the OS has one)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def _process_tree(root_pid: int | None = None) -> list[int]:
    """A process and all its descendants (from ``/proc``; Linux)."""
    root = root_pid or os.getpid()
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    todo, tree = [root], []
    while todo:
        pid = todo.pop()
        tree.append(pid)
        todo.extend(children.get(pid, []))
    return tree


def process_tree_memory_mb(root_pid: int | None = None) -> dict[str, float]:
    """RSS and PSS (shared pages split fairly) of a process and all its descendants, in MiB."""
    tree = _process_tree(root_pid)
    rss = pss = 0
    for pid in tree:
        try:
            for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
                if line.startswith("Rss:"):
                    rss += int(line.split()[1])
                elif line.startswith("Pss:"):
                    pss += int(line.split()[1])
        except OSError:
            continue
    return {"rss_mb": round(rss / 1024, 1), "pss_mb": round(pss / 1024, 1), "processes": len(tree)}


def process_tree_cpu_s(root_pid: int | None = None) -> float | None:
    """CPU seconds (user + system) used so far by a process, its descendants and every child
    they have reaped: the difference of two readings is what the whole tree (sandbox workers
    that came and went included) used in between, whatever else the machine ran. None where
    ``/proc`` has no process table (not Linux)."""
    if not Path("/proc/self/stat").exists():
        return None
    ticks = 0
    for pid in _process_tree(root_pid):
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:  # exited since the walk (its parent, read earlier, missed its time)
            continue
        ticks += sum(int(v) for v in fields[11:15])  # utime stime cutime cstime
    return ticks / os.sysconf("SC_CLK_TCK")


def thread_schedstat_s() -> tuple[float, float] | None:
    """The calling thread's seconds on a CPU and seconds runnable but waiting for one, so far
    (``/proc/thread-self/schedstat``; None where the kernel does not keep it). Two readings
    around a piece of work say whether a slow run computed more or waited for a core."""
    try:
        on_cpu, waiting = Path("/proc/thread-self/schedstat").read_text().split()[:2]
    except (OSError, ValueError):
        return None
    return int(on_cpu) / 1e9, int(waiting) / 1e9
