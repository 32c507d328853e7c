"""`pyvision run` end to end on the embedded recipe at reduced size; stage skipping and ranges."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from pipelines.config.recipe import DEFAULT_RECIPE, load_recipe
from pipelines.errors import UserError
from pipelines.run import run_pipeline
from pipelines.rundir import stage_dir
from pipelines.store import Store

REDUCED = [
    "model.tiny.size=nano", "model.tiny.init=random",
    "data.synth.image_search.n_train=10", "data.synth.image_search.n_heldout=4",
    "data.synth.video.n_train=6", "data.synth.video.n_heldout=3",
    "sft.max_steps=3", "sft.per_device_train_batch_size=2", "sft.save_steps=100",
    "rl.local.steps=1", "rl.prompts_per_step=2", "rl.mini_batch_prompts=2", "rl.n=2",
    "rl.strategy.filter_zero_variance=false", "rl.strategy.filter_broken=false",
    "agent.max_new_tokens_per_turn=16", "agent.max_turns_eval=2",
    "data.copy_drills=1",  # off in the recipe; the reduced run checks that they reach the export
]


def _pyvision(args: list[str]) -> subprocess.CompletedProcess:
    """The real command in a process of its own, as `make demo` runs it: what is checked is what
    reached file descriptors 1 and 2 (an in-process runner reads Python's streams, so it cannot
    see output lost below them, as when fd 2 was left pointing at /dev/null)."""
    return subprocess.run([sys.executable, "-m", "pyvision_cli.main", *args], capture_output=True,
                          text=True, timeout=1200, check=False)


@pytest.mark.slow
def test_embedded_recipe_end_to_end_reduced(tmp_path):
    args = ["run", str(DEFAULT_RECIPE), "--run-id", "ci", "--json",
            "--set", f"runs_dir={tmp_path / 'runs'}", *[arg for s in REDUCED for arg in ("--set", s)]]
    result = _pyvision(args)
    assert result.returncode == 0, result.stderr[-3000:]
    stages = json.loads(result.stdout[result.stdout.index("{"):])["stages"]
    # Every stage's header, then the results, base / sft / rl by benchmark, not only the stage
    # table: printed to the end.
    err = result.stderr
    assert all(f"[{i}/6] {s}" in err for i, s in enumerate(stages, start=1)), err[-3000:]
    tail = err[err.rindex("results (primary metric, %)"):]
    assert all(m in tail for m in ("base", "sft", "rl", "synth-image", "synth-video")), tail
    assert [s for s in stages] == ["data", "sft", "rl", "merge", "eval", "report"]
    assert all(v["status"] == "done" for v in stages.values())
    run = tmp_path / "runs" / "ci"
    assert all((run / s / "manifest.json").is_file() for s in stages)
    # Copy drills join the SFT export (pipelines/data/drills.py).
    data = json.loads((run / "data" / "manifest.json").read_text())["summary"]
    assert data["sft_drill_rows"] > 0
    assert data["sft_rows"] == data["sft_drill_rows"] + data["image-search/sft_tasks"] + \
        data["video/sft_tasks"] - data.get("image-search/trajectories_dropped", 0) - \
        data.get("video/trajectories_dropped", 0)
    store = Store(read_only=True)
    aggs = store.eval_aggregates(["ci"])
    assert {(a["model"], a["benchmark"]) for a in aggs if a["metric"] == "accuracy"} == {
        (m, b) for m in ("base", "sft", "rl") for b in ("synth-image", "synth-video")}
    assert len(store.eval_sample_ids("ci", "rl", "synth-image")) == 4
    names = {m["name"] for m in store.metrics("ci", "rl")}
    assert {"reward/mean", "strategy/kept_groups", "tool_calls/mean", "grad_norm"} <= names
    assert {m["name"] for m in store.metrics("ci", "sft")} >= {"loss"}
    html = (run / "report" / "report.html").read_text()
    assert "synth-image" in html and "data:image/png;base64," in html
    # Everything is done: a second run skips every stage.
    again = _pyvision(args)
    assert again.returncode == 0, again.stderr[-3000:]
    assert all(v["status"] == "skipped" for v in json.loads(
        again.stdout[again.stdout.index("{"):])["stages"].values())


def test_stage_range_validation(tmp_path):
    recipe = load_recipe(None, [f"runs_dir={tmp_path}"])
    with pytest.raises(UserError, match="unknown stage 'sfft'"):
        run_pipeline(recipe, store=Store(), from_stage="sfft")
    with pytest.raises(UserError, match="comes after"):
        run_pipeline(recipe, store=Store(), from_stage="eval", until_stage="sft")


def test_missing_inputs_name_the_stage_to_run(tmp_path):
    recipe = load_recipe(None, [f"runs_dir={tmp_path}"])
    with pytest.raises(UserError, match="data stage"):
        run_pipeline(recipe, store=Store(), run_id="empty", from_stage="sft", until_stage="sft")
    assert not (Path(tmp_path) / "empty" / "sft" / "manifest.json").exists()


@pytest.mark.parametrize(("benchmarks", "message"), [
    ("[synth-image,synth-vide]", r"eval\.benchmarks: unknown benchmark 'synth-vide'.*'synth-video'"),
    ("[]", r"eval\.benchmarks is empty"),
])
def test_eval_benchmarks_are_checked_before_the_first_stage(tmp_path, benchmarks, message):
    """A misspelt or empty eval.benchmarks was found by the eval stage, after data, SFT and RL
    had run (here the SFT stage would stop first, on its missing data stage)."""
    recipe = load_recipe(None, [f"runs_dir={tmp_path}", f"eval.benchmarks={benchmarks}"])
    store = Store()
    with pytest.raises(UserError, match=message):
        run_pipeline(recipe, store=store, run_id="typo", from_stage="sft")
    assert not (tmp_path / "typo").exists() and store.runs() == []


@pytest.mark.parametrize("stage, made_by, outputs", [
    ("sft", "data", {"rl_tasks": [], "heldout": {}, "sft_dataset_dir": "d",
                     "sft_dataset_name": "n", "base_model": "{run}/data/base-model"}),
    ("rl", "data", {"rl_tasks": ["{run}/data/rl"], "heldout": {},
                    "base_model": "{run}/data/base-model"}),
    ("eval", "sft", {"base_model": "m", "train_yaml": "t", "log": "l", "model": "{run}/sft/output"}),
])
def test_a_model_deleted_after_its_stage_finished_names_that_stage(tmp_path, stage, made_by,
                                                                    outputs):
    # The hint used to be "pass a model folder", which `pyvision run` has no option for; the
    # eval stage found it only after evaluating the models before it.
    recipe = load_recipe(None, [f"runs_dir={tmp_path}"])
    done = stage_dir(recipe, made_by, "r", runs_dir=None)
    with done.running():
        done.finish(json.loads(json.dumps(outputs).replace("{run}", str(done.run_path))), {})
    with pytest.raises(UserError) as missing:
        run_pipeline(recipe, store=Store(), run_id="r", from_stage=stage, until_stage=stage,
                     show_progress=False)
    assert missing.value.message.endswith(f" not found: {done.run_path}/{made_by}/"
                                          f"{'base-model' if made_by == 'data' else 'output'}")
    assert missing.value.hint == (f"redo the {made_by} stage that made it: pass --from "
                                  f"{made_by} --force to the run's `pyvision run`")
    assert not (done.run_path / stage).exists()


def test_a_finished_stage_is_skipped_and_its_config_drift_named(tmp_path, capsys):
    sd = stage_dir(load_recipe(None, [f"runs_dir={tmp_path}"]), "merge", "r", runs_dir=None)
    sd.begin()
    sd.finish({"model": str(tmp_path / "model")}, {"model": "m"})
    changed = load_recipe(None, [f"runs_dir={tmp_path}", "rl.local.steps=7"])
    summary = run_pipeline(changed, store=Store(), run_id="r", from_stage="merge",
                           until_stage="merge", show_progress=False)
    assert summary == {"merge": {"status": "skipped", "model": "m"}}
    assert "[1/1] merge: already done, skipped (its config differs in rl.local.steps; pass " \
           "--from merge --force to redo)" in " ".join(capsys.readouterr().err.split())
