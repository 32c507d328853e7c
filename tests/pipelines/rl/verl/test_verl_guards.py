"""Guards against the verl pitfalls others hit, through our verl agent loop, reward and ranking
on CPU (verl's own classes, a stand-in server; see test_verl_agent_loop.py).

- image pixels: one resize (``resize_for_context``) for the agent loop, SFT export and
  evaluation, and the visual token count per image checked against it;
- truncation: a response over its budget is cut at a turn boundary, never inside an image span;
- prompt over length: dropped with a counted reason, at export and in the agent loop;
- turn separators: incremental encoding equals the chat template's render of the whole
  conversation (image and video trajectories, Qwen2.5-VL and Qwen3-VL);
- stop reasons: every trajectory has one, and each rate is a training metric and in the report.
"""

from __future__ import annotations

import asyncio
import copy
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from omegaconf import OmegaConf
from PIL import Image
from verl.experimental.agent_loop.agent_loop import AgentLoopWorker, DictConfigWrap, ToolListWrap

from pipelines.agent.policies.tokens import ChatTokens
from pipelines.agent.prompts import build_initial_messages, context_size, resize_for_context
from pipelines.agent.protocol import format_observation
from pipelines.agent.trajectory import STOP_REASONS
from pipelines.config.recipe import load_recipe
from pipelines.core.records import Task
from pipelines.errors import DataError, UserError
from pipelines.rl.verl.agent_loop import fit_response
from tests.pipelines.rl.verl import test_verl_launch
from tests.pipelines.rl.verl.test_verl_agent_loop import (
    ANSWER_TURN,
    CODE_TURN,
    TARGET,
    ScriptedServer,
    _encode,
    _pad_runs,
    _row,
)

SHOW_BIG = ("Zoom.\n<code>\n```python\nimage_clue_0.show()\n"
            "plt.figure(figsize=(7, 4), dpi=100); plt.imshow(np.zeros((400, 700))); plt.show()\nprint('ok')\n```\n</code>")
VIDEO_CODE = ("<code>\n```python\nn = len(video_clue_0)\nfor i in (0, n - 1):\n"
              "    plt.imshow(video_clue_0[i].asnumpy()); plt.show()\nprint(n)\n```\n</code>")

# pipelines.rl.verl.ranking imported against a stand-in transfer_queue (verl's replay buffer
# imports it; it is not installed here).
ranking = test_verl_launch.ranking


# -- verl's side ----------------------------------------------------------------------------------

def _parts(model_dir: Path) -> dict[str, Any]:
    from transformers import AutoConfig
    from verl.utils.tokenizer import hf_processor, hf_tokenizer

    return {"tokenizer": hf_tokenizer(str(model_dir)), "processor": hf_processor(str(model_dir)),
            "model_type": AutoConfig.from_pretrained(str(model_dir)).model_type}


@pytest.fixture(scope="module")
def qwen25(tiny_model_dir) -> dict[str, Any]:
    return _parts(tiny_model_dir)


@pytest.fixture(scope="module")
def qwen3(tiny_qwen3_dir) -> dict[str, Any]:
    return _parts(tiny_qwen3_dir)


def _config(prompt_length: int, response_length: int) -> Any:
    return OmegaConf.create({
        "actor_rollout_ref": {"rollout": {"prompt_length": prompt_length,
                                          "response_length": response_length,
                                          "full_determinism": False}},
        "data": {"apply_chat_template_kwargs": {}, "mm_processor_kwargs": {}},
    })


def _recipe(tmp_path: Path, rl: dict | None = None, **agent: Any) -> Path:
    import yaml

    cfg = {"agent": {"max_turns_train": 3, "max_images": 8, "max_context_tokens": 4096,
                     "max_new_tokens_per_turn": 128, "image_max_pixels": 12544, **agent},
           "sft": {"image_max_pixels": 100_000}, "sandbox": {"timeout_s": 20}, "rl": rl or {}}
    text = yaml.safe_dump(cfg)
    path = tmp_path / f"rl-config-{abs(hash(text))}.yaml"
    path.write_text(text)
    return path


def _run(parts: dict, server: Any, recipe: Path, row: dict, *, prompt_length: int = 1024,
         response_length: int = 1024) -> Any:
    """One trajectory through PyVisionAgentLoop, built as AgentLoopWorker builds it."""
    import hydra

    entry = OmegaConf.create([{"name": "pyvision_agent", "_target_": TARGET,
                               "recipe": str(recipe)}])[0]
    config = _config(prompt_length, response_length)
    sampling = {"temperature": 0.0, "top_p": 1.0, "top_k": -1, "repetition_penalty": 1.0,
                "logprobs": True}

    async def main():
        loop = hydra.utils.instantiate(
            config=entry, trainer_config=DictConfigWrap(config=config), server_manager=server,
            tokenizer=parts["tokenizer"], processor=parts["processor"],
            hf_model_type=parts["model_type"], dataset_cls=object,
            data_config=DictConfigWrap(config.data), tools=ToolListWrap([]))
        return await loop.run(dict(sampling), **row)

    return asyncio.run(main())


def _postprocess(parts: dict, output: Any, row: dict, *, prompt_length: int = 1024,
                 response_length: int = 1024) -> Any:
    """verl's per-sample post-processing (padding, pixel inputs, mrope positions)."""
    worker = AgentLoopWorker.__new__(AgentLoopWorker)
    worker.config = _config(prompt_length, response_length)
    worker.rollout_config = worker.config.actor_rollout_ref.rollout
    worker.tokenizer, worker.processor = parts["tokenizer"], parts["processor"]
    worker.mm_processor_kwargs = {}
    worker.reward_loop_worker_handles = None
    worker.distillation_enabled = False
    internal = asyncio.run(worker._agent_loop_postprocess(output, False, **row))
    worker._postprocess([internal])
    return internal


def _ids(tok: Any, name: str) -> int:
    return tok.convert_tokens_to_ids(name)


@pytest.fixture
def big_image_task(tmp_path) -> tuple[Task, Path]:
    rng = np.random.default_rng(0)
    Image.fromarray(rng.integers(0, 255, (600, 900, 3), dtype=np.uint8)).save(tmp_path / "a.png")
    return Task(id="big", data_source="synth/image-search", question="What is there?",
                images=["a.png"], answer="A", answer_type="text"), tmp_path


@pytest.fixture
def video_task(tmp_path) -> tuple[Task, Path]:
    from tests.pipelines.agent.test_sandbox import _tiny_mp4

    _tiny_mp4(tmp_path / "v.mp4")
    return Task(id="v1", data_source="synth/video", question="How many frames?", video="v.mp4",
                answer="12", answer_type="number"), tmp_path


# -- image pixels ---------------------------------------------------------------------------------

def test_every_image_is_resized_once_by_our_rule_and_its_tokens_counted(qwen25, big_image_task,
                                                                      tmp_path):
    """Prompt image (900x600) and interpreter images (the full image shown again, a 700x400
    figure) reach the server, verl's post-processing and the token ids at the size
    resize_for_context gives, with (w/28)*(h/28) pad tokens each."""
    tok = qwen25["tokenizer"]
    im_end = _ids(tok, "<|im_end|>")
    server = ScriptedServer(tok, [_encode(tok, SHOW_BIG), _encode(tok, ANSWER_TURN) + [im_end]])
    row = _row(*big_image_task)
    recipe = _recipe(tmp_path)
    out = _run(qwen25, server, recipe, row)
    agent = load_recipe(recipe).agent
    bounds = (agent.image_min_pixels, agent.image_max_pixels, agent.image_factor)

    images = out.multi_modal_data["images"]
    assert len(images) == 3
    original = Image.open(big_image_task[1] / "a.png").convert("RGB")
    expected_sizes = [context_size(900, 600, *bounds), context_size(900, 600, *bounds),
                      context_size(700, 400, *bounds)]
    assert [img.size for img in images] == expected_sizes
    assert all(w * h <= agent.image_max_pixels and w % 28 == 0 and h % 28 == 0
               for w, h in expected_sizes)
    # The prompt image is exactly our resize of the original (not the processor's).
    assert np.array_equal(np.asarray(images[0]),
                          np.asarray(resize_for_context(original, *bounds)))
    pads = [(w // 28) * (h // 28) for w, h in expected_sizes]
    pad = _ids(tok, "<|image_pad|>")
    assert _pad_runs(out.prompt_ids + out.response_ids, pad) == pads
    assert out.extra_fields["visual_tokens"] == sum(pads)
    # The server got the same images; verl's own processor call agrees on every image's grid.
    assert [im.size for im in server.calls[-1]["images"]] == expected_sizes
    internal = _postprocess(qwen25, out, row)
    grid = internal.multi_modal_inputs["image_grid_thw"]
    assert [int(g.prod()) // 4 for g in grid] == pads

    # SFT export uses the same function: a foreign image is resized once to that size, an
    # image of our own trajectories (already at context size) is referenced unchanged.
    from pipelines.core.records import Conversation, Message
    from pipelines.data.export_llamafactory import export_llamafactory

    images[0].save(tmp_path / "ctx.png")
    conv = Conversation(id="c", data_source="x", images=["a.png", "ctx.png"], messages=[
        Message(role="user", content="<image><image>Q"), Message(role="assistant", content="A")])
    info = export_llamafactory([(tmp_path, [conv])], tmp_path / "sft", agent_cfg=agent)
    assert info["images_resized"] == 1
    import json

    row_sft = json.loads((tmp_path / "sft" / "pyvision_sft.jsonl").read_text())
    paths = [(tmp_path / "sft" / p).resolve() for p in row_sft["images"]]
    assert paths[1] == (tmp_path / "ctx.png").resolve()
    exported = Image.open(paths[0]).convert("RGB")
    assert exported.size == expected_sizes[0]
    assert np.array_equal(np.asarray(exported), np.asarray(images[0]))


def test_a_processor_that_ignores_max_pixels_is_caught(tiny_model_dir):
    """Qwen2.5-VL's processor has been reported to ignore max_pixels passed as a kwarg: one that
    does, with narrower bounds of its own, would shrink our images and desynchronise the visual
    tokens; the token count check names it."""
    from transformers import AutoProcessor

    inner = copy.deepcopy(AutoProcessor.from_pretrained(str(tiny_model_dir)))
    inner.image_processor.max_pixels = 3136
    inner.image_processor.size = {"shortest_edge": 784, "longest_edge": 3136}

    class IgnoresPixelKwargs:
        tokenizer = inner.tokenizer
        image_processor = inner.image_processor
        image_token_id = getattr(inner, "image_token_id", None)

        def apply_chat_template(self, *args: Any, **kwargs: Any) -> Any:
            return inner.apply_chat_template(*args, **kwargs)

        def __call__(self, *args: Any, min_pixels: Any = None, max_pixels: Any = None,
                     **kwargs: Any) -> Any:
            return inner(*args, **kwargs)

    image = Image.new("RGB", (900, 600), (10, 200, 30))
    messages = [{"role": "user", "content": [{"type": "image", "image": image},
                                             {"type": "text", "text": "Q"}]}]
    honest = ChatTokens(AutoProcessor.from_pretrained(str(tiny_model_dir)),
                        image_max_pixels=12544)
    ctx = honest.begin(messages)
    w, h = ctx.images[0].size
    assert (w, h) == context_size(900, 600, 3136, 12544) and len(ctx.grids) == 1
    with pytest.raises(UserError, match="visual tokens for a .* image at its context size"):
        ChatTokens(IgnoresPixelKwargs(), image_max_pixels=12544).begin(messages)


def test_image_factor_must_match_the_processor(tiny_qwen3_dir):
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(str(tiny_qwen3_dir))
    with pytest.raises(UserError, match=r"32x32 pixels \(patch 16 x merge 2\) but "
                                        r"agent.image_factor is 28") as exc:
        ChatTokens(processor)
    assert "agent.image_factor=32" in exc.value.hint
    assert ChatTokens(processor, image_factor=32).merge == 4


# -- truncation at a turn boundary ----------------------------------------------------------------

def test_fit_response_cuts_at_a_turn_boundary():
    vs, ve, pad = 1, 2, 3
    prompt = [9, vs, pad, pad, ve]
    # model 0-1 | environment 2-11 (two figures) | model 12
    response = [5, 5, vs, pad, pad, pad, ve, 6, vs, pad, pad, ve, 7]
    mask = [1, 1] + [0] * 10 + [1]
    images = ["prompt", "fig1", "fig2"]
    for budget, kept, n in [(20, 13, 3), (13, 13, 3), (12, 12, 3), (11, 2, 1), (7, 2, 1),
                            (2, 2, 1)]:
        ids, m, lp, imgs = fit_response(prompt, response, mask, [0.0] * 13, images, budget,
                                        vs, ve, pad)
        assert (len(ids), len(imgs)) == (kept, n), budget
        assert m == mask[:kept] and len(lp) == kept and imgs == images[:n]
    # No boundary within the budget (a single turn longer than it): never inside a span.
    ids, _, _, imgs = fit_response(prompt, [vs, pad, pad, ve, 4, 4], [0] * 6, None,
                                   ["prompt", "fig"], 2, vs, ve, pad)
    assert ids == [] and imgs == ["prompt"]


def test_long_trajectory_at_the_limit_is_cut_between_turns(qwen25, big_image_task, tmp_path):
    tok = qwen25["tokenizer"]
    vs, ve = _ids(tok, "<|vision_start|>"), _ids(tok, "<|vision_end|>")
    code = _encode(tok, SHOW_BIG)
    row = _row(*big_image_task)
    recipe = _recipe(tmp_path, max_turns_train=3)  # 1 + 3 x 2 images: within max_images
    full = _run(qwen25, ScriptedServer(tok, [code] * 5), recipe, row)
    assert full.extra_fields["stop_reason"] == "max_turns"
    # A budget that ends inside the third figure's span (second interpreter turn).
    starts = [i for i, t in enumerate(full.response_ids) if t == vs]
    budget = starts[2] + 5
    out = _run(qwen25, ScriptedServer(tok, [code] * 5), recipe, row, response_length=budget)
    assert out.extra_fields["stop_reason"] == "context_overflow"
    assert out.extra_fields["response_truncated"] is True
    n = len(out.response_ids)
    assert n <= budget and out.response_ids == full.response_ids[:n]
    # At a turn boundary: the next token of the full trajectory starts another turn.
    assert full.response_mask[n] != full.response_mask[n - 1]
    assert out.response_ids.count(vs) == out.response_ids.count(ve)
    pad = _ids(tok, "<|image_pad|>")
    assert len(out.multi_modal_data["images"]) == len(_pad_runs(out.prompt_ids + out.response_ids,
                                                                pad))
    _postprocess(qwen25, out, row, response_length=budget)


# -- prompt over length ----------------------------------------------------------------------------

def test_prompt_over_length_is_dropped_and_counted_not_raised(qwen25, big_image_task, tmp_path,
                                                              ranking):
    from pipelines.rl.strategy import StrategyConfig

    GroupData, Session, choose = ranking[0].GroupData, ranking[0].Session, ranking[0].choose

    tok = qwen25["tokenizer"]
    server = ScriptedServer(tok, [_encode(tok, CODE_TURN)])
    row = _row(*big_image_task)
    out = _run(qwen25, server, _recipe(tmp_path), row, prompt_length=48)
    fields = out.extra_fields
    assert fields["stop_reason"] == "prompt_too_long" and server.calls == []
    assert fields["prompt_tokens"] > 48 and len(out.prompt_ids) <= 48
    assert sum(out.response_mask) == 0 and out.multi_modal_data == {}
    assert len(out.response_logprobs) == len(out.response_ids)
    _postprocess(qwen25, out, row, prompt_length=48)  # verl pads and batches it

    # The sampler drops such rollouts (whatever filter_broken says) and counts them.
    extra = dict(fields, reward_extra_info={"correct": 0.0})
    ok = {"stop_reason": "answered", "final_answer": "A", "produced_image": True}
    groups = [GroupData("u0", 0, [Session([f"u0_{i}_0"], -0.5, extra) for i in range(2)]),
              GroupData("u1", 1, [Session(["u1_0_0"], 1.0, ok), Session(["u1_1_0"], 0.0, ok)])]
    choice = choose(groups, 2, StrategyConfig(filter_broken=False, filter_zero_variance=False))
    assert choice.kept_uids == ["u1"]
    assert choice.metrics["strategy/dropped_broken_prompt_too_long"] == 2
    assert choice.metrics["stop/prompt_too_long"] == 0.5


def test_prompt_over_length_at_export_and_in_the_local_loop(tiny_model_dir, tmp_path):
    from transformers import AutoProcessor

    from pipelines.agent.loop import run_episodes
    from pipelines.agent.policies.hf import HFPolicy
    from pipelines.config.agent import AgentConfig
    from pipelines.data.export_verl import export_verl
    from pipelines.data.synth import synthesize

    synthesize("image-search", 4, 0, tmp_path / "img", progress=False)
    agent = AgentConfig(image_max_pixels=12544, max_new_tokens_per_turn=8, max_turns_train=1)
    processor = AutoProcessor.from_pretrained(str(tiny_model_dir))
    info = export_verl([tmp_path / "img"], tmp_path / "out", agent_cfg=agent,
                       processor=processor, max_prompt_tokens=10_000)
    assert info["rows"] == 4 and info["skipped"] == {}
    from pipelines.core.records import read_tasks

    tasks, _ = read_tasks(tmp_path / "img")
    policy = HFPolicy.from_pretrained(str(tiny_model_dir), image_max_pixels=12544)
    lengths = [policy.tokens.begin(build_initial_messages(t, tmp_path / "img", "image", agent)[0])
               .prompt_len for t in tasks]
    limit = sorted(lengths)[1]  # the two shortest prompts fit, at least one does not
    over = sum(n > limit for n in lengths)
    assert over >= 1
    # The export counts a prompt as the policy does, and drops exactly the ones over the limit.
    info = export_verl([tmp_path / "img"], tmp_path / "out2", agent_cfg=agent,
                       processor=processor, max_prompt_tokens=limit)
    assert info["rows"] == 4 - over and info["skipped"] == {"prompt_too_long": over}
    assert f"tokens (image tokens included), more than {limit}" in info["problems"][0]
    with pytest.raises(DataError, match="no usable task"):
        export_verl([tmp_path / "img"], tmp_path / "out3", agent_cfg=agent,
                    processor=processor, max_prompt_tokens=50)

    trajs = list(run_episodes([(t, tmp_path / "img") for t in tasks], policy, agent,
                              mode="train", batch_size=4, max_prompt_tokens=limit))
    stops = {t.task_id: t.stop_reason for t in trajs}
    for t, n in zip(tasks, lengths):
        assert (stops[t.id] == "prompt_too_long") == (n > limit)
    assert any(s == "prompt_too_long" for s in stops.values())
    assert all(t.generated_tokens == 0 for t in trajs if t.stop_reason == "prompt_too_long")


# -- turn separators --------------------------------------------------------------------------------

def _full_render(parts: dict, messages: list[dict], images: list, mm_kwargs: dict) -> list[int]:
    processor = parts["processor"]
    plain = [{"role": m["role"], "content": m["content"] if isinstance(m["content"], str) else
              [{"type": "image"} if p.get("type") == "image" else p for p in m["content"]]}
             for m in messages]
    text = processor.apply_chat_template(plain, add_generation_prompt=False, tokenize=False)
    enc = processor(text=[text], images=images or None, return_tensors="pt",
                    **(mm_kwargs if images else {}))
    return enc["input_ids"][0].tolist()


def _check_against_full_render(parts: dict, out: Any, task_root: tuple, variant: str,
                               agent: Any, turns: list[str], stdout: str,
                               first_figure: int) -> None:
    """prompt + response == the template's render of the whole conversation (which ends with
    "<|im_end|>\\n" where the sampled turn ends at "<|im_end|>")."""
    messages, _, _ = build_initial_messages(*task_root, variant, agent)
    images = out.multi_modal_data.get("images", [])
    n_prompt = sum(1 for p in messages[0]["content"] if p.get("type") == "image")
    figures = images[n_prompt:]
    observation = format_observation("ok", stdout, "", len(figures), first_figure, "feedback")
    it = iter(figures)
    observation = [{"type": "image", "image": next(it)} if p.get("type") == "image" else p
                   for p in observation]
    conversation = [*messages, {"role": "assistant", "content": turns[0]},
                    {"role": "user", "content": observation},
                    {"role": "assistant", "content": turns[1]}]
    full = _full_render(parts, conversation, images, out.mm_processor_kwargs or {})
    ours = out.prompt_ids + out.response_ids
    assert ours == full[: len(ours)]
    assert parts["tokenizer"].decode(full[len(ours):]) == "\n"


@pytest.mark.parametrize("arch", ["qwen2_5_vl", "qwen3_vl"])
def test_incremental_tokens_equal_the_full_render(arch, qwen25, qwen3, big_image_task,
                                                  video_task, tmp_path):
    parts = qwen25 if arch == "qwen2_5_vl" else qwen3
    factor = 28 if arch == "qwen2_5_vl" else 32
    tok = parts["tokenizer"]
    im_end = _ids(tok, "<|im_end|>")
    answer = ANSWER_TURN

    # Image trajectory: image in the prompt, two figures in the interpreter turn.
    recipe = _recipe(tmp_path, image_factor=factor, image_min_pixels=4096)
    agent = load_recipe(recipe).agent
    out = _run(parts, ScriptedServer(tok, [_encode(tok, SHOW_BIG), _encode(tok, answer) +
                                           [im_end]]), recipe, _row(*big_image_task))
    assert out.extra_fields["stop_reason"] == "answered"
    _check_against_full_render(parts, out, big_image_task, "image", agent, [SHOW_BIG, answer],
                               "ok", 2)

    # Video trajectory (on-demand context): no frame in the prompt, two frames shown by code.
    vanswer = "<answer>\n\\boxed{12}\n</answer>"
    out = _run(parts, ScriptedServer(tok, [_encode(tok, VIDEO_CODE), _encode(tok, vanswer) +
                                           [im_end]]), recipe, _row(*video_task))
    assert len(out.multi_modal_data["images"]) == 2
    _check_against_full_render(parts, out, video_task, "video", agent, [VIDEO_CODE, vanswer],
                               "12", 1)

    # Video with uniform context frames (the baseline): frames in the prompt, then the code's.
    recipe = _recipe(tmp_path, image_factor=factor, image_min_pixels=4096,
                     video_context="uniform", uniform_frames=3)
    agent = load_recipe(recipe).agent
    out = _run(parts, ScriptedServer(tok, [_encode(tok, VIDEO_CODE), _encode(tok, vanswer) +
                                           [im_end]]), recipe, _row(*video_task))
    assert len(out.multi_modal_data["images"]) == 5
    _check_against_full_render(parts, out, video_task, "video_frames", agent,
                               [VIDEO_CODE, vanswer], "12", 4)
    _postprocess(parts, out, _row(*video_task))


# -- stop reasons ---------------------------------------------------------------------------------

def test_every_stop_reason_is_recorded_and_is_a_training_metric(qwen25, big_image_task, tmp_path,
                                                                ranking):
    from pipelines.rl.strategy import StrategyConfig

    GroupData, Session, choose = ranking[0].GroupData, ranking[0].Session, ranking[0].choose

    tok = qwen25["tokenizer"]
    im_end = _ids(tok, "<|im_end|>")
    code = _encode(tok, CODE_TURN)
    failing = _encode(tok, "<code>\n```python\n1 / 0\n```\n</code>")
    cases = {
        "answered": ([_encode(tok, ANSWER_TURN) + [im_end]], {}, {}),
        "max_turns": ([code] * 3, {"max_turns_train": 2}, {}),
        "context_overflow": ([code] * 3, {}, {"response_length": len(code) + 20}),
        "image_limit": ([code] * 3, {"max_images": 1}, {}),
        "no_code_nor_answer": ([_encode(tok, "I am not sure.") + [im_end]], {}, {}),
        "tool_error": ([failing], {"on_error": "terminate"}, {}),
        "prompt_too_long": ([code], {}, {"prompt_length": 40}),
    }
    assert set(cases) == set(STOP_REASONS)
    row = _row(*big_image_task)
    extras = {}
    for reason, (turns, agent, limits) in cases.items():
        out = _run(qwen25, ScriptedServer(tok, turns), _recipe(tmp_path, **agent), row, **limits)
        assert out.extra_fields["stop_reason"] == reason, (reason, out.extra_fields)
        _postprocess(qwen25, out, row, **limits)
        extras[reason] = {**out.extra_fields, "reward_extra_info": {"correct": 0.0}}
    groups = [GroupData(f"u{i}", i, [Session([f"u{i}_0_0"], float(i), extra)])
              for i, extra in enumerate(extras.values())]
    metrics = choose(groups, 7, StrategyConfig()).metrics
    for reason in STOP_REASONS:
        assert metrics[f"stop/{reason}"] == pytest.approx(1 / 7), reason

    # The local engine's step metrics have every reason too (0 when none stopped so).
    from pipelines.rl.strategy import stop_rates

    rates = stop_rates(["answered", "answered", "max_turns", None])
    assert rates["stop/answered"] == 0.5 and rates["stop/max_turns"] == 0.25
    assert rates["stop/unknown"] == 0.25 and rates["stop/tool_error"] == 0.0
    assert {f"stop/{r}" for r in STOP_REASONS} <= set(rates)


def test_stop_rates_are_in_the_report(tmp_path):
    from pipelines.report import collect, to_html, to_markdown
    from pipelines.store import Store

    store = Store(tmp_path / "s.duckdb")
    store.upsert_run("r1", "t", config={})
    for step, (answered, turns, n) in enumerate([(0.5, 0.5, 8), (1.0, 0.0, 4)]):
        store.log_metrics("r1", "rl", step, {"trajectories": n, "stop/answered": answered,
                                             "stop/max_turns": turns, "stop/tool_error": 0.0,
                                             "train/masked_truncated": 2 * turns,
                                             "strategy/generated_groups": 3,
                                             "strategy/groups_varying_reward": 2,
                                             "strategy/groups_varying_accuracy": 1})
    data = collect(store, ["r1"])
    (t,) = data.training
    assert t["trajectories"] == 12 and t["steps"] == 2
    assert t["stop_rates"] == {"answered": pytest.approx(8 / 12), "max_turns": pytest.approx(4 / 12)}
    assert (t["masked_truncated"], t["groups_varying_reward"], t["groups_varying_accuracy"],
            t["groups"]) == (1, 4, 2, 6)
    md = to_markdown(data)
    assert "## RL rollouts: why they stopped" in md
    assert "answered 66.7%, max_turns 33.3%" in md and "| 4 / 2 / 6 |" in md
    assert "RL rollouts: why they stopped" in to_html(data)
