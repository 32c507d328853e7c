"""`pyvision perf` commands print the promised JSON (no timing assertions: those flake)."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from pyvision_cli.perf import app


def test_perf_sandbox_json_shape():
    result = CliRunner().invoke(app, ["sandbox", "--json", "--repeats", "3", "--n-concurrent", "3"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    for key in ("start_ms", "call_overhead_ms", "crop_show_ms", "crop_8k_ms",
                "forked_worker_overhead_ms", "crop_show_code_ms", "crop_8k_code_ms", "start_8k_ms",
                "crop_show_first_ms"):
        assert set(data[key]) >= {"median", "p95"} and data[key]["median"] > 0
        assert data[key]["p95"] >= data[key]["median"]
    assert data["crop_show_size"] == [392, 392] and data["crop_8k_size"] == [1036, 1036]
    assert data["concurrent"]["n"] == 3 and data["concurrent"]["alive"] == 3
    assert data["concurrent"]["peak_rss_mb"] > 0
    busy = data["beside_busy"]  # the work timed alone and beside 8 looping sandboxes
    assert busy["n"] == 8 and busy["alone_s"] > 0 and busy["beside_s"] > 0
    assert busy["slowdown"] == pytest.approx(busy["beside_s"] / busy["alone_s"], rel=0.05)
    assert busy["autogroup"] in (True, False, None)
    assert data["overhead_ratio"] == pytest.approx(
        data["call_overhead_ms"]["median"] / data["forked_worker_overhead_ms"]["median"], rel=0.05)
    one = data["one_cpu"]  # both processes pinned to one CPU, in a child process
    if data["cpus"] > 1:
        assert one["cpu"] >= 0 and one["call_overhead_ms"]["n"] == 60
        assert one["overhead_ratio"] == pytest.approx(
            one["call_overhead_ms"]["median"] / one["forked_worker_overhead_ms"]["median"], rel=0.05)
    else:
        assert one is None


def test_process_tree_cpu_counts_descendants_and_reaped_children():
    """A grandchild that burns CPU and is gone before the second reading still counts: its time
    reaches the tree through its reaping parent, while this process's own time barely moves."""
    import subprocess
    import sys
    import time

    from pipelines.perf import process_tree_cpu_s

    burn = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.4: pass"
    start, own = process_tree_cpu_s(), time.process_time()
    # The child starts a grandchild, waits for it (reaping it), then exits; we reap the child.
    subprocess.run([sys.executable, "-c",
                    f"import subprocess, sys; subprocess.run([sys.executable, '-c', {burn!r}])"],
                   check=True)
    used, mine = process_tree_cpu_s() - start, time.process_time() - own
    assert used >= 0.35, used
    assert mine < 0.2 and used > mine + 0.3
