"""Loading a model folder (``pipelines.core.modeldir.load_vlm``): what transformers refuses is one
line naming the folder and the reason, for every command that loads a policy."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from pipelines.core.modeldir import load_vlm
from pipelines.errors import UserError


def _copy_with(tiny_model_dir: Path, dest: Path, change) -> Path:
    shutil.copytree(tiny_model_dir, dest)
    config = json.loads((dest / "config.json").read_text())
    change(config)
    (dest / "config.json").write_text(json.dumps(config))
    return dest


def test_a_loadable_folder_gives_the_model_and_its_processor(tiny_model_dir):
    model, processor = load_vlm(tiny_model_dir, dtype=torch.float32)
    assert model.config.model_type == "qwen2_5_vl" and processor.tokenizer is not None


@pytest.mark.parametrize("change, reason", [
    (lambda c: c.update(model_type="llama"), "Unrecognized configuration class"),
    (lambda c: c["text_config"].update(vocab_size="big"),
     "field 'vocab_size': TypeError: Field 'vocab_size' expected int, got str"),
])
def test_what_transformers_refuses_is_one_line(tiny_model_dir, tmp_path, change, reason):
    folder = _copy_with(tiny_model_dir, tmp_path / "m", change)
    with pytest.raises(UserError) as refused:
        load_vlm(folder, dtype=torch.float32, what="the policy", hint="pass another")
    assert refused.value.message.startswith(f"cannot load the policy '{folder}': ")
    assert reason in refused.value.message and "\n" not in refused.value.one_line()
    assert refused.value.hint == "pass another"
