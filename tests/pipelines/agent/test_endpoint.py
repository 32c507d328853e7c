"""The OpenAI-compatible client against servers that differ: vLLM and SGLang get their own fields,
strict servers (`transformers serve`, hosted APIs) only standard ones; a dropped stop string comes
back; what a server rejects, refuses or garbles is one line in its own words; a stalled server shows
in the progress display; the first Ctrl-C stops an evaluation and keeps its finished samples.

Every server here is a real HTTP server on loopback (tests/helpers.FakeOpenAI).
"""

from __future__ import annotations

import re
import threading
import time
from pathlib import Path

import pytest

from pipelines.agent.policies.base import Sampling
from pipelines.agent.policies.endpoint import ChatClient
from pipelines.agent.policies.openai import OpenAIPolicy
from pipelines.config.client import ClientConfig
from pipelines.errors import EndpointError, UserError
from tests.helpers import FakeOpenAI, chat_completion, interrupt_after_requests

STANDARD = {"model", "messages", "max_tokens", "temperature", "top_p", "stop"}
CODE = "Zoom in.\n<code>\n```python\nprint(1)\n```\n</code>"
FAST = {"backoff_s": 0.0, "timeout_s": 5.0}


def strict(reply: dict) -> FakeOpenAI:
    """A server that answers 422 to any field outside the OpenAI API, as `transformers serve`
    does ("Unexpected fields in the request: {...}")."""

    def respond(body: dict):
        unexpected = set(body) - STANDARD
        if unexpected:
            return 422, {"detail": f"Unexpected fields in the request: {unexpected}"}
        return 200, reply

    return FakeOpenAI(respond, models=[])


def _turn(policy: OpenAIPolicy, text: str = "How wide?"):
    handle = policy.begin([{"role": "user", "content": [{"type": "text", "text": text}]}])
    return policy.generate([handle], Sampling(max_new_tokens=32, temperature=0.0))[0], handle


def test_a_strict_server_gets_standard_fields_only_and_the_dropped_stop_string_back() -> None:
    # OpenAI and transformers serve drop the stop string; the turn ends in an open code block.
    with strict(chat_completion(CODE.removesuffix("</code>"))) as server:
        gen, handle = _turn(OpenAIPolicy(server.url, "m", **FAST))
    assert set(server.requests[0]) == STANDARD and len(server.requests) == 1
    assert gen.finish == "code" and gen.text == CODE
    assert handle.messages[-1] == {"role": "assistant", "content": CODE}


@pytest.mark.parametrize(("owner", "fields"), [
    ("vllm", {"include_stop_str_in_output": True, "skip_special_tokens": False}),
    ("sglang", {"no_stop_trim": True, "skip_special_tokens": False}),
])
def test_vllm_and_sglang_are_recognised_and_get_their_fields(owner: str, fields: dict) -> None:
    reply = chat_completion(CODE, "</code>" if owner == "vllm" else None)
    with FakeOpenAI(lambda body: (200, reply), models=[{"id": "q", "owned_by": owner}]) as server:
        policy = OpenAIPolicy(server.url, **FAST)
        gen, _ = _turn(policy)
    body = server.requests[0]
    assert {k: body[k] for k in fields} == fields and body["model"] == "q"  # the one listed
    assert policy.client.server == owner and gen.text == CODE and gen.finish == "code"


def test_a_server_rejecting_the_fields_it_was_named_for_is_asked_again_without_them(
        capsys: pytest.CaptureFixture) -> None:
    with strict(chat_completion("<answer>\n\\boxed{3}\n</answer>")) as server:
        policy = OpenAIPolicy(server.url, "m", server="vllm", **FAST)
        gen, _ = _turn(policy)
        _turn(policy)
    assert gen.finish == "eos" and "boxed{3}" in gen.text
    # One rejected request, then standard fields for good.
    assert [set(r) == STANDARD for r in server.requests] == [False, True, True]
    err = " ".join(capsys.readouterr().err.split())
    assert err.count("rejects the vllm fields") == 1 and "Unexpected fields" in err


def test_a_rejected_request_is_one_line_in_the_servers_words_and_not_retried() -> None:
    rejection = {"detail": [{"loc": ["body", "top_p"], "msg": "must be at most 1"}]}
    with FakeOpenAI(lambda body: (422, rejection)) as server, \
            pytest.raises(EndpointError) as exc:
        _turn(OpenAIPolicy(server.url, "m", max_retries=3, **FAST))
    line = exc.value.one_line()
    assert "rejected the request (HTTP 422): body.top_p: must be at most 1" in line
    assert "did not answer" not in line and "--base-url" not in line and "\n" not in line
    assert len(server.requests) == 1


def test_unknown_model_lists_the_served_ones() -> None:
    with FakeOpenAI(lambda body: (404, {"error": {"message": f"The model `{body['model']}` "
                                                              "does not exist."}}),
                    models=[{"id": "Qwen2.5-VL-72B"}]) as server:
        policy = OpenAIPolicy(server.url, "gpt-x", model_hint="pass --served-model NAME", **FAST)
        with pytest.raises(EndpointError) as exc:
            _turn(policy)
    line = exc.value.one_line()
    assert "has no model 'gpt-x'" in line and "--served-model NAME (it serves: Qwen2.5-VL-72B)" in line


def test_a_text_only_model_refusing_images_says_so() -> None:
    from PIL import Image

    with FakeOpenAI(lambda body: (400, {"object": "error", "message": "This model does not "
                                        "support image input"})) as server:
        policy = OpenAIPolicy(server.url, "m", **FAST)
        handle = policy.begin([{"role": "user", "content": [
            {"type": "image", "image": Image.new("RGB", (8, 8))},
            {"type": "text", "text": "colour?"}]}])
        with pytest.raises(EndpointError, match=r"refuses images \(HTTP 400: This model does not "
                                                r"support image input\).*vision-language"):
            policy.generate([handle], Sampling(8))


def test_a_refused_key_names_the_variable() -> None:
    with FakeOpenAI(lambda body: (401, {"error": {"message": "Incorrect API key"}})) as server, \
            pytest.raises(EndpointError, match=r"refused the API key.*\$MY_KEY"):
        _turn(OpenAIPolicy(server.url, "m", api_key_env="MY_KEY", **FAST))


def test_garbage_is_malformed_output_after_bounded_retries() -> None:
    with FakeOpenAI(lambda body: (200, b"<html>502 Bad Gateway</html>")) as server, \
            pytest.raises(EndpointError, match=r"returned malformed output 2 time\(s\).*502 Bad"):
        _turn(OpenAIPolicy(server.url, "m", max_retries=1, **FAST))
    assert len(server.requests) == 2
    with FakeOpenAI(lambda body: (200, {"choices": []})) as server, \
            pytest.raises(EndpointError, match="malformed output"):
        _turn(OpenAIPolicy(server.url, "m", max_retries=0, **FAST))


def test_a_timeout_is_retried_then_named_and_a_stall_shows_meanwhile() -> None:
    release = threading.Event()

    def slow(body: dict):
        release.wait(3)
        return 200, chat_completion("<answer>\\boxed{1}</answer>")

    with FakeOpenAI(slow, threaded=True) as server:
        policy = OpenAIPolicy(server.url, "m", timeout_s=0.4, max_retries=1, backoff_s=0.0,
                              stall_s=1.0)
        start = time.monotonic()
        with pytest.raises(EndpointError, match=r"did not answer after 2 tries: no answer "
                                                r"within 0.4 s"):
            _turn(policy)
        assert time.monotonic() - start < 3
        assert "no answer within 0.4 s; retry 1 of 1" in (policy.activity() or "")
        release.set()
    client = ChatClient("http://127.0.0.1:9", ClientConfig(stall_s=1.0), warn=False)
    client._flights[0] = time.monotonic() - 5.2  # a request waiting for five seconds
    assert re.search(r"waiting [56] s for http://127\.0\.0\.1:9/v1 \(1 in flight\)",
                     client.activity() or "")


def test_the_served_model_is_asked_when_not_given() -> None:
    with FakeOpenAI(lambda body: (200, {}), models=[{"id": "a"}, {"id": "b"}]) as server:
        client = ChatClient(server.url, model_hint="pass --served-model NAME")
        assert client.resolve_model("x") == "x"
        with pytest.raises(UserError, match=r"serves 2 models \(a, b\).*--served-model NAME"):
            client.resolve_model(None)
    with FakeOpenAI(lambda body: (200, {}), models=[]) as server:
        assert ChatClient(server.url).resolve_model(None) == "default"


def test_usage_and_cost_are_added_up_per_episode() -> None:
    usage = {"prompt_tokens": 100, "completion_tokens": 7, "cost": 0.25}
    with FakeOpenAI(lambda body: (200, chat_completion(CODE, usage=usage))) as server:
        policy = OpenAIPolicy(server.url, "m", **FAST)
        _gen, handle = _turn(policy)
        policy.generate([handle], Sampling(8))
    assert policy.request_usage(handle) == {"requests": 2, "prompt_tokens": 200,
                                            "completion_tokens": 14, "cost": 0.5}


def test_the_judge_says_what_its_server_rejected_once_and_falls_back(
        capsys: pytest.CaptureFixture) -> None:
    from pipelines.config.reward import JudgeConfig
    from pipelines.scoring.judge import Judge

    with FakeOpenAI(lambda body: (400, {"error": {"message": "Unsupported parameter: "
                                                             "'max_tokens'"}})) as server:
        judge = Judge(JudgeConfig(base_url=server.url, max_retries=3, backoff_s=0.0))
        assert judge.judge("Q", "a", "b", "x") is None
        judge._down_until = 0.0
        assert judge.judge("Q", "c", "d", "x") is None
    assert len(server.requests) == 2  # a rejection is not retried
    assert judge.stats()["fallbacks"] == 2
    err = " ".join(capsys.readouterr().err.split())
    assert err.count("judge") == 1 and "rejected the request (HTTP 400): Unsupported parameter: " \
        "'max_tokens'; the rule verifiers decide meanwhile" in err


def test_first_ctrl_c_stops_an_evaluation_and_keeps_finished_samples(tmp_path: Path) -> None:
    """Sample 1 is answered; the server then hangs. One SIGINT ends the command within seconds
    (before: it waited out 300 s x 4 tries of the hung request) and sample 1 stays stored."""
    from pipelines.store import Store
    from tests.benchmarks.test_benchmarks import make_vstar_dir

    data = make_vstar_dir(tmp_path / "vstar")
    hang = threading.Event()

    def respond(body: dict):
        if len(server.requests) > 1:
            hang.wait(120)
        return 200, chat_completion("<answer>\n\\boxed{A}\n</answer>")

    server = FakeOpenAI(respond, threaded=True)
    store = tmp_path / "s.duckdb"
    code, err, stopped_in = interrupt_after_requests(
        ["eval", "--model", server.url, "--benchmarks", "vstar", "--data-dir", str(data),
         "--run-id", "cc", "--set", "eval.concurrency=1", "--set", "agent.image_max_pixels=12544"],
        server, 2, hang, tmp_path, {"PYVISION_STORE": str(store),
                                    "PYVISION_CACHE": str(tmp_path / "cache")}, settle_s=0.5)
    # Seconds (interpreter shutdown on a loaded machine), not the hung request's 120 s.
    assert stopped_in < 60, err
    assert code != 0 and "kept the 1 samples finished" in " ".join(err.split())
    assert [r["sample_id"] for r in Store(store).eval_records("cc")] and \
        len(Store(store).eval_records("cc")) == 1


def test_a_server_failing_on_stop_strings_gets_none_and_turns_are_cut_here(
        capsys: pytest.CaptureFixture) -> None:
    """`transformers serve` with a vision model answers 500 to `stop`: the same request without
    it is answered, so stop strings are dropped for good and the turn is cut at </code>."""

    def respond(body: dict):
        if "stop" in body:
            return 500, {"detail": "Internal Server Error"}
        return 200, chat_completion(CODE + "\n<interpreter>\nmade up\n</interpreter>",
                                    finish="length")

    with FakeOpenAI(respond) as server:
        policy = OpenAIPolicy(server.url, "m", max_retries=2, **FAST)
        gen, handle = _turn(policy)
        _turn(policy)
    assert gen.text == CODE and gen.finish == "code" and not policy.client.sends_stop
    assert handle.messages[-1]["content"] == CODE
    assert ["stop" in r for r in server.requests] == [True, True, False, False]
    err = " ".join(capsys.readouterr().err.split())
    assert err.count("fails on stop strings but answers without them") == 1


def test_a_model_wanting_max_completion_tokens_gets_it() -> None:
    def respond(body: dict):
        if "max_tokens" in body:
            return 400, {"error": {"message": "Unsupported parameter: 'max_tokens' is not "
                                              "supported with this model. Use "
                                              "'max_completion_tokens' instead."}}
        return 200, chat_completion("<answer>\n\\boxed{2}\n</answer>")

    with FakeOpenAI(respond) as server:
        policy = OpenAIPolicy(server.url, "o-model", **FAST)
        gen, _ = _turn(policy)
        _turn(policy)
    assert "boxed{2}" in gen.text
    assert [r.get("max_completion_tokens") for r in server.requests] == [None, 32, 32]


def test_after_a_server_error_later_requests_open_new_connections() -> None:
    """uvicorn (behind `transformers serve`) drops a kept-alive connection after a 500: the
    next request must not be sent on it."""
    replies = [(500, {"detail": "Internal Server Error"}), (200, chat_completion(CODE))]
    with FakeOpenAI(lambda body: replies.pop(0)) as server:
        policy = OpenAIPolicy(server.url, "m", max_retries=1, **FAST)
        before = policy.client._http
        gen, _ = _turn(policy)
    assert gen.text == CODE and policy.client._http is not before
    assert policy.client.sends_stop  # one 500 is not a verdict on stop strings


def test_eval_against_a_server_with_several_models_asks_for_one_before_writing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from typer.testing import CliRunner

    from pipelines.store import Store
    from pyvision_cli.eval import app
    from tests.benchmarks.test_benchmarks import make_vstar_dir

    monkeypatch.setenv("PYVISION_CACHE", str(tmp_path / "cache"))
    data = make_vstar_dir(tmp_path / "vstar")
    with FakeOpenAI(lambda body: (200, {}), models=[{"id": "a"}, {"id": "b"}]) as server:
        result = CliRunner().invoke(app, ["--model", server.url, "--benchmarks", "vstar",
                                          "--data-dir", str(data), "--run-id", "two"])
    assert result.exit_code == 2 and not server.requests
    line = " ".join(result.output.split())
    assert "serves 2 models (a, b)" in line and "--served-model NAME" in line
    assert Store().runs() == []


def test_close_leaves_no_request_on_its_way(monkeypatch) -> None:
    """A request that got past httpx's closed-client check opens a new connection even after
    ``close()``: a server brought back on the same port (a teacher restarted after it died) got
    one stray request from the run that had already given up. ``close()`` now returns only once
    the requests in flight have ended."""
    import httpx

    from pipelines.agent.policies.endpoint import Cancelled

    received: list[float] = []
    inner = httpx.HTTPTransport.handle_request
    on_its_way = threading.Event()

    def slow_send(self, request):
        on_its_way.set()
        time.sleep(0.4)  # a thread the scheduler held back, past the client's own check
        return inner(self, request)

    monkeypatch.setattr(httpx.HTTPTransport, "handle_request", slow_send)

    def respond(body: dict):
        received.append(time.monotonic())
        return 200, chat_completion("<answer>\n\\boxed{1}\n</answer>")

    with FakeOpenAI(respond, models=[]) as server:
        client = ChatClient(server.url, ClientConfig(server="openai", **FAST), warn=False)
        outcome: list[object] = []

        def ask() -> None:
            try:
                outcome.append(client.complete({"model": "m", "messages": []}))
            except Exception as exc:  # noqa: BLE001 - the test reads what happened
                outcome.append(exc)

        thread = threading.Thread(target=ask)
        thread.start()
        assert on_its_way.wait(5)
        client.close(drain_s=10)
        closed_at = time.monotonic()
        thread.join(5)
    assert all(t <= closed_at for t in received), "a request reached the server after close()"
    assert len(outcome) == 1 and (isinstance(outcome[0], (dict, Cancelled)))
