"""`pyvision eval --engine vllm | openai`: the in-process vLLM policy against a fake `vllm` module
shaped like vLLM's API, the install message when vLLM is missing, and concurrent requests to a
local OpenAI-compatible server.
"""

from __future__ import annotations

import json
import sys
import threading
import types
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from pipelines.agent.policies.base import Sampling
from pipelines.agent.policies.chat import visual_tokens_for
from pipelines.config.agent import AgentConfig
from pipelines.store import Store
from pyvision_cli.eval import app
from tests.benchmarks.test_benchmarks import make_vstar_dir
from tests.helpers import FakeOpenAI, chat_completion

FAST = ["agent.max_new_tokens_per_turn=8", "agent.max_turns_eval=3",
        "agent.image_max_pixels=12544"]
SET_FAST = [a for s in FAST for a in ("--set", s)]
CODE = "Zoom.\n<code>\n```python\nplt.imshow(image_clue_0); plt.show()\n```\n</code>"
ANSWER = "<answer>\n\\boxed{A}\n</answer>"
runner = CliRunner()


@pytest.fixture(scope="module")
def vstar_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_vstar_dir(tmp_path_factory.mktemp("vstar") / "copy")


@pytest.fixture(autouse=True)
def _media_cache(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYVISION_CACHE", str(tmp_path_factory.getbasetemp() / "pyvision-cache"))


# -- vLLM -----------------------------------------------------------------------------------------


def _words(conversation: list[dict]) -> int:
    """The fake tokenizer: one token per word of text, ten per image."""
    n = 0
    for m in conversation:
        parts = m["content"] if isinstance(m["content"], list) else [
            {"type": "text", "text": m["content"]}]
        for p in parts:
            n += len(p["text"].split()) if p["type"] == "text" else 10
    return n


def fake_vllm(script: list[tuple[str, str, Any]]) -> tuple[types.ModuleType, dict[str, Any]]:
    """A `vllm` module: LLM(model, **kw).chat(conversations, SamplingParams, use_tqdm) returns
    RequestOutput-shaped objects (prompt_token_ids, outputs[0].text/token_ids/finish_reason/
    stop_reason). Turn i of every conversation answers ``script[i]`` = (text, finish, stop)."""
    state: dict[str, Any] = {"init": None, "params": [], "calls": []}
    module = types.ModuleType("vllm")

    class SamplingParams:
        def __init__(self, **kwargs: Any) -> None:
            self.kwargs = kwargs
            state["params"].append(kwargs)

    class LLM:
        def __init__(self, model: str, **kwargs: Any) -> None:
            state["init"] = {"model": model, **kwargs}

        def chat(self, conversations, sampling_params, use_tqdm=True):
            assert isinstance(sampling_params, SamplingParams) and use_tqdm is False
            state["calls"].append([[dict(m) for m in conv] for conv in conversations])
            outputs = []
            for conv in conversations:
                turn = sum(m["role"] == "assistant" for m in conv)
                text, finish, stop = script[turn]
                completion = types.SimpleNamespace(text=text, finish_reason=finish,
                                                   stop_reason=stop,
                                                   token_ids=list(range(len(text.split()))))
                outputs.append(types.SimpleNamespace(
                    prompt_token_ids=list(range(_words(conv))), outputs=[completion]))
            return outputs

    module.LLM, module.SamplingParams = LLM, SamplingParams
    return module, state


def test_engine_vllm_through_the_cli(monkeypatch, vstar_dir: Path) -> None:
    module, state = fake_vllm([(CODE, "stop", "</code>"), (ANSWER, "stop", None)])
    monkeypatch.setitem(sys.modules, "vllm", module)
    result = runner.invoke(app, ["--engine", "vllm", "--model", "org/fake-vl", "--benchmarks",
                                 "vstar", "--data-dir", str(vstar_dir), "--limit", "2",
                                 "--run-id", "v", "--model-tag", "fake", "--json",
                                 "--set", "eval.batch_size=2", *SET_FAST])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["results"]["vstar"]["vstar_overall_acc"] == 0.5  # gold A, C
    init = state["init"]
    assert init["model"] == "org/fake-vl" and init["limit_mm_per_prompt"] == {"image": 8}
    assert init["mm_processor_kwargs"] == {"min_pixels": 3136, "max_pixels": 12544}
    for params in state["params"]:
        assert params["stop"] == ["</code>"] and params["include_stop_str_in_output"] is True
        assert (params["max_tokens"], params["temperature"], params["top_p"]) == (8, 0.0, 1.0)
    first, second = state["calls"]  # both episodes advance together, two turns each
    assert len(first) == len(second) == 2
    (user,) = first[0]
    kinds = [p["type"] for p in user["content"]]
    assert kinds.count("image_pil") == 1 and set(kinds) == {"text", "image_pil"}
    final = second[0]
    assert [m["role"] for m in final] == ["user", "assistant", "user"]
    assert final[1]["content"] == CODE  # the stop string kept
    observation = final[2]["content"]
    assert observation[0]["text"].startswith("<interpreter>\nText Result:\nNone\nImage Result:")
    figures = [p["image_pil"] for p in observation if p["type"] == "image_pil"]
    assert len(figures) == 1 and figures[0].size[0] % 28 == 0  # resized for the context
    records = Store().eval_records("v", with_trajectory=True)
    assert len(records) == 2
    for rec in records:
        assert (rec["turns"], rec["tool_calls"], rec["stop_reason"], rec["prediction"]) == (
            2, 1, "answered", "A")
        assert [t["finish"] for t in rec["trajectory"]["turns"]] == ["code", "eos"]
    # Tokens: the context of the last request plus the answer; visual: both images' tokens.
    images = [p["image_pil"] for m in final for p in (m["content"] if isinstance(
        m["content"], list) else []) if p["type"] == "image_pil"]
    rec0 = next(r for r in records if r["sample_id"] == "0")
    assert rec0["total_tokens"] == _words(final) + len(ANSWER.split())
    assert rec0["visual_tokens"] == sum(visual_tokens_for(i, 3136, 12544) for i in images)


def test_vllm_stop_and_token_bookkeeping(monkeypatch) -> None:
    from pipelines.agent.policies.vllm import VLLMPolicy

    script = [("Look.\n<code>\n```python\nprint(1)\n```\n", "stop", "</code>"),  # stop str lost
              ("<code>\n```python\nprint(2)\n```\n</code> trailing", "stop", "</code>"),
              ("a long ramble", "length", None), ("no tags here", "stop", None)]
    module, _ = fake_vllm(script)
    monkeypatch.setitem(sys.modules, "vllm", module)
    policy = VLLMPolicy("m", agent_cfg=AgentConfig())
    handle = policy.begin([{"role": "user", "content": [{"type": "text", "text": "q a b"}]}])
    finishes = []
    for turn in range(4):
        (gen,) = policy.generate([handle], Sampling(16, 0.0))
        finishes.append((gen.finish, gen.text.endswith("</code>"), gen.n_tokens))
        if turn < 3:
            policy.observe(handle, [{"type": "text", "text": "<interpreter>ok</interpreter>"}], [])
    # n_tokens is what vLLM generated (6 for turn 2, "trailing" included), not what is kept.
    assert finishes == [("code", True, 5), ("code", True, 6), ("length", False, 3),
                        ("eos", False, 3)]
    assert handle.messages[1]["content"].endswith("</code>")  # put back before re-sending
    assert "trailing" not in handle.messages[3]["content"]
    counts = policy.token_counts(handle)
    context = _words(handle.messages[:-1]) + 3
    assert counts == {"prompt": 3, "generated": 17, "observation": context - 3 - 17, "visual": 0}
    assert policy.context_tokens(handle) == context


def test_chat_policies_count_visual_tokens_with_the_recipes_image_factor(monkeypatch) -> None:
    # A 1024x768 image at its Qwen3-VL context size is 32 x 24 tokens of 32x32 pixels; counted
    # with Qwen2.5-VL's 28x28 rule it would be 37 x 27.
    from PIL import Image

    from pipelines.agent.policies import make_policy
    from pipelines.agent.policies.vllm import VLLMPolicy

    module, _ = fake_vllm([])
    monkeypatch.setitem(sys.modules, "vllm", module)
    image = Image.new("RGB", (1024, 768))
    message = {"role": "user", "content": [{"type": "image", "image": image},
                                           {"type": "text", "text": "q"}]}
    visual = {}
    for factor in (28, 32):
        cfg = AgentConfig(image_factor=factor, image_max_pixels=2_000_000)
        policy = VLLMPolicy("m", agent_cfg=cfg)
        visual[factor] = policy.token_counts(policy.begin([message]))["visual"]
        served = make_policy("http://127.0.0.1:9", served_model="m", agent_cfg=cfg)
        assert served.token_counts(served.begin([message]))["visual"] == visual[factor]
    assert visual == {28: 37 * 27, 32: 32 * 24}


def test_missing_vllm_says_how_to_install_it(monkeypatch, vstar_dir: Path) -> None:
    monkeypatch.setitem(sys.modules, "vllm", None)  # `import vllm` fails as if not installed
    result = runner.invoke(app, ["--engine", "vllm", "--model", "org/m", "--benchmarks", "vstar",
                                 "--data-dir", str(vstar_dir), "--limit", "1"])
    assert result.exit_code == 2, result.output
    (line,) = [x for x in result.output.splitlines() if x.startswith("error:")]
    assert "--engine vllm needs vLLM, which is not installed in this environment" in line
    for route in ("pip install vllm==0.33.0", "vllm serve MODEL", "--engine openai"):
        assert route in line
    store = Store()
    assert store.runs() == [] and store.eval_aggregates() == []


# -- OpenAI-compatible server, concurrent ---------------------------------------------------------


class _ConcurrentServer(FakeOpenAI):
    """A threaded OpenAI-compatible server whose replies depend on the conversation, not on the
    arrival order (tests/helpers.py's scripted server is sequential). Every first turn waits at
    a barrier until ``parties`` requests are in flight at once, so the test fails unless the
    client really sends them concurrently."""

    def __init__(self, parties: int) -> None:
        barrier = threading.Barrier(parties, timeout=60)
        lock = threading.Lock()
        self.in_flight = self.max_in_flight = 0

        def respond(body: dict) -> tuple[int, dict]:
            with lock:
                self.in_flight += 1
                self.max_in_flight = max(self.max_in_flight, self.in_flight)
            try:
                if not any(m["role"] == "assistant" for m in body["messages"]):
                    barrier.wait()
                    # vLLM strips the stop string and names it in stop_reason.
                    text, stop = CODE.removesuffix("</code>"), "</code>"
                else:
                    text, stop = ANSWER, None
            finally:
                with lock:
                    self.in_flight -= 1
            return 200, chat_completion(text, stop, usage={"prompt_tokens": 120,
                                                           "completion_tokens": 9})

        super().__init__(respond, threaded=True)


def test_engine_openai_sends_requests_concurrently(vstar_dir: Path) -> None:
    server = _ConcurrentServer(parties=4)
    try:
        result = runner.invoke(app, ["--model", server.url, "--served-model", "qwen",
                                     "--benchmarks", "vstar", "--data-dir", str(vstar_dir),
                                     "--run-id", "o", "--json", "--set", "eval.concurrency=4",
                                     *SET_FAST])
    finally:
        server.close()
    assert result.exit_code == 0, result.output
    assert server.max_in_flight == 4  # the four first turns were in flight together
    assert len(server.requests) == 8
    assert all(r["model"] == "qwen" and r["stop"] == ["</code>"] for r in server.requests)
    assert json.loads(result.stdout)["results"]["vstar"] == {
        "vstar_overall_acc": 0.5, "vstar_direct_attributes_acc": 0.5,
        "vstar_relative_position_acc": 0.5}
    records = Store().eval_records("o")
    assert len(records) == 4
    assert all((r["turns"], r["tool_calls"], r["stop_reason"]) == (2, 1, "answered")
               and r["visual_tokens"] > 0 for r in records)
