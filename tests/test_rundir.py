"""Run directories describe themselves; a finished stage is skipped unless forced."""

from __future__ import annotations

import json

import pytest
import yaml

from pipelines.config.recipe import load_recipe
from pipelines.errors import ConfigChanged, UserError
from pipelines.rundir import check_run_id, stage_dir
from pipelines.store import Store


def test_stage_lifecycle_writes_config_env_and_manifest_last(tmp_path):
    recipe = load_recipe()
    store = Store(tmp_path / "s.duckdb")
    sd = stage_dir(recipe, "data", None, runs_dir=tmp_path / "runs", store=store)
    assert sd.run_id == "tiny-cpu" and not sd.is_complete()
    sd.begin()
    assert (sd.path / "config.yaml").is_file() and (sd.path / "environment.json").is_file()
    assert not sd.is_complete()
    assert store.stages("tiny-cpu")[0]["status"] == "running"
    env = json.loads((sd.path / "environment.json").read_text())
    assert env["packages"]["duckdb"] and "git_sha" in env and env["python"].startswith("3.")
    saved = yaml.safe_load((sd.path / "config.yaml").read_text())
    assert saved["rl"]["n"] == recipe.rl.n and saved["name"] == "tiny-cpu"
    sd.finish({"tasks": "data/tasks.jsonl"}, {"n": 3})
    assert sd.is_complete() and sd.manifest()["outputs"] == {"tasks": "data/tasks.jsonl"}
    assert store.stages("tiny-cpu")[0]["status"] == "done"


def test_rerun_with_other_config_is_refused_and_force_redoes(tmp_path):
    sd = stage_dir(load_recipe(), "sft", "exp1", runs_dir=tmp_path)
    sd.begin()
    (sd.path / "leftover.txt").write_text("x")
    sd.finish({})
    other = stage_dir(load_recipe(None, ["sft.learning_rate=0.5"]), "sft", "exp1", runs_dir=tmp_path)
    assert other.is_complete()
    with pytest.raises(UserError, match=r"sft\.learning_rate changed.*--force"):
        other.begin()
    other.begin(force=True)
    assert not other.is_complete() and not (other.path / "leftover.txt").exists()
    assert yaml.safe_load((other.path / "config.yaml").read_text())["sft"]["learning_rate"] == 0.5


def test_same_config_resumes(tmp_path):
    sd = stage_dir(load_recipe(), "rl", "exp", runs_dir=tmp_path)
    sd.begin()
    (sd.path / "checkpoint").mkdir()
    again = stage_dir(load_recipe(), "rl", "exp", runs_dir=tmp_path)
    again.begin()  # an interrupted stage with the same config continues in place
    assert (again.path / "checkpoint").is_dir()


@pytest.mark.parametrize("bad", ["", "../x", "a/b", "-x", "x" * 200, "a b"])
def test_run_id_validation(bad):
    with pytest.raises(UserError, match="invalid run id"):
        check_run_id(bad)


def test_relative_runs_dir_becomes_absolute(tmp_path, monkeypatch):
    # Stages pass their paths to subprocesses started in other directories (LLaMA-Factory runs in
    # the stage dir), so a relative `runs_dir` (the default, "runs") must not leak through.
    monkeypatch.chdir(tmp_path)
    sd = stage_dir(load_recipe(), "sft", "rel", runs_dir=None)
    assert sd.path.is_absolute()
    assert sd.path == tmp_path / "runs" / "rel" / "sft"


def test_field_added_later_at_its_default_does_not_block_resume(tmp_path):
    recipe = load_recipe()
    sd = stage_dir(recipe, "rl", "old", runs_dir=tmp_path)
    sd.begin()
    stored = yaml.safe_load((sd.path / "config.yaml").read_text())
    del stored["rl"]["verl"]["val_tasks"]  # as written by a pyvision that did not have the field
    (sd.path / "config.yaml").write_text(yaml.safe_dump(stored))
    stage_dir(recipe, "rl", "old", runs_dir=tmp_path).check_same_config()
    changed = load_recipe(None, ["rl.verl.val_tasks=[data/vstar]"])
    with pytest.raises(UserError, match=r"rl\.verl\.val_tasks"):
        stage_dir(changed, "rl", "old", runs_dir=tmp_path).check_same_config()


def test_force_forgets_the_old_attempts_records(tmp_path):
    # A redone stage must not leave its first attempt's per-step metrics behind (they would
    # double every step of the training curves).
    store = Store(tmp_path / "s.duckdb")
    recipe = load_recipe()
    sd = stage_dir(recipe, "rl", "exp", runs_dir=tmp_path / "runs", store=store)
    sd.begin()
    store.log_metrics("exp", "rl", 0, {"reward/mean": 0.1})
    store.log_metrics("exp", "sft", 0, {"loss": 2.0})
    sd.finish({})
    again = stage_dir(recipe, "rl", "exp", runs_dir=tmp_path / "runs", store=store)
    again.begin(force=True)
    assert [(m["stage"], m["name"]) for m in store.metrics("exp")] == [("sft", "loss")]


def test_a_changed_config_is_a_typed_error_that_names_the_keys(tmp_path):
    stage_dir(load_recipe(), "sft", "exp", runs_dir=tmp_path).begin()
    sets = {"sft.learning_rate": 0.5, "sft.max_steps": 7, "sft.save_steps": 9, "rl.prompts_per_step": 3,
            "rl.n": 3, "rl.local.steps": 99}
    changed = load_recipe(None, [f"{k}={v}" for k, v in sets.items()])
    with pytest.raises(ConfigChanged) as refused:
        stage_dir(changed, "sft", "exp", runs_dir=tmp_path).check_same_config()
    assert refused.value.changed == tuple(sorted(sets))
    assert refused.value.shown() == ", ".join(sorted(sets)[:5]) + " ..."
    assert refused.value.message == (f"run 'exp' stage 'sft' was made with a different config "
                                     f"({refused.value.shown()} changed)")
