"""The PyVision agent loop inside verl 0.9.1, constructed and post-processed as verl does it.

verl's server manager is replaced by two stand-ins with its ``generate`` signature and its
``TokenOutput``: a scripted one (exact trajectories) and one backed by the nano Qwen2.5-VL through
transformers (its forward pass checks that the image pad runs match the images it is given).
The outputs then go through verl's own ``AgentLoopWorker`` post-processing (padding, multimodal
inputs, mrope position ids) and batch assembly.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from omegaconf import OmegaConf
from PIL import Image
from verl.experimental.agent_loop.agent_loop import (
    AgentLoopWorker,
    DictConfigWrap,
    ToolListWrap,
)
from verl.workers.rollout.replica import TokenOutput

from pipelines.agent.prompts import build_initial_messages
from pipelines.config.recipe import load_recipe
from pipelines.core.records import Task
from pipelines.errors import DataError

TARGET = "pipelines.rl.verl.agent_loop.PyVisionAgentLoop"
CODE_TURN = ("Let me look.\n<code>\n```python\nprint(image_clue_0.size)\n"
             "plt.imshow(image_clue_0); plt.show()\n```\n</code>")
ANSWER_TURN = "It is wide.\n<answer>\n\\boxed{300}\n</answer>"
VIDEO_CODE = ("<code>\n```python\nn = len(video_clue_0)\nfor i in (0, n - 1):\n"
              "    plt.imshow(video_clue_0[i].asnumpy()); plt.show()\nprint(n)\n```\n</code>")
LOGPROB = -0.25
PROMPT_LENGTH, RESPONSE_LENGTH = 1024, 1024


# -- verl's side, rebuilt as AgentLoopWorker builds it -------------------------------------------

@pytest.fixture(scope="module")
def verl_parts(tiny_model_dir) -> dict[str, Any]:
    """Tokenizer and processor loaded by verl's own helpers (which bind mrope's get_rope_index)."""
    from transformers import AutoConfig
    from verl.utils.tokenizer import hf_processor, hf_tokenizer

    return {"tokenizer": hf_tokenizer(str(tiny_model_dir)),
            "processor": hf_processor(str(tiny_model_dir)),
            "model_type": AutoConfig.from_pretrained(str(tiny_model_dir)).model_type}


@pytest.fixture(scope="module")
def tiny_model(tiny_model_dir):
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_pretrained(str(tiny_model_dir)).eval()


def _trainer_config(response_length: int = RESPONSE_LENGTH) -> Any:
    return OmegaConf.create({
        "actor_rollout_ref": {"rollout": {"prompt_length": PROMPT_LENGTH,
                                          "response_length": response_length,
                                          "full_determinism": False}},
        "data": {"apply_chat_template_kwargs": {}, "mm_processor_kwargs": {}},
    })


def _recipe(tmp_path: Path, **agent: Any) -> Path:
    import yaml

    cfg = {"agent": {"max_turns_train": 3, "max_images": 8, "max_context_tokens": 4096,
                     "max_new_tokens_per_turn": 48, "image_max_pixels": 12544, **agent},
           "sandbox": {"timeout_s": 20}}
    text = yaml.safe_dump(cfg)
    path = tmp_path / f"rl-config-{abs(hash(text))}.yaml"
    path.write_text(text)
    return path


def _row(task: Task, root: Path, index: int = 0) -> dict[str, Any]:
    """The kwargs verl passes to run(): the parquet row's columns as RLHFDataset returns them."""
    return {"agent_name": "pyvision_agent", "data_source": task.data_source, "index": index,
            "raw_prompt": [{"role": "user", "content": task.question}],
            "reward_model": {"style": "rule", "ground_truth": task.answer},
            "extra_info": {"index": index, "split": "train", "task": task.model_dump_json(),
                           "media_root": str(root)},
            "tools_kwargs": {}, "priority": np.int64(3)}


def _run_rows(parts: dict, server: Any, recipe: Path, rows: list[dict], *,
              response_length: int = RESPONSE_LENGTH) -> list[tuple[Any, Any]]:
    """Instantiate one loop per row exactly as AgentLoopWorker._run_agent_loop does, inside a
    running event loop, and run them concurrently; return (loop object, AgentLoopOutput) pairs."""
    import hydra

    entry = OmegaConf.create([{"name": "pyvision_agent", "_target_": TARGET,
                               "recipe": str(recipe)}])[0]
    config = _trainer_config(response_length)
    # What AgentLoopWorker.generate_sequences passes (validation: greedy).
    sampling = {"temperature": 0.0, "top_p": 1.0, "top_k": -1, "repetition_penalty": 1.0,
                "logprobs": True}

    async def one(row: dict) -> tuple[Any, Any]:
        loop = hydra.utils.instantiate(
            config=entry, trainer_config=DictConfigWrap(config=config), server_manager=server,
            tokenizer=parts["tokenizer"], processor=parts["processor"],
            hf_model_type=parts["model_type"], dataset_cls=object,
            data_config=DictConfigWrap(config.data), tools=ToolListWrap([]))
        return loop, await loop.run(dict(sampling), **row)

    async def main():
        return await asyncio.gather(*(one(row) for row in rows))

    return asyncio.run(main())


def _run(parts: dict, server: Any, recipe: Path, row: dict, *,
         response_length: int = RESPONSE_LENGTH) -> tuple[Any, Any]:
    return _run_rows(parts, server, recipe, [row], response_length=response_length)[0]


def _verl_worker(parts: dict, response_length: int = RESPONSE_LENGTH) -> AgentLoopWorker:
    """An AgentLoopWorker holding only what its post-processing methods read."""
    worker = AgentLoopWorker.__new__(AgentLoopWorker)
    worker.config = _trainer_config(response_length)
    worker.rollout_config = worker.config.actor_rollout_ref.rollout
    worker.tokenizer, worker.processor = parts["tokenizer"], parts["processor"]
    worker.mm_processor_kwargs = {}
    worker.reward_loop_worker_handles = None
    worker.distillation_enabled = False
    return worker


def _verl_postprocess(parts: dict, output: Any, row: dict,
                      response_length: int = RESPONSE_LENGTH) -> tuple[Any, Any]:
    """verl's per-sample post-processing (padding, multimodal inputs, mrope positions) and batch
    assembly."""
    worker = _verl_worker(parts, response_length)
    internal = asyncio.run(worker._agent_loop_postprocess(output, False, **row))
    return internal, worker._postprocess([internal])


# -- stand-ins for verl's server manager ---------------------------------------------------------

class ScriptedServer:
    """Turn k of every trajectory (request id) is ``turns[k]``, token ids as vLLM returns them
    (eos included)."""

    def __init__(self, tokenizer: Any, turns: list[list[int]]):
        self.tokenizer, self.turns, self.calls = tokenizer, list(turns), []

    def turn(self, request_id: str) -> int:
        return sum(1 for c in self.calls if c["request_id"] == request_id)

    async def generate(self, request_id: str, *, prompt_ids: list[int],
                       sampling_params: dict[str, Any], image_data: list | None = None,
                       video_data: list | None = None, mm_processor_kwargs: dict | None = None,
                       **kwargs: Any) -> TokenOutput:
        ids = self.turns[self.turn(request_id)][: sampling_params["max_tokens"]]
        self.calls.append({"request_id": request_id, "prompt_ids": list(prompt_ids),
                           "params": dict(sampling_params), "images": list(image_data or []),
                           "mm_processor_kwargs": mm_processor_kwargs, **kwargs})
        return TokenOutput(token_ids=ids, log_probs=[LOGPROB] * len(ids) if
                           sampling_params.get("logprobs") else None, stop_reason="completed",
                           extra_fields={"global_steps": 7, "min_global_steps": 7,
                                         "max_global_steps": 7})


class TinyModelServer(ScriptedServer):
    """Greedy generation with the nano model (after ``script`` fixed turns), honouring ``stop``
    and ``max_tokens``; the forward pass fails if pad runs and images disagree."""

    def __init__(self, model: Any, processor: Any, script: list[list[int]] = ()):
        super().__init__(processor.tokenizer, list(script))
        self.model, self.processor = model, processor

    async def generate(self, request_id: str, *, prompt_ids: list[int],
                       sampling_params: dict[str, Any], image_data: list | None = None,
                       **kwargs: Any) -> TokenOutput:
        import torch

        if self.turn(request_id) < len(self.turns):
            return await super().generate(request_id, prompt_ids=prompt_ids,
                                          sampling_params=sampling_params,
                                          image_data=image_data, **kwargs)
        self.calls.append({"request_id": request_id, "prompt_ids": list(prompt_ids),
                           "params": dict(sampling_params), "images": list(image_data or [])})
        tok = self.tokenizer
        inputs: dict[str, Any] = {"input_ids": torch.tensor([prompt_ids])}
        if image_data:
            feats = self.processor.image_processor(images=image_data, return_tensors="pt",
                                                   **(kwargs.get("mm_processor_kwargs") or {}))
            # vLLM places image tokens with 3-D (mRoPE) positions; so does this stand-in.
            from pipelines.agent.policies.tokens import mm_token_type_ids

            inputs.update(pixel_values=feats["pixel_values"],
                          image_grid_thw=feats["image_grid_thw"],
                          mm_token_type_ids=mm_token_type_ids(inputs["input_ids"],
                                                              self.model.config))
        with torch.no_grad():
            out = self.model.generate(
                **inputs, attention_mask=torch.ones_like(inputs["input_ids"]),
                max_new_tokens=sampling_params["max_tokens"], do_sample=False,
                stop_strings=sampling_params["stop"], tokenizer=tok,
                eos_token_id=[tok.convert_tokens_to_ids("<|im_end|>"),
                              tok.convert_tokens_to_ids("<|endoftext|>")],
                pad_token_id=tok.pad_token_id, return_dict_in_generate=True, output_logits=True)
        ids = out.sequences[0, len(prompt_ids):].tolist()
        logits = torch.stack(out.logits, dim=1)[0].float()
        lp = torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids)[:, None])[:, 0].tolist()
        return TokenOutput(token_ids=ids, log_probs=lp, stop_reason="completed")


# -- tasks ----------------------------------------------------------------------------------------

@pytest.fixture
def image_task(tmp_path) -> tuple[Task, Path]:
    Image.new("RGB", (300, 200), (200, 20, 20)).save(tmp_path / "a.png")
    return Task(id="t1", data_source="synth/image-search", question="How wide is the image?",
                images=["a.png"], answer="300", answer_type="number"), tmp_path


@pytest.fixture
def video_task(tmp_path) -> tuple[Task, Path]:
    from tests.pipelines.agent.test_sandbox import _tiny_mp4

    _tiny_mp4(tmp_path / "v.mp4")
    return Task(id="v1", data_source="synth/video", question="How many frames?", video="v.mp4",
                answer="12", answer_type="number"), tmp_path


# -- helpers for the assertions -------------------------------------------------------------------

def _encode(tokenizer: Any, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def _pad_runs(ids: list[int], pad: int) -> list[int]:
    runs: list[int] = []
    for i, t in enumerate(ids):
        if t == pad:
            if i == 0 or ids[i - 1] != pad:
                runs.append(0)
            runs[-1] += 1
    return runs


def _expected_pads(processor: Any, images: list, mm_kwargs: dict) -> list[int]:
    feats = processor.image_processor(images=images, return_tensors="pt", **mm_kwargs)
    merge = processor.image_processor.merge_size ** 2
    return [int(g.prod()) // merge for g in feats["image_grid_thw"]]


def _segments(mask: list[int]) -> list[tuple[int, int, int]]:
    """(value, start, end) runs of the mask."""
    out: list[tuple[int, int, int]] = []
    for i, m in enumerate(mask):
        if out and out[-1][0] == m:
            out[-1] = (m, out[-1][1], i + 1)
        else:
            out.append((m, i, i + 1))
    return out


# -- tests ----------------------------------------------------------------------------------------

def test_scripted_image_trajectory_is_exact_and_verl_accepts_it(verl_parts, image_task, tmp_path):
    tok, processor = verl_parts["tokenizer"], verl_parts["processor"]
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    code_ids, answer_ids = _encode(tok, CODE_TURN), _encode(tok, ANSWER_TURN) + [im_end]
    server = ScriptedServer(tok, [code_ids, answer_ids])
    row = _row(*image_task)
    loop, out = _run(verl_parts, server, _recipe(tmp_path), row)

    # The trajectory, token for token: the model's two turns, and between them the closing
    # <|im_end|>\n and the interpreter turn with the figure's expanded pad run.
    images = out.multi_modal_data["images"]
    assert len(images) == 2  # the input image, then the figure the code showed
    pads = _expected_pads(processor, images, out.mm_processor_kwargs)
    pad = tok.convert_tokens_to_ids("<|image_pad|>")
    assert _pad_runs(out.prompt_ids + out.response_ids, pad) == pads
    observation = ("<|im_end|>\n<|im_start|>user\n<interpreter>\nText Result:\n(300, 200)\n"
                   "Image Result:\nFigure 2: <|vision_start|>" + "<|image_pad|>" * pads[1] +
                   "<|vision_end|>\n</interpreter><|im_end|>\n<|im_start|>assistant\n")
    obs_ids = _encode(tok, observation)
    assert out.response_ids == code_ids + obs_ids + answer_ids
    assert tok.decode(out.response_ids, skip_special_tokens=False) == \
        CODE_TURN + observation + ANSWER_TURN + "<|im_end|>"
    prompt_text = tok.decode(out.prompt_ids, skip_special_tokens=False)
    assert prompt_text.endswith("Question: How wide is the image?\n<|im_end|>\n<|im_start|>assistant\n")
    assert "Image Width: 300; Image Height: 200" in prompt_text
    assert out.response_mask == [1] * len(code_ids) + [0] * len(obs_ids) + [1] * len(answer_ids)
    assert out.response_logprobs == [LOGPROB if m else 0.0 for m in out.response_mask]

    fields = out.extra_fields
    assert (fields["tool_calls"], fields["successful_calls"], fields["failed_calls"]) == (1, 1, 0)
    assert fields["stop_reason"] == "answered" and fields["well_formed"] is True
    assert fields["final_answer"] == "300" and fields["answer_chars"] == len("\n\\boxed{300}\n")
    assert fields["produced_image"] is True and fields["num_turns"] == 2
    assert fields["max_global_steps"] == 7
    assert out.num_turns == 4  # prompt, assistant, interpreter, assistant (verl's count)

    # What the server saw: one request id, </code> as stop string, the full image list each turn,
    # and prompt ids that are the context so far.
    first, second = server.calls
    assert first["request_id"] == second["request_id"] and first["priority"] == 3
    assert first["params"]["stop"] == ["</code>"] and first["params"]["include_stop_str_in_output"]
    assert first["params"]["max_tokens"] == 48 and first["params"]["temperature"] == 0.0
    assert len(first["images"]) == 1 and len(second["images"]) == 2
    assert second["images"][1] is images[1]
    assert first["prompt_ids"] == out.prompt_ids
    assert second["prompt_ids"] == out.prompt_ids + code_ids + obs_ids
    assert second["mm_processor_kwargs"] == {"min_pixels": 3136, "max_pixels": 12544}

    # verl's Qwen-VL continuous-token builder renders the same prompt, and appends the same
    # interpreter turn once the assistant turn is closed with <|im_end|>.
    messages, _, _ = build_initial_messages(*image_task, "image",
                                            load_recipe(_recipe(tmp_path)).agent)
    ct = loop.continuous_token_builder
    assert ct.build_initial_tokens(messages, images=[images[0]]) == out.prompt_ids
    interpreter = [{"type": "text", "text": "<interpreter>\nText Result:\n(300, 200)\n"
                    "Image Result:\nFigure 2: "}, {"type": "image", "image": images[1]},
                   {"type": "text", "text": "\n</interpreter>"}]
    history = [*messages, {"role": "assistant", "content": CODE_TURN}]
    merged = ct.merge_context_tokens(history, [*history, {"role": "user", "content": interpreter}],
                                     out.prompt_ids + code_ids + [im_end])
    assert merged.token_ids == out.prompt_ids + code_ids + obs_ids

    # verl's own post-processing accepts it: padding, pixel inputs for both images, 3D positions.
    internal, batch = _verl_postprocess(verl_parts, out, row)
    grid = internal.multi_modal_inputs["image_grid_thw"]
    merge = processor.image_processor.merge_size ** 2
    assert [int(g.prod()) // merge for g in grid] == pads
    assert internal.position_ids.shape == (1, 4, PROMPT_LENGTH + RESPONSE_LENGTH)
    assert batch.batch["responses"].shape == (1, RESPONSE_LENGTH)
    assert int(batch.batch["response_mask"].sum()) == len(code_ids) + len(answer_ids)
    assert batch.non_tensor_batch["stop_reason"][0] == "answered"
    assert batch.non_tensor_batch["tool_calls"][0] == 1


def test_tiny_model_after_a_scripted_code_turn(verl_parts, tiny_model, image_task, tmp_path):
    """A real forward pass on every turn after the first: the model accepts the pad runs and the
    image list it is given (two images on turn 2), and the output decodes back to the turns."""
    tok, processor = verl_parts["tokenizer"], verl_parts["processor"]
    server = TinyModelServer(tiny_model, processor, script=[_encode(tok, CODE_TURN)])
    row = _row(*image_task)
    _, out = _run(verl_parts, server, _recipe(tmp_path), row)

    assert len(server.calls) >= 2 and len(server.calls[1]["images"]) == 2
    images = out.multi_modal_data["images"]
    pad = tok.convert_tokens_to_ids("<|image_pad|>")
    assert _pad_runs(out.prompt_ids + out.response_ids, pad) == \
        _expected_pads(processor, images, out.mm_processor_kwargs)
    segments = _segments(out.response_mask)
    model_segments = [out.response_ids[a:b] for m, a, b in segments if m == 1]
    assert model_segments[0] == _encode(tok, CODE_TURN)
    # The second model turn is what the model generated for the context the server saw.
    second_call = server.calls[1]
    assert second_call["prompt_ids"] == out.prompt_ids + out.response_ids[: segments[2][1]]
    assert len(model_segments) == len(server.calls) == out.extra_fields["num_turns"]
    assert out.extra_fields["tool_calls"] >= 1 and out.extra_fields["produced_image"]
    assert sum(out.response_mask) == sum(len(s) for s in model_segments)
    assert all(len(s) <= 48 for s in model_segments[1:])  # max_tokens honoured
    internal, _ = _verl_postprocess(verl_parts, out, row)
    assert internal.multi_modal_inputs["image_grid_thw"].shape[0] == len(images)


def test_same_trajectory_as_the_local_engine(verl_parts, tiny_model_dir, tiny_model, image_task,
                                             tmp_path):
    """Greedy, the verl loop and the local engine's transformers policy produce the same tokens,
    mask and log-probs: one protocol, one prompt, one set of limits."""
    from pipelines.agent.loop import run_episodes
    from pipelines.agent.policies.base import Sampling
    from pipelines.agent.policies.hf import HFPolicy

    recipe = _recipe(tmp_path, max_new_tokens_per_turn=16)
    server = TinyModelServer(tiny_model, verl_parts["processor"])
    _, out = _run(verl_parts, server, recipe, _row(*image_task))

    agent = load_recipe(recipe).agent
    policy = HFPolicy.from_pretrained(str(tiny_model_dir), image_max_pixels=agent.image_max_pixels)
    (traj,) = run_episodes([image_task], policy, agent, mode="train", batch_size=1,
                           sampling=Sampling(16, 0.0, 1.0))
    trace = traj.trace
    assert out.prompt_ids == trace.input_ids[: trace.prompt_len]
    assert out.response_ids == trace.input_ids[trace.prompt_len:]
    assert out.response_mask == trace.response_mask and sum(out.response_mask) > 0
    model_logprobs = [lp for lp, m in zip(out.response_logprobs, out.response_mask) if m]
    assert model_logprobs == pytest.approx(trace.logprobs, abs=1e-4)
    assert out.extra_fields["stop_reason"] == traj.stop_reason
    assert out.extra_fields["num_turns"] == traj.num_turns == len(server.calls)


def test_video_trajectory_images_come_only_from_code(verl_parts, video_task, tmp_path):
    tok, processor = verl_parts["tokenizer"], verl_parts["processor"]
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    server = ScriptedServer(tok, [_encode(tok, VIDEO_CODE),
                                  _encode(tok, "<answer>\n\\boxed{12}\n</answer>") + [im_end]])
    row = _row(*video_task)
    _, out = _run(verl_parts, server, _recipe(tmp_path, max_new_tokens_per_turn=128), row)

    assert server.calls[0]["images"] == []  # on-demand context: no frames in the prompt
    assert tok.convert_tokens_to_ids("<|image_pad|>") not in out.prompt_ids
    assert "Frame Count: 12" in tok.decode(out.prompt_ids)
    images = out.multi_modal_data["images"]
    assert len(images) == 2 and len(server.calls[1]["images"]) == 2
    pad = tok.convert_tokens_to_ids("<|image_pad|>")
    assert _pad_runs(out.response_ids, pad) == _expected_pads(processor, images,
                                                              out.mm_processor_kwargs)
    text = tok.decode(out.response_ids, skip_special_tokens=False)
    assert "Text Result:\n12\nImage Result:\nFigure 1: <|vision_start|>" in text
    assert "Figure 2: <|vision_start|>" in text
    assert out.extra_fields["final_answer"] == "12" and out.extra_fields["tool_calls"] == 1
    internal, _ = _verl_postprocess(verl_parts, out, row)
    assert internal.multi_modal_inputs["image_grid_thw"].shape[0] == 2

    # Answered without looking: no image anywhere, which verl must accept as a text-only sample.
    server = ScriptedServer(tok, [_encode(tok, "<answer>\n\\boxed{12}\n</answer>") + [im_end]])
    _, out = _run(verl_parts, server, _recipe(tmp_path), row)
    assert out.multi_modal_data == {} and out.extra_fields["produced_image"] is False
    assert out.extra_fields["tool_calls"] == 0 and out.extra_fields["well_formed"] is True
    internal, _ = _verl_postprocess(verl_parts, out, row)
    assert "image_grid_thw" not in internal.multi_modal_inputs
    assert internal.position_ids.shape == (1, 4, PROMPT_LENGTH + RESPONSE_LENGTH)


def test_exported_rows_read_by_verl_run_as_one_batch(verl_parts, tmp_path):
    """Rows written by our verl export and read by verl's RLHFDataset, each rolled out twice
    (rollout.n) concurrently, then post-processed and stacked into one batch: image rows (image in
    the context) and video rows (no image until the code shows one) side by side."""
    from verl.utils.dataset.rl_dataset import RLHFDataset, collate_fn

    from pipelines.data.export_verl import export_verl
    from pipelines.data.synth import synthesize

    tok = verl_parts["tokenizer"]
    synthesize("image-search", 2, 0, tmp_path / "img", progress=False)
    synthesize("video", 1, 0, tmp_path / "vid", progress=False)
    recipe = _recipe(tmp_path, max_new_tokens_per_turn=128)
    agent = load_recipe(recipe).agent
    info = export_verl([tmp_path / "img", tmp_path / "vid"], tmp_path / "out", name="rl",
                       agent_cfg=agent)
    config = OmegaConf.create({"max_prompt_length": PROMPT_LENGTH, "filter_overlong_prompts": False,
                               "cache_dir": str(tmp_path / "cache")})
    dataset = RLHFDataset(info["train"], tok, config, processor=verl_parts["processor"])
    batch = collate_fn([dataset[i] for i in range(len(dataset)) for _ in range(2)])
    columns = {k: v for k, v in batch.items() if isinstance(v, np.ndarray)}
    rows = [{**{k: v[i] for k, v in columns.items()}, "priority": np.int64(i)}
            for i in range(len(columns["index"]))]

    show = ("<code>\n```python\nplt.imshow(np.zeros((40, 60))); plt.show()\nprint('shown')\n"
            "```\n</code>")
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    server = ScriptedServer(tok, [_encode(tok, show),
                                  _encode(tok, "<answer>\n\\boxed{A}\n</answer>") + [im_end]])
    outputs = [out for _, out in _run_rows(verl_parts, server, recipe, rows)]

    assert len({c["request_id"] for c in server.calls}) == len(rows) == 6
    pad = tok.convert_tokens_to_ids("<|image_pad|>")
    for row, out in zip(rows, outputs):
        task = Task.model_validate_json(row["extra_info"]["task"])
        n_prompt_images = len(task.images)
        assert out.extra_fields["stop_reason"] == "answered", out.extra_fields
        assert len(out.multi_modal_data["images"]) == n_prompt_images + 1
        assert len(_pad_runs(out.prompt_ids, pad)) == n_prompt_images
        assert len(_pad_runs(out.prompt_ids + out.response_ids, pad)) == n_prompt_images + 1
        assert out.extra_fields["successful_calls"] == 1
        assert "Text Result:\nshown\nImage Result:" in tok.decode(out.response_ids)

    worker = _verl_worker(verl_parts)

    async def post():
        return [await worker._agent_loop_postprocess(out, False, **row)
                for row, out in zip(rows, outputs)]

    internals = asyncio.run(post())
    data = worker._postprocess(internals, input_non_tensor_batch=columns)
    assert data.batch["input_ids"].shape == (6, PROMPT_LENGTH + RESPONSE_LENGTH)
    assert data.batch["position_ids"].shape == (6, 4, PROMPT_LENGTH + RESPONSE_LENGTH)
    grids = [mmi["image_grid_thw"].shape[0] for mmi in data.non_tensor_batch["multi_modal_inputs"]]
    assert grids == [len(out.multi_modal_data["images"]) for out in outputs]
    assert list(data.non_tensor_batch["well_formed"]) == [True] * 6


def test_turn_and_response_limits(verl_parts, image_task, tmp_path):
    tok = verl_parts["tokenizer"]
    code_ids = _encode(tok, CODE_TURN)
    pad = tok.convert_tokens_to_ids("<|image_pad|>")

    server = ScriptedServer(tok, [code_ids] * 5)
    _, out = _run(verl_parts, server, _recipe(tmp_path, max_turns_train=2), _row(*image_task))
    assert out.extra_fields["stop_reason"] == "max_turns" and len(server.calls) == 2
    assert out.extra_fields["tool_calls"] == 2 and len(out.multi_modal_data["images"]) == 3

    # A response budget that the first interpreter turn overshoots: the response is cut before
    # the figure's span, and the figure leaves the image list with it.
    budget = len(code_ids) + 30
    server = ScriptedServer(tok, [code_ids] * 5)
    row = _row(*image_task)
    _, out = _run(verl_parts, server, _recipe(tmp_path), row, response_length=budget)
    assert out.extra_fields["stop_reason"] == "context_overflow" and len(server.calls) == 1
    assert len(out.response_ids) <= budget and out.extra_fields["response_truncated"]
    assert len(out.multi_modal_data["images"]) == 1
    assert _pad_runs(out.prompt_ids + out.response_ids, pad) == _pad_runs(out.prompt_ids, pad)
    _verl_postprocess(verl_parts, out, row, response_length=budget)

    # The image limit of the agent settings.
    server = ScriptedServer(tok, [code_ids] * 5)
    _, out = _run(verl_parts, server, _recipe(tmp_path, max_images=1), _row(*image_task))
    assert out.extra_fields["stop_reason"] == "image_limit"
    assert len(out.multi_modal_data["images"]) == 1


def test_sampled_vision_tokens_end_the_turn(verl_parts, image_task, tmp_path):
    tok = verl_parts["tokenizer"]
    pad = tok.convert_tokens_to_ids("<|image_pad|>")
    thinking = _encode(tok, "I think")
    server = ScriptedServer(tok, [thinking + [pad, pad] + _encode(tok, " more")])
    row = _row(*image_task)
    _, out = _run(verl_parts, server, _recipe(tmp_path), row)
    assert out.response_ids == thinking and out.response_mask == [1] * len(thinking)
    assert out.extra_fields["stop_reason"] == "no_code_nor_answer"
    _verl_postprocess(verl_parts, out, row)


def test_row_without_task_is_a_data_error(verl_parts, image_task, tmp_path):
    row = _row(*image_task)
    row["extra_info"] = {"index": 4, "split": "train"}
    with pytest.raises(DataError, match="verl row index 4 has no extra_info.task"):
        _run(verl_parts, ScriptedServer(verl_parts["tokenizer"], []), _recipe(tmp_path), row)


def test_sandboxes_outlive_the_thread_that_started_the_zygote():
    """Each trajectory runs in its own short-lived threads; the first one starts the sandbox
    zygote, and bwrap's --die-with-parent would kill it (and every live sandbox) when that
    thread ends."""
    import threading
    import time

    from pipelines.agent import sandbox
    from pipelines.config.sandbox import SandboxConfig

    sandbox.shutdown()  # the next sandbox starts a fresh zygote, from the thread below
    made: dict[str, Any] = {}
    thread = threading.Thread(target=lambda: made.setdefault(
        "box", sandbox.Sandbox(SandboxConfig(timeout_s=20))))
    thread.start()
    thread.join()
    time.sleep(0.3)  # the parent-death signal would have arrived by now
    with made["box"] as box:
        result = box.run("print(6 * 7)")
    assert (result.status, result.stdout) == ("ok", "42\n")
