"""Killed with SIGKILL mid-run, then run again: nothing lost, nothing twice.

`pyvision eval` and `pyvision rl` run as real processes (the point is a kill that no handler
sees: the store's last transaction may be cut, the RL stage never marks itself failed). Each is
killed once it has stored some of its work, then run again; the second run must keep every
sample or step the first one stored, do only the rest, and store each exactly once.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import duckdb
import pytest

from pipelines.store import Store
from tests.e2e.test_bad_inputs import png_bytes, task_row, write_tasks
from tests.helpers import REPO as ROOT
from tests.pipelines.rl.test_rl_local import ENGINE

pytestmark = pytest.mark.slow


def _pyvision(args: list[str], env: dict[str, str], cwd: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "pyvision_cli.main", *args], cwd=cwd, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def _env(store: Path) -> dict[str, str]:
    return {**os.environ, "PYVISION_STORE": str(store), "PYTHONPATH": str(ROOT),
            "OMP_NUM_THREADS": "1"}


def _kill_when(proc: subprocess.Popen, ready, timeout_s: float = 240.0) -> None:
    """SIGKILL ``proc`` (the process alone, as the OOM killer would) once ``ready()``."""
    deadline = time.monotonic() + timeout_s
    while not ready():
        assert proc.poll() is None, f"finished before it could be killed:\n{proc.stdout.read()}"
        assert time.monotonic() < deadline, "never got far enough to be killed"
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL


def _reap(proc: subprocess.Popen) -> None:
    """Whatever the killed process started (sandboxes) must not outlive the test."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _rows(store: Path, sql: str) -> list[tuple]:
    con = duckdb.connect(str(store), read_only=True)
    try:
        return con.execute(sql).fetchall()
    finally:
        con.close()


def test_eval_killed_then_rerun_keeps_every_sample_once(tiny_model_dir: Path, tmp_path: Path):
    # Enough samples, each committed as it finishes, that a fast machine is still mid-run when
    # the third lands.
    n = 64
    data = write_tasks(tmp_path / "tasks", [task_row(i, image=f"media/{i}.png") for i in range(n)],
                       media={f"{i}.png": png_bytes(16 + i, 12) for i in range(n)})
    store = tmp_path / "store.duckdb"
    args = ["eval", "--model", str(tiny_model_dir), "--benchmarks", "synth-image", "--data-dir",
            str(data), "--run-id", "k9", "--set", "agent.max_new_tokens_per_turn=16",
            "--set", "agent.max_turns_eval=2", "--set", "eval.batch_size=1",
            "--set", "agent.image_max_pixels=12544", "--set", "model.device=cpu",
            "--set", "eval.commit_interval_s=0"]
    first = _pyvision(args, _env(store), tmp_path)
    try:
        _kill_when(first, lambda: store.exists() and
                   Store(store, read_only=True).eval_sample_count("k9") >= 3)
    finally:
        _reap(first)
    kept = {r[0]: r[1:] for r in _rows(store, "SELECT sample_id, prediction, trajectory, "
                                              "model_fingerprint FROM eval_trajectories")}
    assert 3 <= len(kept) < n
    second = subprocess.run([sys.executable, "-m", "pyvision_cli.main", *args, "--json"],
                            cwd=tmp_path, env=_env(store), capture_output=True, text=True,
                            timeout=600, check=False)
    assert second.returncode == 0, second.stderr
    assert f"({n - len(kept)} new" in second.stderr
    after = {r[0]: r[1:] for r in _rows(store, "SELECT sample_id, prediction, trajectory, "
                                               "model_fingerprint FROM eval_trajectories")}
    assert sorted(after) == sorted(f"t{i}" for i in range(n))
    assert all(after[s] == kept[s] for s in kept)  # the first run's samples, untouched
    dupes = _rows(store, "SELECT sample_id, metric, count(*) FROM eval_scores GROUP BY ALL "
                         "HAVING count(*) > 1")
    assert dupes == []
    (agg_n,) = {r[0] for r in _rows(store, "SELECT n FROM eval_aggregates WHERE run_id='k9'")}
    assert agg_n == n
    assert json.loads(second.stdout)["results"]["synth-image"]["accuracy"] >= 0.0


def test_rl_killed_then_resumed_loses_no_step_and_repeats_none(tiny_model_dir: Path,
                                                              tmp_path: Path):
    from pipelines.data.synth import synthesize

    tasks = tmp_path / "tasks"
    synthesize("image-search", 6, 0, tasks, families=["color", "count"], progress=False)
    store = tmp_path / "store.duckdb"
    steps = 4
    sets = [a for s in ENGINE + [f"rl.local.steps={steps}", f"runs_dir={tmp_path / 'runs'}"]
            for a in ("--set", s)]
    args = ["rl", "--engine", "local", "--run-id", "k9", "--model", str(tiny_model_dir),
            "--tasks", str(tasks), *sets]
    ckpts = tmp_path / "runs" / "k9" / "rl" / "checkpoints"
    first = _pyvision(args, _env(store), tmp_path)
    try:
        _kill_when(first, lambda: (ckpts / "step_2").is_dir())
    finally:
        _reap(first)
    before = _rows(store, "SELECT step, name, value FROM metrics WHERE run_id='k9' "
                          "ORDER BY step, name")
    assert {s for s, _, _ in before} >= {0, 1}

    refused = subprocess.run([sys.executable, "-m", "pyvision_cli.main", *args], cwd=tmp_path,
                             env=_env(store), capture_output=True, text=True, timeout=300,
                             check=False)
    assert refused.returncode == 2 and "was started before" in refused.stderr
    assert _rows(store, "SELECT step, name, value FROM metrics WHERE run_id='k9' "
                        "ORDER BY step, name") == before

    resumed = subprocess.run([sys.executable, "-m", "pyvision_cli.main", *args, "--resume",
                              "--json"], cwd=tmp_path, env=_env(store), capture_output=True,
                             text=True, timeout=900, check=False)
    assert resumed.returncode == 0, resumed.stderr
    summary = json.loads(resumed.stdout[resumed.stdout.index("{"):])["summary"]
    start = summary["resumed_from"]
    assert start >= 2
    after = _rows(store, "SELECT step, name, value FROM metrics WHERE run_id='k9' "
                         "ORDER BY step, name")
    assert sorted({s for s, _, _ in after}) == list(range(steps))
    assert len(after) == len({(s, n) for s, n, _ in after})  # every (step, metric) once
    # The steps the checkpoint holds are the first run's own rows, not made again.
    assert [r for r in after if r[0] < start] == [r for r in before if r[0] < start]
    stage = _rows(store, "SELECT status FROM stages WHERE run_id='k9' AND stage='rl'")
    assert stage == [("done",)]
