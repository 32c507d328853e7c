"""Input helpers shared by every stage (pipelines/inputs.py)."""

from __future__ import annotations

import subprocess
import sys

from tests.helpers import REPO

# Eight threads open videos at once (decord's open made slow so that they overlap), then the
# process writes to stderr: that line must arrive.
_OVERLAPPING_OPENS = """
import sys, threading, time
import decord
from pipelines.inputs import open_video

inside = []
def slow_open(path):
    inside.append(1)
    time.sleep(0.05)
    most = len(inside)
    inside.pop()
    return most
decord.VideoReader = slow_open
out = []
threads = [threading.Thread(target=lambda: out.append(open_video("v.mp4", quiet=True)))
           for _ in range(8)]
for t in threads: t.start()
for t in threads: t.join()
print("most at once", max(out))
print("stderr still reaches its file", file=sys.stderr)
"""


def test_overlapping_quiet_video_opens_leave_stderr_working():
    # Each open points fd 2 at /dev/null and back; two at once used to restore /dev/null last,
    # which silenced everything the process printed afterwards (the demo's output after its
    # first video stage).
    proc = subprocess.run([sys.executable, "-c", _OVERLAPPING_OPENS], capture_output=True,
                          text=True, timeout=60, cwd=REPO, check=False)
    assert proc.returncode == 0, proc.stderr
    assert "stderr still reaches its file" in proc.stderr
    assert proc.stdout.strip() == "most at once 1"  # one quiet open at a time


def test_a_video_opened_on_the_agent_loops_threads_leaves_fd_2_alone(monkeypatch):
    # Not quiet (the default): other threads' output must keep reaching stderr meanwhile.
    import os

    import decord

    from pipelines.inputs import open_video

    def where_fd_2_points(path):
        st = os.fstat(2)
        return st.st_dev, st.st_ino

    monkeypatch.setattr(decord, "VideoReader", where_fd_2_points)
    devnull = os.stat(os.devnull)
    assert open_video("v.mp4") == where_fd_2_points("")
    assert open_video("v.mp4", quiet=True) == (devnull.st_dev, devnull.st_ino)
