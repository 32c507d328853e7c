"""Running a stage again: refused without saying how, --force replaces, --resume continues,
--resume --force continues with a new config; an evaluation run id never mixes settings.

All in-process and fast: the CLI cases fail before anything would load a model, and the
evaluation cases use a scripted policy.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from pipelines.agent.policies.scripted import ScriptedPolicy
from pipelines.config.recipe import load_recipe
from pipelines.errors import UserError
from pipelines.eval.runner import run_eval
from pipelines.rundir import stage_dir
from pipelines.store import Store
from pyvision_cli.main import app
from tests.e2e.test_bad_inputs import make_inputs, task_row, write_tasks

runner = CliRunner()


@pytest.fixture
def inp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.chdir(tmp_path)  # runs/ is relative to the recipe's runs_dir
    make_inputs(tmp_path / "in")
    return tmp_path / "in"


def _started(stage: str, run_id: str = "r", steps: int = 3, *sets: str):
    """A stage begun and killed after logging ``steps`` steps of metrics."""
    recipe = load_recipe(None, list(sets))
    sd = stage_dir(recipe, stage, run_id, runs_dir=None, store=Store())
    sd.begin()
    for step in range(steps):
        sd.store.log_metrics(run_id, stage, step, {"loss": float(step)})
    return sd


@pytest.mark.parametrize("stage, args", [
    ("rl", ["--model", "{i}/model-ok", "--tasks", "{i}/tasks"]),
    ("sft", ["--model", "{i}/model-ok", "--dataset-dir", "{i}/sft-data", "--dataset",
             "pyvision_sft"]),
])
def test_a_started_stage_is_not_started_again_silently(inp: Path, stage: str, args: list[str]):
    sd = _started(stage)
    before = sd.store.metrics("r", stage)
    result = runner.invoke(app, [stage, "--run-id", "r", *[a.replace("{i}", str(inp))
                                                          for a in args]])
    assert result.exit_code == 2, result.output
    (line,) = result.output.strip().splitlines()
    assert line.startswith(f"error: {stage} of run 'r' was started before (its folder ")
    assert "metrics up to step 2 in the store" in line
    assert "pass --resume to continue it, --force to start it over" in line
    assert sd.store.metrics("r", stage) == before


@pytest.mark.parametrize("stage, command, outputs", [
    ("data", ["data", "prepare"], {"rl_tasks": [], "heldout": {}, "base_model": "m"}),
    ("sft", ["sft"], {"base_model": "m", "train_yaml": "t", "log": "l", "model": "s"}),
    ("rl", ["rl"], {"model": "r", "checkpoints": "c", "base_model": "m"}),
    ("pretrain", ["model", "pretrain"], {"model": "p"}),
])
def test_a_finished_stage_is_skipped_and_its_manifest_printed(tmp_path: Path, monkeypatch,
                                                               stage: str, command: list[str],
                                                               outputs: dict):
    monkeypatch.chdir(tmp_path)
    sd = stage_dir(load_recipe(), stage, "r", runs_dir=None, store=Store())
    with sd.running():
        sd.finish(outputs, {"n": 1})
    written = sd.manifest_path.read_text()
    result = runner.invoke(app, [*command, "--run-id", "r", "--json"])
    assert result.exit_code == 0, result.output
    assert "of run 'r' already finished" in result.stderr
    assert json.loads(result.stdout) == json.loads(written)
    assert sd.manifest_path.read_text() == written


def test_force_forgets_the_old_attempt_and_resume_keeps_it(tmp_path: Path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    sd = _started("rl")
    (sd.path / "checkpoints").mkdir()
    sd.begin(resume=True)  # same config: continue, keep everything
    assert (sd.path / "checkpoints").is_dir() and sd.store.last_step("r", "rl") == 2
    sd.begin(force=True)  # start over
    assert not (sd.path / "checkpoints").exists() and sd.store.metrics("r", "rl") == []


def test_resume_with_a_changed_config_needs_force_and_then_takes_the_new_one(tmp_path: Path,
                                                                           monkeypatch):
    monkeypatch.chdir(tmp_path)
    _started("rl")
    changed = stage_dir(load_recipe(None, ["rl.local.steps=99"]), "rl", "r", runs_dir=None,
                        store=Store())
    with pytest.raises(UserError) as refused:
        changed.begin(resume=True, config_hint="pass --resume --force to continue from the "
                      "last checkpoint with the new config")
    assert "rl.local.steps changed" in refused.value.message
    assert "--resume --force" in refused.value.one_line()
    changed.begin(resume=True, force=True)
    stored = yaml.safe_load((changed.path / "config.yaml").read_text())
    assert stored["rl"]["local"]["steps"] == 99
    assert changed.store.last_step("r", "rl") == 2  # the engine replaces what follows


def test_cli_names_resume_force_when_the_config_changed(inp: Path):
    _started("rl")
    result = runner.invoke(app, ["rl", "--run-id", "r", "--resume", "--model",
                                 f"{inp}/model-ok", "--tasks", f"{inp}/tasks",
                                 "--set", "rl.local.steps=99"])
    assert result.exit_code == 2
    (line,) = result.output.strip().splitlines()
    assert "rl.local.steps changed" in line and "pass --resume --force to continue" in line


# -- evaluation -----------------------------------------------------------------------------------


def _answer(answer: str = "red") -> ScriptedPolicy:
    return ScriptedPolicy([f"It is.\n<answer>\n\\boxed{{{answer}}}\n</answer>"])


def _eval(data: Path, *sets: str, force: bool = False, answer: str = "red"):
    recipe = load_recipe(None, list(sets))
    register = {"name": recipe.name, "recipe_path": None, "config": recipe.model_dump(mode="json")}
    return run_eval(recipe, model="scripted", model_tag="s", benchmarks=["synth-image"],
                    run_id="ev", store=Store(), data_dirs={"synth-image": data},
                    policy=_answer(answer), show_progress=False, register_run=register,
                    force=force)


def test_eval_rerun_with_other_settings_is_refused_not_mixed(tmp_path: Path):
    data = write_tasks(tmp_path / "tasks", [task_row(0), task_row(1)])
    first = _eval(data, "agent.max_turns_eval=2")
    store = Store()
    assert first["synth-image"]["accuracy"] == 1.0 and store.eval_sample_count("ev") == 2
    for change, shown in (("agent.max_turns_eval=3", "agent.max_turns_eval 2 -> 3"),
                          ("agent.eval_temperature=0.7", "agent.eval_temperature 0.0 -> 0.7")):
        with pytest.raises(UserError, match="holds samples evaluated with other settings") as e:
            _eval(data, "agent.max_turns_eval=2", change, answer="blue")
        assert shown in e.value.message and "--force" in e.value.one_line()
    assert store.run_config("ev")["agent"]["max_turns_eval"] == 2  # not overwritten
    assert {r["prediction"] for r in store.eval_records("ev")} == {"red"}
    # Rollout-only and speed-only settings do not decide an evaluated sample: same run, resumed.
    _eval(data, "agent.max_turns_eval=2", "agent.temperature=0.3")
    _eval(data, "agent.max_turns_eval=2", "agent.draft_tokens=0")
    _eval(data, "agent.max_turns_eval=2", "agent.cpu_threads=2")
    _eval(data, "agent.max_turns_eval=2", "agent.share_prefixes=false")
    # --force: the run's samples are forgotten and made again with the new settings.
    again = _eval(data, "agent.max_turns_eval=3", force=True, answer="blue")
    assert again["synth-image"]["accuracy"] == 0.0
    assert {r["prediction"] for r in store.eval_records("ev")} == {"blue"}
    assert store.eval_sample_count("ev") == 2
    assert store.run_config("ev")["agent"]["max_turns_eval"] == 3


def test_eval_cli_refuses_other_max_turns_before_anything_runs(inp: Path):
    _eval(inp / "tasks", "agent.max_turns_eval=2")
    store = Store()
    before = store.eval_records("ev")
    result = runner.invoke(app, ["eval", "--model", f"{inp}/model-ok", "--benchmarks",
                                 "synth-image", "--data-dir", f"{inp}/tasks", "--run-id", "ev",
                                 "--max-turns", "5"])
    assert result.exit_code == 2
    (line,) = result.output.strip().splitlines()
    assert "run 'ev' holds samples evaluated with other settings (agent.max_turns_eval 2 -> 5)" \
        in line
    assert store.eval_records("ev") == before


def test_eval_tags_a_local_model_by_its_folder_not_by_the_text_typed(inp: Path, monkeypatch):
    # `--model model` typed in two folders named two models by one tag (the second's samples
    # replaced the first's); `model` and `../in/model` typed for one folder were two models.
    import shutil

    import pipelines.eval.runner as runner_module

    tags: list[str] = []
    monkeypatch.setattr(runner_module, "run_eval",
                        lambda *a, **kw: tags.append(kw["model_tag"]) or {})
    for sub in ("a", "b"):
        shutil.copytree(inp / "model-ok", inp / sub / "model")
    base = ["eval", "--benchmarks", "synth-image", "--data-dir", str(inp / "tasks"),
            "--run-id", "tags"]
    for where, typed in (("a", "model"), ("b", "model"), ("b", "../a/model"),
                         ("a", "Qwen/Qwen2.5-VL-7B-Instruct")):
        monkeypatch.chdir(inp / where)
        result = runner.invoke(app, [*base, "--model", typed])
        assert result.exit_code == 0, result.output
    assert tags == [str((inp / "a" / "model").resolve()), str((inp / "b" / "model").resolve()),
                    str((inp / "a" / "model").resolve()), "Qwen/Qwen2.5-VL-7B-Instruct"]
