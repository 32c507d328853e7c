"""lmms-eval interoperability, offline: the `pyvision_agent` plugin on a local task.

The local task is written by the test in lmms-eval's own YAML form (`dataset_path: json` with
`data_files`, found through `include_path`) and reuses lmms-eval's V* prompt and scoring
functions, so what runs is lmms-eval's evaluator, its task machinery and its scorer, with our agent
loop as the model.
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
from pipelines.eval.lmms import lmms_command, parse_results
from pipelines.store import Store
from tests.benchmarks.test_benchmarks import vstar_rows
from tests.helpers import REPO

TASK = "pyvision_vstar_local"
FAST = ["agent.max_new_tokens_per_turn=8", "agent.max_turns_eval=2",
        "agent.image_max_pixels=12544"]

TASK_YAML = f"""\
task: {TASK}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {{rows}}
test_split: test
output_type: generate_until
doc_to_visual: !function pyvision_local_utils.doc_to_visual
doc_to_text: !function pyvision_local_utils.vstar_doc_to_text
doc_to_target: label
generation_kwargs:
  max_new_tokens: 16
  temperature: 0
process_results: !function pyvision_local_utils.vstar_process_results
metric_list:
  - metric: vstar_overall_acc
    aggregation: !function pyvision_local_utils.vstar_aggregate_results
    higher_is_better: true
lmms_eval_specific_kwargs:
  default:
    pre_prompt: ""
    post_prompt: "\\nAnswer with the option's letter from the given choices directly."
metadata:
  - version: 0.0
"""

TASK_UTILS = """\
from PIL import Image

from lmms_eval.tasks.vstar_bench.utils import (  # noqa: F401 - the task YAML names them
    vstar_aggregate_results, vstar_doc_to_text, vstar_process_results)


def doc_to_visual(doc):
    return [Image.open(doc["image_path"]).convert("RGB")]
"""


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Three V* rows (gold A, C, B) with images on disk, and the task YAML that reads them."""
    from PIL import Image

    root = tmp_path_factory.mktemp("lmms-task")
    rows = vstar_rows()[:3]
    for i, row in enumerate(rows):
        path = root / f"img{i}.png"
        Image.new("RGB", (40 + 8 * i, 30), (60 * i, 120, 80)).save(path)
        row["image_path"] = str(path)
    (root / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (root / f"{TASK}.yaml").write_text(TASK_YAML.format(rows=root / "rows.jsonl"))
    (root / "pyvision_local_utils.py").write_text(TASK_UTILS)
    return root


def test_entry_point_is_what_lmms_eval_reads() -> None:
    import tomllib
    from importlib.metadata import entry_points

    from lmms_eval.models import MODEL_REGISTRY_V2, get_model

    from pipelines.eval.lmms_model import PyVisionAgent

    declared = tomllib.loads((REPO / "pyproject.toml").read_text())
    group = declared["project"]["entry-points"]["lmms_eval.models"]
    assert group == {"pyvision_agent": "pipelines.eval.lmms_plugin:MANIFEST"}
    # The installed (editable) metadata carries the same entry point, in the group lmms-eval
    # 0.7.3 scans (ModelRegistryV2.load_entrypoint_manifests(group="lmms_eval.models")).
    (ep,) = [e for e in entry_points(group="lmms_eval.models") if e.name == "pyvision_agent"]
    assert ep.value == group["pyvision_agent"]
    assert get_model("pyvision_agent") is PyVisionAgent
    assert MODEL_REGISTRY_V2.resolve("pyvision").model_id == "pyvision_agent"
    assert MODEL_REGISTRY_V2.resolve("pyvision_agent").model_type == "simple"


def test_lmms_command_passes_batch_size_once_and_the_recipe(tmp_path: Path) -> None:
    argv = lmms_command("/m/tiny", ["vstar", "mytask"], tmp_path, limit=3, batch_size=4,
                        include_path="/tasks", recipe_file="/r/recipe.yaml")
    model_args = argv[argv.index("--model_args") + 1]
    assert model_args == "pretrained=/m/tiny,recipe=/r/recipe.yaml"
    assert "batch_size" not in model_args  # lmms-eval passes --batch_size to the constructor
    assert argv[argv.index("--batch_size") + 1] == "4"
    assert argv[argv.index("--tasks") + 1] == "vstar_bench,mytask"
    assert argv[argv.index("--include_path") + 1] == "/tasks"
    with pytest.raises(UserError, match="contains ',' or '='"):
        lmms_command("/m/a,b", ["vstar"], tmp_path)


def test_parse_results_fractions_counts_versions(tmp_path: Path) -> None:
    old = tmp_path / "m" / "20200101_results.json"
    old.parent.mkdir()
    old.write_text(json.dumps({"results": {"vstar_bench": {"vstar_overall_acc,none": 10.0}}}))
    new = tmp_path / "m" / "20300101_results.json"
    new.write_text(json.dumps({
        "results": {"vstar_bench": {"alias": "vstar_bench", "vstar_overall_acc,none": 62.5,
                                    "vstar_overall_acc_stderr,none": "N/A",
                                    "vstar_direct_attributes_acc,none": []},
                    "hrbench4k": {"average,none": 0.5, "single,none": 0.75, "cross,none": 0.25}},
        "n-samples": {"vstar_bench": {"original": 191, "effective": 8},
                      "hrbench4k": {"original": 800, "effective": 4}},
        "versions": {"vstar_bench": 0.0, "hrbench4k": "Yaml"}, "lmms_eval_version": "0.7.3"}))
    import os

    os.utime(old, (1, 1))
    results, counts, versions = parse_results(tmp_path)
    assert results == {"vstar_bench": {"vstar_overall_acc": 0.625},  # lmms-eval's V* is in %
                       "hrbench4k": {"average": 0.5, "single": 0.75, "cross": 0.25}}
    assert counts == {"vstar_bench": 8, "hrbench4k": 4}
    assert versions["vstar_bench"] == "lmms-eval 0.7.3/vstar_bench v0.0"  # the installed one
    with pytest.raises(UserError, match="wrote no results JSON"):
        parse_results(tmp_path, newer_than=new.stat().st_mtime + 10)


def test_simple_evaluate_runs_our_agent_loop(tiny_model_dir: Path, task_dir: Path,
                                             tmp_path: Path) -> None:
    from lmms_eval.evaluator import simple_evaluate
    from lmms_eval.tasks import TaskManager

    from pipelines.eval.lmms_model import PyVisionAgent

    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(load_recipe(None, FAST).model_dump(mode="json")))
    agent = PyVisionAgent(pretrained=str(tiny_model_dir), recipe=str(recipe), batch_size=3)
    assert agent.recipe.agent.max_new_tokens_per_turn == 8 and agent.policy.name == "hf"
    manager = TaskManager(include_path=str(task_dir), include_defaults=False)

    def evaluate() -> dict:
        return simple_evaluate(model=agent, tasks=[TASK], task_manager=manager,
                               bootstrap_iters=0, log_samples=True)

    out = evaluate()
    assert out["results"][TASK]["vstar_overall_acc,none"] == 0.0  # untrained: no answer
    assert len(agent.trajectories) == 3
    for traj in agent.trajectories:
        assert traj["prompt_version"] == "image@v1" and traj["visual_tokens"] > 0
        text = "".join(p.get("text", "") for p in traj["prompt"])
        assert "Answer with the option's letter from the given choices directly." in text

    # The same evaluator, now with answers: lmms-eval scores what our loop's \boxed{} holds.
    agent.policy = ScriptedPolicy(["<answer>\n\\boxed{A}\n</answer>"])
    out = evaluate()
    assert out["results"][TASK]["vstar_overall_acc,none"] == pytest.approx(100 / 3)  # gold A,C,B
    assert [s["filtered_resps"] for s in out["samples"][TASK]] in (
        [["A"], ["A"], ["A"]], ["A", "A", "A"])


@pytest.mark.slow  # ~30 s on 2 busy cores, nearly all of it lmms-eval's own start-up
def test_cli_harness_lmms_eval_stores_its_results(tiny_model_dir: Path, task_dir: Path,
                                                  tmp_path: Path) -> None:
    from pyvision_cli.eval import app

    args = ["--harness", "lmms-eval", "--model", str(tiny_model_dir), "--benchmarks", TASK,
            "--include-path", str(task_dir), "--limit", "2", "--run-id", "lm",
            "--model-tag", "nano", "--json", "--set", f"runs_dir={tmp_path / 'runs'}"]
    result = CliRunner().invoke(app, args + [a for s in FAST for a in ("--set", s)])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["results"] == {TASK: {"vstar_overall_acc": 0.0}}
    store = Store()
    assert [r["run_id"] for r in store.runs()] == ["lm"]
    (agg,) = store.eval_aggregates(["lm"])
    assert (agg["benchmark"], agg["metric"], agg["value"], agg["n"], agg["scorer"]) == (
        TASK, "vstar_overall_acc", 0.0, 2, "lmms-eval")
    assert agg["benchmark_version"] == f"lmms-eval 0.7.3/{TASK} vYaml"
    out = tmp_path / "runs" / "lm" / "lmms-eval" / "nano"
    # The plugin ran with the resolved recipe (--set reached the agent inside lmms-eval).
    assert load_recipe(out / "recipe.yaml").agent.max_new_tokens_per_turn == 8
    samples = [json.loads(line) for p in out.rglob(f"*_samples_{TASK}.jsonl")
               for line in p.read_text().splitlines()]
    assert [s["doc_id"] for s in samples] == [0, 1]


def test_cli_harness_failure_is_exit_2_and_writes_nothing(monkeypatch, tmp_path: Path,
                                                          tiny_model_dir) -> None:
    """lmms-eval logs an unknown task and still exits 0: no fresh results JSON is a failure."""
    import subprocess

    from pyvision_cli.eval import app

    def fake_lmms_eval(argv, stdout, **kwargs):
        assert argv[1:3] == ["-m", "lmms_eval"]
        stdout.write("Traceback (most recent call last):\n  ...\n"
                     "ValueError: Tasks not found: no_such_task. Try `lmms-eval --tasks list`\n"
                     "\x1b[32m2026-11-26 15:02:55\x1b[0m | \x1b[1mERROR\x1b[0m | Error during "
                     "evaluation\n")
        return subprocess.CompletedProcess(argv, 0)

    monkeypatch.setattr(subprocess, "run", fake_lmms_eval)
    result = CliRunner().invoke(app, ["--harness", "lmms-eval", "--model", str(tiny_model_dir),
                                      "--benchmarks", "no_such_task",
                                      "--set", f"runs_dir={tmp_path / 'runs'}"])
    assert result.exit_code == 2, result.output
    (line,) = [x for x in result.output.splitlines() if x.startswith("error:")]
    assert "lmms-eval wrote no results (ValueError: Tasks not found: no_such_task." in line
    # Its log's tail is shown without lmms-eval's colour codes.
    assert "2026-11-26 15:02:55 | ERROR | Error during evaluation" in result.output
    assert "\x1b[" not in result.output
    store = Store()
    assert store.runs() == [] and store.eval_aggregates() == []
