"""Run directories describe themselves; a finished stage is skipped unless forced."""

from __future__ import annotations

import json
import os
import re

import pytest
import yaml
from pydantic import ValidationError
from typer.testing import CliRunner

from pipelines.config.recipe import load_recipe
from pipelines.errors import ConfigChanged, ManifestError, UserError
from pipelines.manifest import OUTPUTS, DataOutputs, RLOutputs
from pipelines.rundir import check_run_id, stage_dir
from pipelines.store import Store
from pyvision_cli.main import app

SFT_OUTPUTS = {"base_model": "m", "train_yaml": "sft/train.yaml", "log": "sft/log",
               "model": "sft/output"}


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
    outputs = {"rl_tasks": ["data/rl"], "heldout": {}, "base_model": "m"}
    sd.finish(outputs, {"n": 3})
    assert sd.is_complete() and sd.manifest().to_json()["outputs"] == outputs
    assert store.stages("tiny-cpu")[0]["status"] == "done"


def test_rerun_with_other_config_is_refused_and_force_redoes(tmp_path):
    sd = stage_dir(load_recipe(), "sft", "exp1", runs_dir=tmp_path)
    sd.begin()
    (sd.path / "leftover.txt").write_text("x")
    sd.finish(SFT_OUTPUTS)
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
    del stored["rl"]["val_tasks"]  # as written by a pyvision that did not have the field
    (sd.path / "config.yaml").write_text(yaml.safe_dump(stored))
    stage_dir(recipe, "rl", "old", runs_dir=tmp_path).check_same_config()
    changed = load_recipe(None, ["rl.val_tasks=[data/vstar]"])
    with pytest.raises(UserError, match=r"rl\.val_tasks"):
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
    sd.finish({"model": "rl/model", "checkpoints": "rl/checkpoints", "base_model": "m"})
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


# -- manifests: typed outputs, validated both ways ----------------------------------------------

# What each stage's writer puts in its manifest, as run folders written before the typed outputs
# hold them: the same keys in the same order must come back.
WRITTEN = [
    ("data", {"rl_tasks": ["d/rl/image-search"], "heldout": {"synth-image": "d/h"},
              "datasets": {"vstar": "d/vstar"}, "base_model": "d/base-model",
              "sft_dataset_dir": "d/llamafactory", "sft_dataset_name": "pyvision_sft"}),
    ("data", {"rl_tasks": [], "heldout": {}, "base_model": "Qwen/Qwen2.5-VL-7B-Instruct"}),
    ("sft", {"base_model": "m", "train_yaml": "s/train.yaml", "log": "s/log", "adapter": "s/output",
             "model": "s/merged"}),
    ("rl", {"adapter": "r/adapter", "checkpoints": "r/checkpoints", "base_model": "m"}),
    ("rl", {"checkpoints": "r/c", "checkpoint": "r/c/global_step_3/actor", "base_model": "m",
            "launch_script": "r/launch.sh", "log": "r/verl.log", "metrics": "r/metrics.jsonl",
            "train_data": "r/train.parquet", "val_data": None}),
    ("merge", {"model": "m/model"}),
    ("eval", {"models": {"base": "b", "sft": "s", "rl": "r"}}),
    ("report", {"png:reward": "p/reward.png", "json": "p/report.json", "html": "p/report.html"}),
    ("pretrain", {"model": "p/model"}),
]


@pytest.mark.parametrize("stage, outputs", WRITTEN)
def test_manifest_outputs_keep_their_keys_and_order(tmp_path, stage, outputs):
    sd = stage_dir(load_recipe(), stage, "r", runs_dir=tmp_path)
    sd.begin()
    sd.finish(outputs, {"n": 1})
    raw = json.loads(sd.manifest_path.read_text())
    assert list(raw["outputs"].items()) == list(outputs.items())
    assert sd.manifest().to_json() == raw
    assert sd.outputs_of(OUTPUTS[stage]) == sd.manifest().outputs


def test_outputs_of_the_wrong_shape_write_no_manifest(tmp_path):
    sd = stage_dir(load_recipe(), "merge", "r", runs_dir=tmp_path)
    sd.begin()
    with pytest.raises(ValidationError):
        sd.finish({"model": 3})
    with pytest.raises(ValidationError):
        sd.finish({"model": "m", "extra": "x"})
    assert not sd.is_complete()
    assert sd.outputs_of(RLOutputs) is None  # a stage that has not finished has no outputs


@pytest.mark.parametrize("text, problem", [
    ('{"run_id": "r"', r"manifest\.json:1: malformed JSON \(Expecting ',' delimiter at column 15\)"),
    ("[]", r"manifest\.json is not a data stage manifest \(not a JSON object\)"),
    (json.dumps({"run_id": "r", "stage": "data", "finished_at": "t", "summary": {},
                 "outputs": {"rl_tasks": "d/rl", "heldout": {}, "base_model": "m"}}),
     r"manifest\.json is not a data stage manifest \(outputs\.rl_tasks: Input should be a "
     + r"valid list\)"),
])
def test_a_malformed_manifest_is_one_line_naming_the_file(tmp_path, monkeypatch, text, problem):
    monkeypatch.chdir(tmp_path)
    data = tmp_path / "runs" / "r" / "data"
    data.mkdir(parents=True)
    (data / "manifest.json").write_text(text)
    with pytest.raises(ManifestError, match=problem):
        stage_dir(load_recipe(), "sft", "r", runs_dir=None).outputs_of(DataOutputs)
    # The SFT stage reads its inputs from that manifest: one line, exit 2, nothing written.
    result = CliRunner().invoke(app, ["sft", "--run-id", "r"])
    assert result.exit_code == 2, result.output
    (line,) = result.output.strip().splitlines()
    assert re.fullmatch(rf"error: {re.escape(str(data))}/{problem}\. Fix: redo the data stage "
                        r"with --force\.", line), line
    assert not (tmp_path / "runs" / "r" / "sft").exists()


# -- the lifecycle every stage runs through: finished() to skip, running() to attempt ------------


@pytest.mark.parametrize("failure", [RuntimeError("engine crashed"), KeyboardInterrupt()])
def test_a_stage_that_raises_leaves_no_manifest_and_records_the_failure(tmp_path, failure):
    store = Store(tmp_path / "s.duckdb")
    sd = stage_dir(load_recipe(), "sft", "exp", runs_dir=tmp_path / "runs", store=store)
    with pytest.raises(type(failure)), sd.running():
        (sd.path / "output").mkdir()
        raise failure
    assert not sd.is_complete() and sd.finished() is None
    (row,) = store.stages("exp")
    assert row["status"] == "failed" and row["summary"] == {"error": str(failure)}
    # The next attempt continues in the same folder (its checkpoints are kept) and can finish.
    with sd.running():
        assert (sd.path / "output").is_dir()
        sd.finish(SFT_OUTPUTS, {"steps": 3})
    assert store.stages("exp")[0]["status"] == "done"


def _interrupt_done(monkeypatch, store, times: int) -> list[str]:
    """Make the store's first ``times`` updates to "done" raise KeyboardInterrupt (Ctrl-C
    between writing the manifest and updating the store); returns the statuses asked for."""
    real, asked = store.set_stage, []

    def set_stage(run_id, stage, status, **kw):
        asked.append(status)
        if status == "done" and asked.count("done") <= times:
            raise KeyboardInterrupt
        return real(run_id, stage, status, **kw)

    monkeypatch.setattr(store, "set_stage", set_stage)
    return asked


def test_ctrl_c_after_the_manifest_does_not_mark_a_finished_stage_failed(tmp_path, monkeypatch):
    # It left a complete manifest (the stage is skipped from then on) and the store saying
    # "failed" for ever.
    store = Store(tmp_path / "s.duckdb")
    sd = stage_dir(load_recipe(), "sft", "exp", runs_dir=tmp_path / "runs", store=store)
    asked = _interrupt_done(monkeypatch, store, times=1)
    with pytest.raises(KeyboardInterrupt), sd.running():
        sd.finish(SFT_OUTPUTS, {"steps": 3})
    assert "failed" not in asked and sd.is_complete()
    (row,) = store.stages("exp")
    assert row["status"] == "done" and row["summary"] == {"steps": 3}
    assert sd.finished().summary == {"steps": 3}  # skipped, nothing lost


def test_a_store_left_behind_its_manifest_is_marked_done_by_the_next_command(tmp_path,
                                                                             monkeypatch):
    # Both updates interrupted (or a crash, or the old code's "failed"): the next command that
    # asks whether the stage finished makes the store agree with the manifest.
    store = Store(tmp_path / "s.duckdb")
    sd = stage_dir(load_recipe(), "sft", "exp", runs_dir=tmp_path / "runs", store=store)
    _interrupt_done(monkeypatch, store, times=2)
    with pytest.raises(KeyboardInterrupt), sd.running():
        sd.finish(SFT_OUTPUTS, {"steps": 3})
    assert store.stages("exp")[0]["status"] == "running"
    monkeypatch.undo()
    again = stage_dir(load_recipe(), "sft", "exp", runs_dir=tmp_path / "runs", store=store)
    assert again.finished().summary == {"steps": 3}
    (row,) = store.stages("exp")
    assert row["status"] == "done" and row["summary"] == {"steps": 3}
    assert row["run_dir"] == str(sd.path)
    store.set_stage("exp", "sft", "failed", summary={"error": ""})
    assert again.finished() is not None and store.stages("exp")[0]["status"] == "done"
    other = Store(tmp_path / "other.duckdb")  # a store that never saw the run is left alone
    assert stage_dir(load_recipe(), "sft", "exp", runs_dir=tmp_path / "runs",
                     store=other).finished() is not None
    assert other.stages("exp") == []


def test_a_stage_being_rerun_keeps_its_store_row_while_another_command_asks(tmp_path):
    # A forced rerun keeps the old manifest until it finishes; a second command asking meanwhile
    # must not mark the running attempt done.
    store = Store(tmp_path / "s.duckdb")
    sd = stage_dir(load_recipe(), "sft", "exp", runs_dir=tmp_path / "runs", store=store)
    with sd.running():
        sd.finish(SFT_OUTPUTS, {"steps": 3})
    with sd.running(force=True, resume=True):
        assert sd.is_complete() and store.stages("exp")[0]["status"] == "running"
        other = stage_dir(load_recipe(), "sft", "exp", runs_dir=tmp_path / "runs", store=store)
        assert other.finished() is not None
        assert store.stages("exp")[0]["status"] == "running"
        sd.finish(SFT_OUTPUTS, {"steps": 4})
    assert sd.finished().summary == {"steps": 4} and store.stages("exp")[0]["status"] == "done"


def test_a_finished_stage_is_skipped_unless_redone(tmp_path):
    sd = stage_dir(load_recipe(), "sft", "exp", runs_dir=tmp_path)
    assert sd.finished() is None
    with sd.running():
        sd.finish(SFT_OUTPUTS, {"steps": 3})
    again = stage_dir(load_recipe(), "sft", "exp", runs_dir=tmp_path)
    done = again.finished()
    assert done is not None and done.summary == {"steps": 3}
    assert done.outputs.model == SFT_OUTPUTS["model"]
    assert again.finished(redo=True) is None


def test_refuse_unfinished_asks_how_before_writing_anything(tmp_path):
    store = Store(tmp_path / "s.duckdb")
    sd = stage_dir(load_recipe(), "rl", "exp", runs_dir=tmp_path / "runs", store=store)
    sd.begin()
    environment = (sd.path / "environment.json").read_text()
    with pytest.raises(UserError, match="was started before"), sd.running(refuse_unfinished=True):
        pytest.fail("the block must not run")
    assert (sd.path / "environment.json").read_text() == environment
    assert store.stages("exp")[0]["status"] == "running"  # refused, not failed
    with sd.running(resume=True, refuse_unfinished=True):
        pass


def test_a_second_attempt_at_a_running_stage_is_refused_at_once(tmp_path):
    # Two commands on one stage of one run (a second terminal, a second `pyvision run`): the
    # second used to write into the first one's folder, or crash on its half-made outputs with
    # a traceback and mark the first one's stage failed.
    store = Store(tmp_path / "s.duckdb")
    first = stage_dir(load_recipe(), "sft", "exp", runs_dir=tmp_path / "runs", store=store)
    second = stage_dir(load_recipe(), "sft", "exp", runs_dir=tmp_path / "runs", store=store)
    with first.running():
        config = (first.path / "config.yaml").read_text()
        with pytest.raises(UserError) as refused, second.running():
            pytest.fail("the block must not run")
        assert refused.value.message.startswith(
            f"sft of run 'exp' is being run by process {os.getpid()} (")
        assert "--run-id NEW" in refused.value.one_line()
        assert (first.path / "config.yaml").read_text() == config
        assert store.stages("exp")[0]["status"] == "running"  # the first one's, not failed
        first.finish(SFT_OUTPUTS, {})
    assert store.stages("exp")[0]["status"] == "done"
    with second.running(force=True):  # once the first is done, the next attempt goes ahead
        second.finish(SFT_OUTPUTS, {})
