"""The tiny Qwen2.5-VL: standard HF round trip, determinism, tokenizer, LLaMA-Factory parity."""

from __future__ import annotations

import json

import pytest
import torch
from PIL import Image
from safetensors.torch import load_file
from typer.testing import CliRunner

from pipelines.errors import UserError
from pipelines.models.tiny import SPECIAL_TOKENS, build_tiny_model, describe_model

PROTOCOL_TURN = ("Let me zoom in.\n<code>\n```python\ncrop = image_clue_0.crop((10, 20, 110, 120))\n"
                 "plt.imshow(crop)\nplt.show()\n```\n</code>")


def _processor_and_model(path):
    from transformers import AutoModelForImageTextToText, AutoProcessor

    return AutoProcessor.from_pretrained(path), AutoModelForImageTextToText.from_pretrained(path)


def test_round_trip_generate_on_image_prompt(tiny_model_dir):
    processor, model = _processor_and_model(tiny_model_dir)
    assert type(model).__name__ == "Qwen2_5_VLForConditionalGeneration"
    image = Image.new("RGB", (300, 200), (200, 30, 30))
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Colour?"}]}]
    text = processor.apply_chat_template(messages, add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n")
    assert text.endswith("<|im_start|>assistant\n")
    inputs = processor(text=[text], images=[image], return_tensors="pt")
    grid = inputs["image_grid_thw"][0]
    expected_pads = int(grid.prod()) // 4  # 2x2 spatial merge
    assert int((inputs["input_ids"] == model.config.image_token_id).sum()) == expected_pads
    out = model.generate(**inputs, max_new_tokens=5, do_sample=False)
    assert out.shape == (1, inputs["input_ids"].shape[1] + 5) or out.shape[1] < inputs["input_ids"].shape[1] + 5
    assert isinstance(processor.batch_decode(out)[0], str)


def test_special_tokens_and_config_ids_agree(tiny_model_dir):
    processor, model = _processor_and_model(tiny_model_dir)
    tok = processor.tokenizer
    ids = {t: tok.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    assert len(set(ids.values())) == len(SPECIAL_TOKENS)
    cfg = model.config
    assert cfg.image_token_id == ids["<|image_pad|>"] and cfg.video_token_id == ids["<|video_pad|>"]
    assert cfg.vision_start_token_id == ids["<|vision_start|>"]
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    assert ids["<|im_end|>"] in model.generation_config.eos_token_id


@pytest.mark.parametrize("text", [
    PROTOCOL_TURN,
    "<interpreter>\nText Result:\n137 42\nImage Result:\n</interpreter>",
    "<answer>\n\\boxed{\\frac{1}{2}}\n</answer> ünïcödé 🙂 \t tabs  and  spaces",
])
def test_tokenizer_round_trips_bytes_exactly(tiny_model_dir, text):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert tok.decode(ids) == text
    assert tok.unk_token_id is None or tok.unk_token_id not in ids


def test_digits_are_single_tokens(tiny_model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    assert len(tok("1234", add_special_tokens=False)["input_ids"]) == 4


def test_build_is_deterministic(tmp_path):
    a = build_tiny_model(tmp_path / "a", "nano", seed=3)
    b = build_tiny_model(tmp_path / "b", "nano", seed=3)
    c = build_tiny_model(tmp_path / "c", "nano", seed=4)
    assert (a / "tokenizer.json").read_bytes() == (b / "tokenizer.json").read_bytes()
    wa, wb, wc = (load_file(p / "model.safetensors") for p in (a, b, c))
    assert wa.keys() == wb.keys()
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    assert any(not torch.equal(wa[k], wc[k]) for k in wa)


def test_refuses_to_overwrite(tmp_path):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "x").write_text("keep")
    with pytest.raises(UserError, match="exists and is not empty"):
        build_tiny_model(tmp_path / "m", "nano")
    assert (tmp_path / "m" / "x").read_text() == "keep"


def test_llamafactory_template_matches_chat_template(tiny_model_dir):
    """SFT data rendered by LLaMA-Factory and prompts rendered by the agent loop agree exactly."""
    from llamafactory.data import get_template_and_fix_tokenizer
    from llamafactory.hparams import DataArguments

    processor, _ = _processor_and_model(tiny_model_dir)
    tok = processor.tokenizer
    image = Image.new("RGB", (120, 90), (10, 200, 10))
    lf_messages = [
        {"role": "user", "content": "<image>What colour is it?"},
        {"role": "assistant", "content": PROTOCOL_TURN},
        {"role": "user", "content": "<interpreter>\nText Result:\nNone\n</interpreter>"},
        {"role": "assistant", "content": "<answer>\n\\boxed{green}\n</answer>"},
    ]
    template = get_template_and_fix_tokenizer(tok, DataArguments(template="qwen2_vl"))
    mm = template.mm_plugin.process_messages(lf_messages, [image], [], [], processor)
    lf_ids = [i for prompt, answer in template.encode_multiturn(tok, mm) for i in prompt + answer]
    hf_messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What colour is it?"}]}]
    hf_messages += [{"role": m["role"], "content": [{"type": "text", "text": m["content"]}]}
                    for m in lf_messages[1:]]
    text = processor.apply_chat_template(hf_messages)
    hf_ids = processor(text=[text], images=[image])["input_ids"][0]
    assert lf_ids == list(hf_ids)


def test_verl_loads_tokenizer_and_processor(tiny_model_dir):
    from verl.utils import hf_processor, hf_tokenizer

    assert hf_tokenizer(str(tiny_model_dir)).eos_token == "<|im_end|>"
    assert type(hf_processor(str(tiny_model_dir))).__name__ == "Qwen2_5_VLProcessor"


def test_describe_and_cli(tmp_path):
    from pyvision_cli.model import app

    result = CliRunner().invoke(app, ["tiny", str(tmp_path / "m"), "--size", "nano", "--json"])
    assert result.exit_code == 0, result.output
    info = json.loads(result.stdout)
    assert 100_000 < info["parameters"] < 2_000_000 and info["vision_parameters"] > 0
    assert info == {**describe_model(tmp_path / "m"), "size": "nano", "seed": 0,
                    "arch": "qwen2_5_vl", "seconds": info["seconds"]}
    again = CliRunner().invoke(app, ["tiny", str(tmp_path / "m"), "--size", "nano"])
    assert again.exit_code == 2 and "--force" in again.output


@pytest.mark.slow
def test_small_size_budget(tmp_path):
    import time

    path = build_tiny_model(tmp_path / "small", "small")
    info = describe_model(path)
    assert 2_000_000 < info["parameters"] < 10_000_000
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(path)
    ids = torch.randint(10, info["vocab_size"] - 10, (1, 1024))
    start = time.monotonic()
    model(input_ids=ids, labels=ids).loss.backward()
    assert time.monotonic() - start < 10  # fwd+bwd of 1024 tokens; ~0.5 s on 2 cores


def test_unknown_architecture_is_refused_before_any_work(tmp_path):
    from pipelines.errors import UserError
    from pipelines.models.tiny import build_tiny_model

    with pytest.raises(UserError, match="unknown tiny model architecture 'llava'"):
        build_tiny_model(tmp_path / "m", arch="llava")  # type: ignore[arg-type]
    assert not (tmp_path / "m").exists()
