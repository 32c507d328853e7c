"""Our agent loop, and `pyvision data distill`, against a real `transformers serve` on loopback
serving the tiny Qwen2.5-VL (offline, CPU).

`transformers serve` is strict where vLLM is lenient: it answers HTTP 422 to any field outside
the OpenAI API (the policy used to send vLLM's `include_stop_str_in_output` and
`skip_special_tokens` to every server), and with a vision model it fails (HTTP 500) on stop
strings. Both must work: standard fields only, no stop strings, turns cut at `</code>` by us.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from pipelines.agent.loop import run_episodes
from pipelines.agent.policies.openai import OpenAIPolicy
from pipelines.config.agent import AgentConfig
from pipelines.config.sandbox import SandboxConfig
from pipelines.core.records import Task, write_tasks

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytestmark = pytest.mark.slow


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def served(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    """`transformers serve MODEL` on a free loopback port; its URL (and its log on failure)."""
    exe = Path(sys.executable).with_name("transformers")
    if not exe.is_file():
        pytest.skip("the transformers CLI is not installed beside this interpreter")
    port = _free_port()
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    # The server writes each image it is sent to a temporary PNG that it never deletes: give it
    # a temporary directory that the test run removes.
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "OMP_NUM_THREADS": "1", "TMPDIR": str(tmp_path_factory.mktemp("serve-tmp"))}
    with open(log, "w") as fh:
        proc = subprocess.Popen([str(exe), "serve", str(tiny_model_dir), "--host", "127.0.0.1",
                                 "--port", str(port), "--device", "cpu", "--dtype", "float32"],
                                stdout=fh, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                pytest.fail(f"transformers serve exited: {log.read_text()[-2000:]}")
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.5)
        else:
            pytest.fail(f"transformers serve did not start: {log.read_text()[-2000:]}")
        yield url, log
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()


@pytest.fixture
def image_tasks(tmp_path: Path) -> Path:
    from PIL import Image

    root = tmp_path / "tasks"
    (root / "media").mkdir(parents=True)
    Image.new("RGB", (120, 80), (200, 30, 30)).save(root / "media" / "a.png")
    write_tasks(root / "tasks.jsonl", [
        Task(id="w", data_source="synth/image-search", question="How wide is the image?",
             images=["media/a.png"], answer="120", answer_type="number",
             metadata={"family": "measure"})])
    return root


def test_agent_loop_against_transformers_serve(served, image_tasks: Path) -> None:
    url, log = served
    from pipelines.core.records import read_tasks

    (task,), _ = read_tasks(image_tasks)
    agent = AgentConfig(max_turns_eval=2, max_new_tokens_per_turn=24, image_max_pixels=12544,
                        max_context_tokens=4096)
    policy = OpenAIPolicy(url, client=None, timeout_s=120, max_retries=1, backoff_s=0.0,
                          image_max_pixels=12544)
    (traj,) = list(run_episodes([(task, image_tasks)], policy, agent, SandboxConfig(timeout_s=10),
                                batch_size=1))
    # The server answered every turn (a rejected field or a stop-string crash would have raised).
    assert traj.turns and traj.stop_reason is not None
    assert traj.generated_tokens > 0 and traj.prompt_tokens > 0 and traj.visual_tokens > 0
    assert traj.request_usage["requests"] == traj.num_turns
    assert all("</code>" not in t.assistant or t.assistant.endswith("</code>") for t in traj.turns)
    assert "Unexpected fields" not in log.read_text()  # standard fields only
    assert policy.client.server == "openai"
    # It failed on the stop string once (HTTP 500), then got none: no turn was lost to it.
    assert not policy.client.sends_stop


def test_distill_against_transformers_serve(served, image_tasks: Path, tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from pyvision_cli.data import app

    url, _log = served
    out = tmp_path / "out"
    result = CliRunner().invoke(app, [
        "distill", "--teacher", url, "--tasks", str(image_tasks), "--out", str(out), "--k", "2",
        "--json", "--set", "agent.max_new_tokens_per_turn=24",
        "--set", "agent.image_max_pixels=12544", "--set", "data.distill.client.backoff_s=0"])
    assert result.exit_code == 0, result.output
    card = json.loads(result.stdout)
    # A random tiny model: both samples are drawn and judged; nothing it wrote is kept unverified.
    assert card["samples"]["drawn"] == 2
    assert sum(card["samples"]["rejected"].values()) + card["samples"]["accepted"] == 2
    assert card["usage"]["requests"] >= 2 and (out / "manifest.json").is_file()
    assert len((out / "samples" / "index.jsonl").read_text().splitlines()) == 2
