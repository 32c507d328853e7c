"""SFT on LLaMA-Factory: rendered YAML snapshots, a real run, resume, failures, LoRA merge."""

from __future__ import annotations

import json
import os
import stat
import sys
from pathlib import Path

import pytest
import torch
import yaml

from pipelines.config.recipe import RECIPES_DIR, load_recipe
from pipelines.errors import SubprocessFailed
from pipelines.rundir import stage_dir
from pipelines.sft import llamafactory as lf
from pipelines.sft.stage import run_sft
from pipelines.store import Store
from tests.helpers import make_sharegpt

SNAPSHOTS = Path(__file__).parent / "snapshots" / "sft"


@pytest.mark.parametrize("recipe_path", sorted(RECIPES_DIR.glob("*.yaml")), ids=lambda p: p.stem)
def test_rendered_yaml_matches_snapshot(recipe_path, tmp_path):
    recipe = load_recipe(recipe_path)
    lf.write_train_files(recipe.sft, tmp_path, model_path="MODEL", dataset_dir="DATA",
                         dataset="pyvision_sft")
    text = (tmp_path / lf.TRAIN_YAML).read_text().replace(str(tmp_path), "RUN_DIR")
    snap = SNAPSHOTS / f"{recipe_path.stem}.yaml"
    if os.environ.get("PYVISION_UPDATE_SNAPSHOTS") == "1":
        snap.parent.mkdir(parents=True, exist_ok=True)
        snap.write_text(text)
    assert snap.is_file(), f"missing snapshot {snap}; run with PYVISION_UPDATE_SNAPSHOTS=1"
    assert text == snap.read_text()
    rendered = yaml.safe_load(text)
    assert rendered["template"] == recipe.sft.template and rendered["stage"] == "sft"
    assert rendered["freeze_vision_tower"] is recipe.sft.freeze_vision_tower
    if recipe.sft.deepspeed != "none":
        ds = json.loads((tmp_path / f"ds_{recipe.sft.deepspeed}.json").read_text())
        assert ds["zero_optimization"]["stage"] in (2, 3)


def test_lora_and_resume_render():
    recipe = load_recipe(None, ["sft.finetuning_type=lora", "sft.lora.rank=4"])
    cfg = lf.render_train_config(recipe.sft, model_path="m", dataset_dir="d", dataset="x",
                                 output_dir="o", resume=True)
    assert cfg["finetuning_type"] == "lora" and cfg["lora_rank"] == 4
    assert cfg["overwrite_output_dir"] is False  # lets LLaMA-Factory find checkpoint-N
    assert lf.render_train_config(recipe.sft, model_path="m", dataset_dir="d", dataset="x",
                                  output_dir="o")["overwrite_output_dir"] is True


def _tiny_sft_recipe(*extra: str):
    return load_recipe(None, ["sft.use_cpu=true", "sft.precision=fp32", "sft.cutoff_len=1024",
                              "sft.per_device_train_batch_size=2", "sft.learning_rate=1e-3",
                              "sft.image_max_pixels=12544", "sft.logging_steps=1", *extra])


def test_real_llamafactory_run_on_nano(tiny_model_dir, tmp_path):
    data_dir, name = make_sharegpt(tmp_path / "data")
    recipe = _tiny_sft_recipe("sft.max_steps=3", "sft.save_steps=2",
                              "sft.freeze_multi_modal_projector=true")
    store = Store()
    sd = stage_dir(recipe, "sft", "t1", runs_dir=tmp_path / "runs", store=store)
    sd.begin()
    summary = run_sft(recipe, sd, model=str(tiny_model_dir), dataset_dir=data_dir, dataset=name,
                      show_progress=False)
    assert summary["steps"] == 3 and summary["first_loss"] is not None
    assert sd.is_complete()
    out = sd.path / "output"
    assert (out / "config.json").is_file() and (out / "checkpoint-2").is_dir()
    steps = [m["step"] for m in store.metrics("t1", "sft", names=["loss"])]
    assert steps == [1, 2, 3]
    # The trained model and its processor load and generate.
    from transformers import AutoModelForImageTextToText, AutoProcessor

    AutoProcessor.from_pretrained(out)
    model = AutoModelForImageTextToText.from_pretrained(out)
    assert sum(p.numel() for p in model.parameters()) > 0
    # Frozen vision tower and projector come out unchanged; the language model trained.
    base = AutoModelForImageTextToText.from_pretrained(tiny_model_dir).state_dict()
    trained = model.state_dict()
    visual = [k for k in trained if ".visual." in f".{k}"]
    assert any(".merger." in k for k in visual)
    assert all(torch.equal(trained[k], base[k]) for k in visual)
    assert not torch.equal(trained["model.language_model.layers.0.mlp.up_proj.weight"],
                           base["model.language_model.layers.0.mlp.up_proj.weight"])


def test_relative_model_and_dataset_paths_reach_llamafactory_absolute(tiny_model_dir, tmp_path,
                                                                       monkeypatch):
    # LLaMA-Factory runs in the stage's folder: a relative `--model runs/x/base-model` there
    # named nothing, and was read as a malformed hub id.
    from pipelines.sft.stage import resolve_sft_inputs

    make_sharegpt(tmp_path / "work" / "data")
    (tmp_path / "work" / "base").symlink_to(tiny_model_dir)
    monkeypatch.chdir(tmp_path / "work")
    recipe = _tiny_sft_recipe()
    sd = stage_dir(recipe, "sft", "rel", runs_dir=tmp_path / "runs", store=None)
    model, ds_dir, name = resolve_sft_inputs(recipe, sd, model="base", dataset_dir="data",
                                             dataset="pyvision_sft")
    assert model == str(tiny_model_dir.resolve())
    assert ds_dir == str((tmp_path / "work" / "data").resolve()) and name == "pyvision_sft"
    # A hub id stays a hub id.
    hub, _, _ = resolve_sft_inputs(recipe, sd, model="Qwen/Qwen2.5-VL-7B-Instruct",
                                   dataset_dir="data", dataset="pyvision_sft")
    assert hub == "Qwen/Qwen2.5-VL-7B-Instruct"


def test_dry_run_writes_the_yaml_of_an_unbegun_stage_but_never_rewrites_a_begun_one(
        tiny_model_dir, tmp_path):
    # The YAML of a begun (or finished) stage is what its model was trained with, and its
    # manifest points at it: a dry run (here with another learning rate) overwrote it.
    from typer.testing import CliRunner

    from pyvision_cli.main import app

    data_dir, name = make_sharegpt(tmp_path / "data")
    args = ["sft", "--run-id", "r", "--model", str(tiny_model_dir), "--dataset-dir", data_dir,
            "--dataset", name, "--store", str(tmp_path / "s.duckdb"), "--dry-run",
            "--set", f"runs_dir={tmp_path / 'runs'}"]
    first = CliRunner().invoke(app, args)
    assert first.exit_code == 0, first.output
    yaml_path = tmp_path / "runs" / "r" / "sft" / lf.TRAIN_YAML
    assert yaml.safe_load(yaml_path.read_text())["model_name_or_path"] == str(tiny_model_dir)
    stage_dir(load_recipe(None, [f"runs_dir={tmp_path / 'runs'}"]), "sft", "r",
              runs_dir=None).begin()
    lf.write_train_files(load_recipe(None).sft, yaml_path.parent, model_path=str(tiny_model_dir),
                         dataset_dir=data_dir, dataset=name)
    before = yaml_path.read_bytes()
    again = CliRunner().invoke(app, [*args, "--set", "sft.learning_rate=0.5"])
    assert again.exit_code == 2
    assert "has begun: a dry run would rewrite its llamafactory_train.yaml" in again.output
    assert yaml_path.read_bytes() == before


def _fake_python(tmp_path: Path, code: int) -> str:
    script = tmp_path / "fake-python"
    script.write_text("#!/bin/sh\nfor i in $(seq 1 40); do echo \"log line $i\"; done\n"
                      "echo 'ValueError: something LLaMA-Factory did not like' >&2\n"
                      f"exit {code}\n")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return str(script)


def test_failing_run_shows_tail_and_log_path(tmp_path, capsys):
    data_dir, name = make_sharegpt(tmp_path / "data", n=2)
    recipe = _tiny_sft_recipe(f"sft.python={_fake_python(tmp_path, 3)}")
    sd = stage_dir(recipe, "sft", "bad", runs_dir=tmp_path / "runs")
    sd.begin()
    with pytest.raises(SubprocessFailed) as exc:
        run_sft(recipe, sd, model="m", dataset_dir=data_dir, dataset=name, show_progress=False)
    log = sd.path / lf.LOG_FILE
    assert str(log) in str(exc.value) and "exit code 3" in str(exc.value)
    assert "log line 40" in log.read_text() and "log line 1\n" in log.read_text()
    stderr = capsys.readouterr().err
    assert "ValueError: something LLaMA-Factory did not like" in stderr
    assert "log line 40" in stderr and "log line 1\n" not in stderr  # only the tail
    assert not sd.is_complete()


def test_llamafactory_runs_as_its_cli_module_without_importing_wandb(tmp_path):
    """The engine starts as ``python -m llamafactory.cli COMMAND CONFIG`` would (its module as
    ``__main__``, the same arguments), but wandb, installed here, reads as absent in it."""
    import importlib.util

    assert importlib.util.find_spec("wandb") is not None  # installed: the check could fail
    fake = tmp_path / "pkgs" / "llamafactory"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("")
    (fake / "cli.py").write_text(
        "import importlib.util, json, sys\n"
        "print(json.dumps({'name': __name__, 'args': sys.argv[1:],"
        " 'wandb': importlib.util.find_spec('wandb') is not None}))\n")
    config = tmp_path / "train.yaml"
    config.write_text("{}\n")
    log = tmp_path / "lf.log"
    lf.run_llamafactory("train", config, python=sys.executable, log_path=log,
                        env={"PYTHONPATH": str(fake.parent)})
    seen = json.loads(log.read_text().strip().splitlines()[-1])
    assert seen == {"name": "__main__", "args": ["train", str(config)], "wandb": False}


def test_missing_interpreter_is_a_user_error(tmp_path):
    from pipelines.errors import UserError

    data_dir, name = make_sharegpt(tmp_path / "data", n=2)
    recipe = _tiny_sft_recipe("sft.python=/nonexistent/python")
    sd = stage_dir(recipe, "sft", "bad", runs_dir=tmp_path / "runs")
    sd.begin()
    with pytest.raises(UserError, match="set sft.python"):
        run_sft(recipe, sd, model="m", dataset_dir=data_dir, dataset=name, show_progress=False)


@pytest.mark.slow
def test_resume_continues_from_last_checkpoint(tiny_model_dir, tmp_path):
    data_dir, name = make_sharegpt(tmp_path / "data")
    store = Store()
    first = _tiny_sft_recipe("sft.max_steps=2", "sft.save_steps=2")
    sd = stage_dir(first, "sft", "r", runs_dir=tmp_path / "runs", store=store)
    sd.begin()
    run_sft(first, sd, model=str(tiny_model_dir), dataset_dir=data_dir, dataset=name,
            show_progress=False)
    # A longer schedule on the same stage directory picks up checkpoint-2.
    second = _tiny_sft_recipe("sft.max_steps=4", "sft.save_steps=2")
    sd.config = second
    summary = run_sft(second, sd, model=str(tiny_model_dir), dataset_dir=data_dir, dataset=name,
                      resume=True, show_progress=False)
    assert summary["steps"] == 4
    assert "Resuming training from" in (sd.path / lf.LOG_FILE).read_text()
    steps = [m["step"] for m in store.metrics("r", "sft", names=["loss"])]
    assert steps == [1, 2, 3, 4], "resumed steps are logged once"


@pytest.mark.slow
def test_resume_continues_from_the_checkpoint_weights(tiny_model_dir, tmp_path):
    # Resumed from its last checkpoint (as after a Ctrl-C between that checkpoint and the
    # manifest): the model it finishes with is the trained one. The Trainer's own reload of the
    # checkpoint matched no tensor name, so the resumed run went on from the base weights.
    from safetensors.torch import load_file

    data_dir, name = make_sharegpt(tmp_path / "data")
    recipe = _tiny_sft_recipe("sft.max_steps=2", "sft.save_steps=2")
    sd = stage_dir(recipe, "sft", "r", runs_dir=tmp_path / "runs")
    sd.begin()
    run_sft(recipe, sd, model=str(tiny_model_dir), dataset_dir=data_dir, dataset=name,
            show_progress=False)
    trained = load_file(sd.path / "output" / "checkpoint-2" / "model.safetensors")
    base = load_file(tiny_model_dir / "model.safetensors")
    assert any(not trained[k].equal(base[k]) for k in trained)
    run_sft(recipe, sd, model=str(tiny_model_dir), dataset_dir=data_dir, dataset=name,
            resume=True, show_progress=False)
    resumed = load_file(sd.path / "output" / "model.safetensors")
    assert resumed.keys() == trained.keys()
    assert all(resumed[k].equal(trained[k]) for k in trained), "resumed from the base weights"
    assert sd.manifest().outputs.base_model == str(tiny_model_dir)


def test_an_interrupted_engine_leaves_its_shutdown_lines_in_the_log(tmp_path):
    # Ctrl-C (or SIGTERM) while an engine runs: it is terminated, and what it prints on its way
    # out reaches the log before the log is closed (the reader used to be left writing to a
    # closed file, and those lines were lost).
    import threading
    import time

    from pipelines.sft.llamafactory import run_streaming

    follow = tmp_path / "progress.jsonl"
    script = (f"trap 'sleep 0.2; echo engine shutting down; exit 143' TERM; "
              f"echo started; echo '{{\"step\": 1}}' > {follow}; "
              "while true; do sleep 0.05; done")
    failures: list[BaseException] = []
    hook = threading.excepthook
    threading.excepthook = lambda args: failures.append(args.exc_value)

    def interrupt(entry):
        raise KeyboardInterrupt

    try:
        with pytest.raises(KeyboardInterrupt):
            run_streaming(["sh", "-c", script], name="engine", cwd=tmp_path,
                          log_path=tmp_path / "engine.log", follow=follow, on_log=interrupt,
                          on_line=lambda line: time.sleep(0.3),  # a reader a little behind
                          poll_s=0.05, missing_hint="-", failure_hint="-")
        time.sleep(1.0)  # a reader left behind would fail now, on the closed log
    finally:
        threading.excepthook = hook
    log = (tmp_path / "engine.log").read_text()
    assert "started" in log and "engine shutting down" in log, log
    assert failures == []
