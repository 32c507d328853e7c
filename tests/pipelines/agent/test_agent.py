"""The one agent loop: exact scripted trajectories, stop reasons, the tiny model, a served model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from PIL import Image
from typer.testing import CliRunner

from pipelines.agent.loop import run_episodes
from pipelines.agent.policies.base import Sampling
from pipelines.agent.policies.openai import OpenAIPolicy
from pipelines.agent.policies.scripted import ScriptedPolicy
from pipelines.agent.prompts import build_initial_messages, load_template
from pipelines.config.agent import AgentConfig
from pipelines.config.sandbox import SandboxConfig
from pipelines.core.records import Task
from pipelines.errors import DataError, EndpointError
from tests.helpers import chat_completion, scripted_openai

CODE_TURN = ("Let me measure.\n<code>\n```python\nprint(image_clue_0.size)\n"
             "plt.imshow(image_clue_0); plt.show()\n```\n</code>")
ANSWER_TURN = "It is wide.\n<answer>\n\\boxed{300}\n</answer>"


@pytest.fixture
def image_task(tmp_path) -> tuple[Task, Path]:
    Image.new("RGB", (300, 200), (200, 20, 20)).save(tmp_path / "a.png")
    return Task(id="t1", data_source="synth/image-search", question="How wide is the image?",
                images=["a.png"], answer="300", answer_type="number"), tmp_path


def _run(policy, task_root, **cfg):
    agent = AgentConfig(**{"max_turns_eval": 5, **cfg})
    return list(run_episodes([task_root], policy, agent, SandboxConfig(timeout_s=10), batch_size=4))


def test_exact_scripted_trajectory(image_task):
    (traj,) = _run(ScriptedPolicy([CODE_TURN, ANSWER_TURN]), image_task)
    assert traj.stop_reason == "answered" and traj.final_answer == "300"
    assert [t.code for t in traj.turns] == ["print(image_clue_0.size)\nplt.imshow(image_clue_0); plt.show()", None]
    first = traj.turns[0]
    assert first.result.status == "ok" and first.result.stdout == "(300, 200)\n"
    assert first.result.n_images == 1 and first.image_indices == [1]
    texts = [p.get("text", "<image>") for p in first.observation]
    assert "".join(texts) == ("<interpreter>\nText Result:\n(300, 200)\nImage Result:\nFigure 2: "
                              "<image>\n</interpreter>")
    assert (traj.tool_calls, traj.successful_calls, traj.failed_calls) == (1, 1, 0)
    assert traj.num_turns == 2 and traj.prompt_version == "image@v1"
    assert traj.prompt_hash == load_template("image")[1].sha256
    data = traj.to_json()
    assert data["schema_version"] == 1 and json.dumps(data)
    conv = traj.to_conversation("c1", image_task[1] / "media", "media/")
    assert [m.role for m in conv.messages] == ["user", "assistant", "user", "assistant"]
    assert conv.problems(image_task[1]) == []
    assert conv.images == ["media/c1_0.png", "media/c1_1.png"]
    # An id that is no file name (a dataset's "color/1", "../x", one past the name limit) still
    # writes its images inside media/, under a name of its own.
    names = set()
    for odd in ("color/1", "../../evil", "x" * 300):
        conv = traj.to_conversation(odd, image_task[1] / "media", "media/")
        assert conv.id == odd and conv.problems(image_task[1]) == []
        assert all(p.startswith("media/conv-") and "/" not in p[6:] for p in conv.images)
        names.add(conv.images[0])
    assert len(names) == 3


@pytest.mark.parametrize("turns,cfg,reason", [
    (["I think it is 3."], {}, "no_code_nor_answer"),
    ([CODE_TURN] * 3, {"max_turns_eval": 3}, "max_turns"),
    ([CODE_TURN], {"max_images": 1}, "image_limit"),
    (["<code>\n```python\n1/0\n```\n</code>"], {"on_error": "terminate"}, "tool_error"),
])
def test_stop_reasons(image_task, turns, cfg, reason):
    (traj,) = _run(ScriptedPolicy(turns), image_task, **cfg)
    assert traj.stop_reason == reason


def test_error_feedback_reaches_the_model(image_task):
    seen = {}

    def turns(state):
        if state.turn == 0:
            return "<code>\n```python\n1/0\n```\n</code>"
        seen["obs"] = state.observations[-1][0]["text"]
        return ANSWER_TURN

    (traj,) = _run(ScriptedPolicy(turns), image_task)
    assert traj.stop_reason == "answered" and traj.failed_calls == 1
    assert "Error (error):" in seen["obs"] and "ZeroDivisionError" in seen["obs"]


def test_context_overflow(image_task):
    (traj,) = _run(ScriptedPolicy([CODE_TURN] * 30), image_task, max_context_tokens=256,
                   max_turns_eval=30)
    assert traj.stop_reason == "context_overflow"


def test_many_episodes_stream_in_finish_order(image_task):
    def turns(state):
        is_slow = "Question: slow?" in state.messages[0]["content"][-1]["text"]
        return CODE_TURN if is_slow and state.turn < 2 else ANSWER_TURN

    slow = ScriptedPolicy(turns)
    task, root = image_task
    tasks = [(task.model_copy(update={"id": f"q{i}", "question": "slow?" if i == 0 else "fast?"}), root)
             for i in range(3)]
    out = list(run_episodes(tasks, slow, AgentConfig(), SandboxConfig(), batch_size=2))
    assert [t.task_id for t in out] == ["q1", "q2", "q0"]
    assert all(t.stop_reason == "answered" for t in out)


def test_bad_media_reported_before_generation(tmp_path):
    task = Task(id="x", data_source="s", question="q", images=["missing.png"], answer="1",
                answer_type="number")
    with pytest.raises(DataError, match="missing.png"):
        build_initial_messages(task, tmp_path, "image", AgentConfig())


def test_video_prompt_has_no_frames_in_context(tmp_path):
    from tests.pipelines.agent.test_sandbox import _tiny_mp4

    _tiny_mp4(tmp_path / "v.mp4")
    task = Task(id="v", data_source="synth/video", question="How many?", video="v.mp4",
                answer="1", answer_type="number")
    messages, info, runtime = build_initial_messages(task, tmp_path, "video", AgentConfig())
    assert info.version == "video@v1" and runtime["videos"]["video_clue_0"] == tmp_path / "v.mp4"
    parts = messages[0]["content"]
    assert all(p["type"] == "text" for p in parts)
    assert "Frame Width: 64; Frame Height: 48; Frame Count: 12" in parts[0]["text"]
    frames, _, _ = build_initial_messages(task, tmp_path, "video_frames",
                                          AgentConfig(uniform_frames=4))
    assert sum(p["type"] == "image" for p in frames[0]["content"]) == 4


def test_tiny_model_through_hf_policy(tiny_model_dir, image_task):
    from pipelines.agent.policies.hf import HFPolicy

    policy = HFPolicy.from_pretrained(str(tiny_model_dir), image_max_pixels=50176)
    agent = AgentConfig(max_new_tokens_per_turn=12, eval_temperature=0.0, image_max_pixels=50176)
    (traj,) = list(run_episodes([image_task], policy, agent, SandboxConfig(), batch_size=2))
    trace = traj.trace
    assert trace is not None and traj.stop_reason in ("no_code_nor_answer", "context_overflow")
    assert sum(trace.response_mask) == traj.generated_tokens == len(trace.logprobs) > 0
    assert len(trace.input_ids) == trace.prompt_len + len(trace.response_mask)
    pad = policy.image_token_id
    assert sum(1 for t in trace.input_ids if t == pad) == traj.visual_tokens > 0
    text = policy.tokenizer.decode(trace.input_ids[: trace.prompt_len])
    assert "How wide is the image?" in text and text.endswith("<|im_start|>assistant\n")
    assert traj.turns[0].assistant == policy.tokenizer.decode(
        trace.input_ids[trace.prompt_len:], skip_special_tokens=False).removesuffix("<|im_end|>").removesuffix("<|endoftext|>")


def test_hf_policy_decodes_with_the_kv_cache_even_if_the_config_disables_it(tiny_model_dir,
                                                                              image_task):
    # LLaMA-Factory saves fine-tuned models with use_cache=false; generating without the cache
    # re-reads the whole context at every token (27x slower on the demo's SFT model).
    from pipelines.agent.policies.hf import HFPolicy

    policy = HFPolicy.from_pretrained(str(tiny_model_dir), image_max_pixels=50176)
    # As loaded from such a checkpoint: the generation config inherits the flag.
    policy.model.config.use_cache = False
    policy.model.config.get_text_config().use_cache = False
    policy.model.generation_config.use_cache = False
    seen: list[int] = []
    forward = policy.model.forward

    def counting_forward(*args, **kwargs):
        seen.append(kwargs["input_ids"].shape[1])
        return forward(*args, **kwargs)

    policy.model.forward = counting_forward
    messages, _, _ = build_initial_messages(image_task[0], image_task[1], "image", AgentConfig())
    handle = policy.begin(messages)
    policy.generate([handle], Sampling(max_new_tokens=6, temperature=0.0))
    assert seen[0] == len(handle.ids) - policy.token_counts(handle)["generated"]
    assert len(seen) > 1 and set(seen[1:]) == {1}


def test_hf_batched_equals_single_under_greedy(tiny_model_dir, image_task):
    from pipelines.agent.policies.hf import HFPolicy

    policy = HFPolicy.from_pretrained(str(tiny_model_dir), image_max_pixels=50176)
    agent = AgentConfig(image_max_pixels=50176)
    m1, _, _ = build_initial_messages(image_task[0], image_task[1], "image", agent)
    m2 = [{"role": "user", "content": [{"type": "text", "text": "A longer question " * 5}]}]
    s = Sampling(10, 0.0)
    batch = policy.generate([policy.begin(m1), policy.begin(m2)], s)
    single = [policy.generate([policy.begin(m), ], s)[0] for m in (m1, m2)]
    assert [g.text for g in batch] == [g.text for g in single]


def test_openai_policy_against_local_server(image_task):
    server = scripted_openai([(500, {}),
                              (200, chat_completion(CODE_TURN.removesuffix("</code>"), "</code>")),
                              (200, chat_completion(ANSWER_TURN))])
    try:
        policy = OpenAIPolicy(server.url, "served", backoff_s=0.01, max_retries=2)
        (traj,) = _run(policy, image_task)
    finally:
        server.close()
    assert traj.stop_reason == "answered" and traj.final_answer == "300" and traj.tool_calls == 1
    first, second = server.requests[1], server.requests[2]
    assert first["stop"] == ["</code>"] and first["model"] == "served"
    image_part = first["messages"][0]["content"][1]
    assert image_part["type"] == "image_url" and image_part["image_url"]["url"].startswith("data:image/png;base64,")
    assert second["messages"][1]["content"].endswith("</code>")  # the stop string was put back
    obs = second["messages"][2]["content"]
    assert any(p["type"] == "image_url" for p in obs)
    assert traj.visual_tokens > 0


def test_openai_endpoint_down_is_a_clear_error(image_task):
    policy = OpenAIPolicy("http://127.0.0.1:9", "m", backoff_s=0.01, max_retries=2, timeout_s=2)
    with pytest.raises(EndpointError, match=r"did not answer after 3 tries"):
        _run(policy, image_task)
    server = scripted_openai([(503, {})] * 3)
    try:
        with pytest.raises(EndpointError, match="HTTP 503"):
            _run(OpenAIPolicy(server.url, "m", backoff_s=0.01, max_retries=2), image_task)
    finally:
        server.close()


def test_agent_run_cli(tiny_model_dir, image_task, tmp_path):
    from pyvision_cli.agent import app

    _task, root = image_task
    result = CliRunner().invoke(app, ["run", "--model", str(tiny_model_dir), "--image",
                                      str(root / "a.png"), "--question", "How wide?",
                                      "--set", "agent.max_new_tokens_per_turn=8",
                                      "--set", "agent.image_max_pixels=50176",
                                      "--out-dir", str(tmp_path / "out"), "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["stop_reason"] and Path(data["trajectory_file"]).is_file()
    assert (tmp_path / "out" / "image_0.png").is_file()
    missing = CliRunner().invoke(app, ["run", "--model", str(tiny_model_dir), "--image",
                                       str(tmp_path / "nope.png"), "--question", "q"])
    assert missing.exit_code == 2 and "nope.png" in missing.output


def test_agent_run_shows_model_text_as_text(tiny_model_dir, image_task, tmp_path, monkeypatch):
    """Model text and interpreter output that look like Rich markup ("[/b]" crashed the
    command with a MarkupError, "[red]" restyled it) or carry ESC are shown as written."""
    from pipelines.agent import policies
    from pyvision_cli.agent import app

    text = "Look at a[/b] and [red]this[/red] \x1b[2J"
    code = "print('[/b]' + chr(27) + '[31m')"
    turns = [f"{text}\n<code>\n```python\n{code}\n```\n</code>",
             "<answer>\n[/i] 300\n</answer>"]
    monkeypatch.setattr(policies, "make_policy", lambda *a, **k: ScriptedPolicy(turns))
    _task, root = image_task
    result = CliRunner().invoke(app, ["run", "--model", str(tiny_model_dir), "--image",
                                      str(root / "a.png"), "--question", "How wide?",
                                      "--out-dir", str(tmp_path / "out")])
    assert result.exit_code == 0, result.output
    assert "Look at a[/b] and [red]this[/red] \\x1b[2J" in result.output
    assert "[/b]\\x1b[31m" in result.output and "[/i] 300" in result.output
    assert "\x1b" not in result.output


@pytest.mark.parametrize("mode", ["RGBA", "LA", "P"])
def test_transparent_images_are_on_white_everywhere_the_model_looks(tmp_path, mode):
    """A diagram drawn in black on a transparent background (stored as black, as most PNG
    writers store it) is put on white, as Qwen-VL's own preprocessing does, in the context
    image, in the sandbox's image_clue_0 and in the thumbnail. ``convert("RGB")`` made all three
    black."""
    from pipelines.agent.sandbox import Sandbox
    from pipelines.core.media import thumbnail_file

    img = Image.new("RGBA", (64, 64), (0, 0, 0, 0))
    img.paste((0, 0, 0, 255), (16, 16, 48, 48))  # a black square on transparent black
    if mode == "P":
        img = img.convert("P", palette=Image.Palette.ADAPTIVE, colors=4)
        img.info["transparency"] = img.getpixel((0, 0))
    else:
        img = img.convert(mode)
    img.save(tmp_path / "d.png")
    task = Task(id="d", data_source="synth/image-search", question="What shape?",
                images=["d.png"], answer="square", answer_type="text")
    messages, _info, media = build_initial_messages(task, tmp_path, "image", AgentConfig())
    (context,) = [p["image"] for p in messages[0]["content"] if p.get("type") == "image"]
    assert context.mode == "RGB" and context.getpixel((0, 0)) == (255, 255, 255)
    assert context.getpixel((context.width // 2, context.height // 2)) == (0, 0, 0)
    with Sandbox(SandboxConfig(timeout_s=10), images=media["images"]) as sbx:
        result = sbx.run("print(image_clue_0.mode, image_clue_0.getpixel((0, 0)), "
                         "image_clue_0.getpixel((32, 32)))")
    assert result.stdout.strip() == "RGB (255, 255, 255) (0, 0, 0)", result
    blob = thumbnail_file(tmp_path / "d.png", 64)
    import io

    with Image.open(io.BytesIO(blob.data)) as thumb:
        corner, centre = thumb.convert("RGB").getpixel((0, 0)), thumb.convert("RGB").getpixel((32, 32))
    assert min(corner) > 240 and max(centre) < 15


def test_a_16_bit_image_is_scaled_everywhere_the_model_looks(tmp_path):
    """A 16-bit greyscale PNG (a gradient over every value) is scaled to 8 bits in the context
    image, the sandbox's image_clue_0 and the thumbnail; ``convert("RGB")`` clipped it to
    nearly all white in all three."""
    import io

    import numpy as np

    from pipelines.agent.sandbox import Sandbox
    from pipelines.core.media import thumbnail_file

    Image.fromarray(np.arange(65536, dtype=np.uint16).reshape(256, 256)).save(tmp_path / "g.png")
    task = Task(id="g", data_source="synth/image-search", question="How bright?",
                images=["g.png"], answer="half", answer_type="text")
    messages, _info, media = build_initial_messages(task, tmp_path, "image", AgentConfig())
    (context,) = [p["image"] for p in messages[0]["content"] if p.get("type") == "image"]
    assert context.mode == "RGB" and abs(np.asarray(context).mean() - 127.5) < 1
    with Sandbox(SandboxConfig(timeout_s=10), images=media["images"]) as sbx:
        result = sbx.run("import numpy as np\na = np.asarray(image_clue_0)\n"
                         "print(image_clue_0.mode, a[0, 0, 0], a[128, 0, 0], a[255, 255, 0], "
                         "a.mean())")
    assert result.stdout.strip() == "RGB 0 128 255 127.5", result
    with Image.open(io.BytesIO(thumbnail_file(tmp_path / "g.png", 256).data)) as thumb:
        assert abs(np.asarray(thumb.convert("RGB")).mean() - 127.5) < 2


@pytest.mark.parametrize("h,w", [(200, 300), (1, 5000), (4000, 3000), (28, 28), (37, 1111)])
def test_smart_resize_matches_qwen_vl_utils(h, w):
    from qwen_vl_utils import smart_resize as reference

    from pipelines.agent.prompts import smart_resize

    for lo, hi in ((3136, 50176), (3136, 2_000_000)):
        if max(h, w) / min(h, w) > 200:
            continue
        assert smart_resize(h, w, 28, lo, hi) == reference(h, w, factor=28, min_pixels=lo, max_pixels=hi)


def test_a_tasks_first_turn_is_built_once_for_its_samples(image_task, monkeypatch, tmp_path):
    """RL draws n samples of a prompt: its images are decoded and resized once (on a pool
    thread, ahead of the episode), each sample still gets its own turn list, and the
    trajectories are those of building it per sample."""
    from pipelines.agent import loop

    other = tmp_path / "other"
    other.mkdir()
    Image.new("RGB", (240, 160), (20, 200, 20)).save(other / "a.png")
    second = (Task(id="t2", data_source="synth/image-search", question="How wide?",
                   images=["a.png"], answer="240", answer_type="number"), other)
    builds: list[str] = []
    real = loop.build_initial_messages

    def counting(task, *args):
        builds.append(task.id)
        return real(task, *args)

    monkeypatch.setattr(loop, "build_initial_messages", counting)
    agent = AgentConfig(max_turns_eval=5)
    policy = ScriptedPolicy([CODE_TURN, ANSWER_TURN])
    handles: list = []
    begin = policy.begin
    monkeypatch.setattr(policy, "begin", lambda m: handles.append(begin(m)) or handles[-1])
    trajs = list(run_episodes([image_task, second], policy, agent, SandboxConfig(timeout_s=10),
                              batch_size=2, n_per_item=3))
    assert sorted(builds) == ["t1", "t2"]
    assert sorted((t.task_id, t.sample_index) for t in trajs) == [
        ("t1", 0), ("t1", 1), ("t1", 2), ("t2", 0), ("t2", 1), ("t2", 2)]
    assert len({id(h.messages) for h in handles}) == 6  # no sample shares another's turns
    assert len({id(h.messages[0]["content"]) for h in handles}) == 6
    assert {t.task_id: t.turns[0].result.stdout for t in trajs} == {
        "t1": "(300, 200)\n", "t2": "(240, 160)\n"}
    assert all(t.stop_reason == "answered" and len(t.images) == 2 for t in trajs)
