"""pyvision merge: LoRA through LLaMA-Factory export, verl FSDP checkpoints through its merger."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import yaml

from pipelines.config.recipe import load_recipe
from pipelines.core.modeldir import verify_model_dir
from pipelines.errors import SubprocessFailed, UserError
from pipelines.merge import merge_verl
from pipelines.rundir import stage_dir
from pipelines.sft import lora as lora_mod
from pipelines.sft.lora import adapter_template, merge_lora
from pipelines.sft.stage import run_sft
from tests.helpers import make_sharegpt


def _fsdp_checkpoint(model_dir, root):
    """A verl FSDP actor checkpoint with world size 1, laid out as verl's checkpoint manager does."""
    from transformers import AutoModelForImageTextToText

    actor = root / "global_step_3" / "actor"
    (actor / "huggingface").mkdir(parents=True)
    model = AutoModelForImageTextToText.from_pretrained(model_dir)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01)  # a "trained" model differs from the base
    torch.save(model.state_dict(), actor / "model_world_size_1_rank_0.pt")
    (actor / "fsdp_config.json").write_text(json.dumps({"FSDP_version": 2, "world_size": 1}))
    for f in model_dir.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, actor / "huggingface" / f.name)
    return model


def test_verify_rejects_incomplete_model(tiny_model_dir, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(tiny_model_dir, broken)
    from safetensors.torch import load_file, save_file

    weights = load_file(broken / "model.safetensors")
    weights.pop(min(weights))
    save_file(weights, broken / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(UserError, match="weights do not match the model config"):
        verify_model_dir(broken)
    assert verify_model_dir(tiny_model_dir)["full_load"] is True


def test_merge_verl_checkpoint_round_trip(tiny_model_dir, tmp_path):
    trained = _fsdp_checkpoint(tiny_model_dir, tmp_path / "ckpts")
    out = tmp_path / "merged"
    info = merge_verl(tmp_path / "ckpts", out)  # finds the latest global_step_N/actor
    assert info["full_load"] and (out / "merge.log").is_file()
    from transformers import AutoModelForImageTextToText

    merged = AutoModelForImageTextToText.from_pretrained(out)
    ref = trained.state_dict()
    for name, tensor in merged.state_dict().items():
        # verl's merger stores bfloat16, as a real FSDP run would; compare at that precision.
        assert tensor.dtype == torch.bfloat16
        torch.testing.assert_close(tensor.float(), ref[name], rtol=1e-2, atol=1e-3)
    with pytest.raises(UserError, match="exists and is not empty"):
        merge_verl(tmp_path / "ckpts", out)


def test_merge_verl_bad_checkpoint(tmp_path):
    with pytest.raises(UserError, match="holds no verl FSDP checkpoint"):
        merge_verl(tmp_path, tmp_path / "out")
    bad = tmp_path / "global_step_1" / "actor"
    bad.mkdir(parents=True)
    (bad / "fsdp_config.json").write_text(json.dumps({"world_size": 1}))
    with pytest.raises(SubprocessFailed, match="verl.model_merger exited"):
        merge_verl(tmp_path, tmp_path / "out2")
    assert not (tmp_path / "out2").exists()


@pytest.mark.slow
def test_lora_train_then_merge_round_trip(tiny_model_dir, tmp_path):
    data_dir, name = make_sharegpt(tmp_path / "data")
    recipe = load_recipe(None, ["sft.use_cpu=true", "sft.precision=fp32", "sft.cutoff_len=1024",
                                "sft.per_device_train_batch_size=2", "sft.learning_rate=5e-2",
                                "sft.image_max_pixels=12544", "sft.max_steps=2",
                                "sft.finetuning_type=lora", "sft.lora.rank=4"])
    sd = stage_dir(recipe, "sft", "lora", runs_dir=tmp_path / "runs")
    sd.begin()
    run_sft(recipe, sd, model=str(tiny_model_dir), dataset_dir=data_dir, dataset=name,
            show_progress=False)
    adapter = sd.path / "output"
    assert (adapter / "adapter_config.json").is_file()
    out = tmp_path / "merged"
    info = merge_lora(adapter, tiny_model_dir, out)
    assert info["full_load"]
    from peft import PeftModel
    from transformers import AutoModelForImageTextToText

    base = AutoModelForImageTextToText.from_pretrained(tiny_model_dir)
    peft_model = PeftModel.from_pretrained(base, adapter).eval()
    merged = AutoModelForImageTextToText.from_pretrained(out).eval()
    ids = torch.randint(20, 500, (1, 32))
    with torch.no_grad():
        expected = peft_model(input_ids=ids).logits
        got = merged(input_ids=ids).logits
        plain = AutoModelForImageTextToText.from_pretrained(tiny_model_dir)(input_ids=ids).logits
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    assert not torch.allclose(got, plain, atol=1e-4), "the adapter changed nothing"


def test_merge_verl_lora_checkpoint_merges_the_adapter(tiny_model_dir, tmp_path):
    """With rl.lora verl's FSDP state dict holds peft's base and adapter weights; verl's merger
    writes the adapter apart (``lora_adapter/``) and the merge folds it into the base."""
    from transformers import AutoModelForImageTextToText

    from pipelines.rl.local import attach_lora, load_policy_model

    recipe = load_recipe(None, ("rl.lora.rank=4", "rl.lora.alpha=8"))
    model, _ = load_policy_model(recipe, str(tiny_model_dir))
    peft_model = attach_lora(model, recipe.rl.lora)
    with torch.no_grad():
        for n, p in peft_model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.5)  # a trained adapter
    actor = tmp_path / "ckpts" / "global_step_2" / "actor"
    (actor / "huggingface").mkdir(parents=True)
    torch.save(peft_model.state_dict(), actor / "model_world_size_1_rank_0.pt")
    (actor / "fsdp_config.json").write_text(json.dumps({"FSDP_version": 2, "world_size": 1}))
    # What verl's FSDP checkpoint manager writes beside a LoRA actor.
    (actor / "lora_train_meta.json").write_text(json.dumps({"r": 4, "lora_alpha": 8}))
    for f in tiny_model_dir.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, actor / "huggingface" / f.name)
    name = "model.language_model.layers.0.self_attn.q_proj"
    layer = peft_model.get_submodule(f"base_model.model.{name}")
    want = layer.base_layer.weight + 2.0 * layer.lora_B.default.weight @ layer.lora_A.default.weight
    base = layer.base_layer.weight.detach().clone()

    out = tmp_path / "merged"
    info = merge_verl(tmp_path / "ckpts", out)
    assert info["full_load"] and (out / "lora_adapter" / "adapter_config.json").is_file()
    merged = AutoModelForImageTextToText.from_pretrained(out, dtype=torch.float32)
    got = merged.get_submodule(name).weight
    torch.testing.assert_close(got, want.detach(), rtol=2e-2, atol=2e-2)
    assert (got - base).abs().max() > 0.1  # the adapter is in, not dropped


def test_merge_stage_folds_a_local_lora_rl_adapter_into_its_base(tiny_model_dir, tmp_path):
    """A run whose local RL trained a LoRA adapter (``rl.lora``): its merge stage writes one plain
    model whose weights are the base's with ``alpha / rank * B @ A`` added to each adapted layer
    (the vision tower untouched), that computes what the base with the adapter computes, and
    that the eval stage then evaluates as the run's RL model."""
    from PIL import Image
    from transformers import AutoModelForImageTextToText

    from pipelines.rl.local import attach_lora, load_policy_model, save_adapter
    from pipelines.run import models_to_evaluate, run_pipeline
    from pipelines.store import Store

    recipe = load_recipe(None, ("rl.engine=local", "rl.lora.rank=4", "rl.lora.alpha=8",
                                f"runs_dir={tmp_path / 'runs'}"))
    model, processor = load_policy_model(recipe, str(tiny_model_dir))
    peft_model = attach_lora(model, recipe.rl.lora).eval()
    with torch.no_grad():
        for n, p in peft_model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.5)  # a trained adapter
    store = Store()
    rl = stage_dir(recipe, "rl", "lora-rl", runs_dir=None, store=store)
    rl.begin()
    save_adapter(peft_model, processor, rl.path / "adapter", str(tiny_model_dir), recipe.rl.lora)
    # The outputs the local engine's rl stage records with rl.lora (pipelines/rl/local.py).
    rl.finish({"adapter": str(rl.path / "adapter"), "checkpoints": str(rl.path / "checkpoints"),
               "base_model": str(tiny_model_dir)})

    summary = run_pipeline(recipe, store=store, run_id="lora-rl", from_stage="merge",
                           until_stage="merge", show_progress=False)
    final = rl.run_path / "merge" / "model"
    assert summary["merge"]["status"] == "done" and summary["merge"]["model"] == str(final)
    merge = stage_dir(recipe, "merge", "lora-rl", runs_dir=None)
    assert models_to_evaluate(merge)["rl"] == str(final)

    scale = recipe.rl.lora.alpha / recipe.rl.lora.rank
    adapted = {f"{name}.weight": m.base_layer.weight + scale * m.lora_B.default.weight
               @ m.lora_A.default.weight
               for name, m in peft_model.base_model.model.named_modules() if hasattr(m, "lora_A")}
    assert adapted and not any("visual" in k for k in adapted)
    base = AutoModelForImageTextToText.from_pretrained(tiny_model_dir).state_dict()
    merged = AutoModelForImageTextToText.from_pretrained(final, dtype=torch.float32).eval()
    weights = merged.state_dict()
    assert set(weights) == set(base)
    for key, tensor in weights.items():
        torch.testing.assert_close(tensor, adapted.get(key, base[key]).detach(),
                                   msg=lambda m, key=key: f"{key}: {m}")

    text = processor.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Colour?"}]},
         {"role": "assistant", "content": "It is red."}], tokenize=False)
    enc = processor(text=[text], images=[Image.new("RGB", (224, 168), (200, 60, 40))],
                    return_tensors="pt")
    with torch.no_grad():
        got = merged(**enc).logits
        want = peft_model(**enc).logits
        with peft_model.disable_adapter():
            plain = peft_model(**enc).logits
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert (got - plain).abs().max() > 1e-2  # the adapter is in the merged model


def _adapter(folder, weights: bool = True):
    from safetensors.torch import save_file

    folder.mkdir(parents=True)
    (folder / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4}))
    if weights:
        save_file({"lora_A.weight": torch.zeros(4, 8)}, str(folder / "adapter_model.safetensors"))
    return folder


def test_merge_lora_takes_the_template_its_sft_run_trained_with(tiny_model_dir, tmp_path,
                                                               monkeypatch):
    """The export gets the adapter's own run's template, not a Qwen2.5-VL default: a Qwen3-VL
    adapter exported with qwen2_vl would merge cleanly and be served the wrong prompt format."""
    adapter = _adapter(tmp_path / "run" / "sft" / "output")
    (adapter.parent / "llamafactory_train.yaml").write_text(
        "### model\nmodel_name_or_path: Qwen/Qwen3-VL-8B-Instruct\ntemplate: qwen3_vl_nothink\n")
    exported = []

    def fake_export(command, cfg_path, **kwargs):
        exported.append(yaml.safe_load(cfg_path.read_text()))
        raise UserError("export stopped by the test")

    monkeypatch.setattr(lora_mod.lf, "run_llamafactory", fake_export)
    with pytest.raises(UserError, match="stopped by the test"):
        merge_lora(adapter, tiny_model_dir, tmp_path / "merged")
    assert exported[-1]["template"] == "qwen3_vl_nothink"
    with pytest.raises(UserError, match="stopped by the test"):
        merge_lora(adapter, tiny_model_dir, tmp_path / "merged", template="qwen2_vl")
    assert exported[-1]["template"] == "qwen2_vl"  # --template wins
    assert not (tmp_path / "merged").exists()  # nothing half-written


def test_adapter_template_falls_back_to_the_base_and_asks_when_it_cannot_tell(tiny_model_dir,
                                                                             tmp_path):
    adapter = _adapter(tmp_path / "loose-adapter")
    assert adapter_template(adapter, tiny_model_dir) == "qwen2_vl"  # a Qwen2.5-VL base
    assert adapter_template(adapter, "Qwen/Qwen2.5-VL-7B-Instruct") == "qwen2_vl"
    qwen3 = tmp_path / "qwen3-base"
    qwen3.mkdir()
    (qwen3 / "config.json").write_text(json.dumps({"model_type": "qwen3_vl"}))
    with pytest.raises(UserError, match="cannot tell which chat template") as info:
        adapter_template(adapter, qwen3)
    assert "--template" in info.value.hint and "qwen3_vl_nothink" in info.value.hint
    with pytest.raises(UserError, match="cannot tell"):
        adapter_template(adapter, "Qwen/Qwen3-VL-8B-Instruct")
    broken = tmp_path / "broken-base"
    broken.mkdir()
    (broken / "config.json").write_text('{"model_type": "qwen2_5_vl",\n')
    with pytest.raises(UserError, match=r"broken-base/config\.json:2: malformed JSON"):
        adapter_template(adapter, broken)
    (adapter / "training_args.yaml").write_text("template: [unclosed\n")
    with pytest.raises(UserError, match="training_args.yaml is not valid YAML"):
        adapter_template(adapter, qwen3)
    (adapter / "training_args.yaml").write_bytes(b"template: caf\xe9\n")
    with pytest.raises(UserError, match=r"training_args\.yaml:1: not UTF-8 text"):
        adapter_template(adapter, qwen3)


def _base(folder):
    """A base folder as far as merge checks it before LLaMA-Factory: config and weights."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({"model_type": "qwen2_5_vl"}))
    save_file({"w": torch.zeros(2)}, str(folder / "model.safetensors"))
    return folder


def test_an_adapter_without_sound_weights_or_a_broken_base_is_refused_before_llamafactory(
        tmp_path, monkeypatch):
    monkeypatch.setattr(lora_mod.lf, "run_llamafactory",
                        lambda *a, **k: pytest.fail("LLaMA-Factory ran on a broken input"))
    base = _base(tmp_path / "base")
    bare = _adapter(tmp_path / "bare", weights=False)
    with pytest.raises(UserError, match=r"bare has no adapter weights"):
        merge_lora(bare, base, tmp_path / "merged", template="qwen2_vl")
    torn = _adapter(tmp_path / "torn")
    data = (torn / "adapter_model.safetensors").read_bytes()
    (torn / "adapter_model.safetensors").write_bytes(data[:-7])
    with pytest.raises(UserError, match=r"torn: adapter_model\.safetensors is truncated"):
        merge_lora(torn, base, tmp_path / "merged", template="qwen2_vl")
    (base / "tokenizer.json").write_text('{"model": ')
    with pytest.raises(UserError, match=r"base/tokenizer\.json:1: malformed JSON"):
        merge_lora(_adapter(tmp_path / "lora"), base, tmp_path / "merged", template="qwen2_vl")
    assert not (tmp_path / "merged").exists()


@pytest.mark.parametrize("config,match", [
    ('{"peft_type": "LORA", "r": ', r"adapter_config\.json:1: malformed JSON"),
    ('["LORA"]', r"adapter_config\.json is not a JSON object"),
    ('{"r": 4}', r"adapter_config\.json has no 'peft_type'"),
    ('{"peft_type": "LORA"}', r"adapter_config\.json has no 'r'"),
    ('{"peft_type": "IA3", "r": 4}', r"peft_type is 'IA3', not 'LORA'"),
    ('{"peft_type": "LORA", "r": 0}', r"the rank r is 0, not a positive integer"),
])
def test_a_broken_adapter_config_is_one_error_before_llamafactory_runs(tmp_path, monkeypatch,
                                                                       config, match):
    adapter = tmp_path / "lora"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(config)
    monkeypatch.setattr(lora_mod.lf, "run_llamafactory",
                        lambda *a, **k: pytest.fail("LLaMA-Factory ran on a broken adapter"))
    with pytest.raises(UserError, match=match) as caught:
        merge_lora(adapter, _base(tmp_path / "base"), tmp_path / "merged", template="qwen2_vl")
    assert str(adapter / "adapter_config.json") in str(caught.value)
    assert not (tmp_path / "merged").exists()


def test_a_failed_export_keeps_its_log_beside_out_and_gives_a_merge_hint(tmp_path, monkeypatch):
    """The log named in the error exists after the failure (not in the removed temp folder), and
    the hint is a merge's (LLaMA-Factory's training hint suggests --resume, which merge lacks)."""
    from pipelines.sft.llamafactory import run_streaming

    def failing_export(command, cfg_path, *, python, log_path, **kwargs):
        run_streaming(["sh", "-c", "echo adapter shapes do not match; exit 3"], name="export",
                      cwd=cfg_path.parent, log_path=log_path, missing_hint="-",
                      failure_hint="add --resume")

    monkeypatch.setattr(lora_mod.lf, "run_llamafactory", failing_export)
    out = tmp_path / "merged"
    with pytest.raises(SubprocessFailed) as caught:
        merge_lora(_adapter(tmp_path / "lora"), _base(tmp_path / "base"), out,
                   template="qwen2_vl")
    kept = tmp_path / "merged.merge-failed.log"
    assert f"log: {kept}" in str(caught.value) and "--resume" not in str(caught.value)
    assert "adapter shapes do not match" in kept.read_text()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["base", "lora", "merged.merge-failed.log"]


def test_merge_lora_gives_llamafactory_absolute_paths(tmp_path, monkeypatch):
    """LLaMA-Factory runs in the output's temp folder: relative --lora/--base/--out given on the
    command line must reach it as absolute paths."""
    _adapter(tmp_path / "lora")
    _base(tmp_path / "base")
    seen = []

    def fake_export(command, cfg_path, **kwargs):
        seen.append((cfg_path, yaml.safe_load(cfg_path.read_text())))
        raise UserError("export stopped by the test")

    monkeypatch.setattr(lora_mod.lf, "run_llamafactory", fake_export)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UserError, match="stopped by the test"):
        merge_lora("lora", "base", "merged", template="qwen2_vl")
    cfg_path, export = seen[0]
    assert cfg_path.is_absolute()
    for key in ("model_name_or_path", "adapter_name_or_path", "export_dir"):
        assert export[key].startswith("/"), (key, export[key])
    assert export["adapter_name_or_path"] == str(tmp_path / "lora")


def test_a_saved_processor_is_found_under_either_file_name(tmp_path, tiny_model_dir):
    # transformers 5 writes processor_config.json (the project's own models and LoRA adapters),
    # hub checkpoints preprocessor_config.json; the merge and the verl export read both.
    from pipelines.core.modeldir import has_processor

    assert has_processor(tiny_model_dir)
    old = tmp_path / "old"
    old.mkdir()
    assert not has_processor(old)
    (old / "preprocessor_config.json").write_text("{}")
    assert has_processor(old)
