"""One notion of "right": for every benchmark, the RL reward and the evaluation give the same
verdict on the same answers, with the recipe's tolerances (not the defaults) in both."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks import BENCHMARKS, get_benchmark
from pipelines.config.recipe import load_recipe
from pipelines.eval.judging import scoring_for
from pipelines.scoring import benchmark_for_task
from pipelines.scoring.reward import compute_reward
from tests.benchmarks.test_benchmarks import (  # noqa: F401 - the fixture is used
    loaded,
    make_synth_dir,
)

WRONG = ["Z", "(B)", "0", "the answer is 7", "", None, "12.5", "five"]


def _answers(bench, task) -> list[str | None]:
    gold = bench.gold_prediction(task)
    near = []
    try:  # numbers just inside and just outside the tolerances
        value = float(gold)
        near = [f"{value * 1.004:g}", f"{value * 1.05:g}", f"{value * 1.3:g}", f"{value * 2:g}"]
    except ValueError:
        pass
    return [gold, f"<answer>\n\\boxed{{{gold}}}\n</answer>", *near, *WRONG]


def _verdicts(name: str, tasks, recipe) -> list[tuple[bool, bool]]:
    scoring = scoring_for(name, None, None, recipe.reward)
    out = []
    for task in tasks:
        for answer in _answers(scoring.bench, task):
            reward = compute_reward(task, answer, answer_chars=len(answer or ""),
                                    successful_tool_calls=1, well_formed=answer is not None,
                                    cfg=recipe.reward)
            if answer is None:
                assert not reward.correct
                continue
            scores, _ = scoring.score(task, answer)
            value = scoring.bench.sample_score(task, scores)
            out.append((reward.correct, value >= scoring.bench.correct_threshold(task)))
    return out


@pytest.mark.parametrize("tolerances", [[], ["reward.number_rel_tol=0.1",
                                             "reward.mra_threshold=0.8"]])
def test_reward_and_eval_agree_on_every_benchmark(loaded, tmp_path: Path,  # noqa: F811
                                                 tolerances) -> None:
    recipe = load_recipe(None, ["reward.judge.base_url=null", *tolerances])
    synth = make_synth_dir(tmp_path / "synth")
    tasks = {name: loaded[name][0] for name in loaded}
    tasks["synth-image"] = get_benchmark("synth-image").load(data_dir=synth)
    tasks["synth-video"] = get_benchmark("synth-video").load(data_dir=synth)
    checked = 0
    for name in BENCHMARKS:
        if not tasks.get(name):
            continue
        assert all(benchmark_for_task(t) == name for t in tasks[name]), name
        pairs = _verdicts(name, tasks[name], recipe)
        assert pairs and all(r == e for r, e in pairs), (name, pairs)
        assert any(r for r, _ in pairs) and not all(r for r, _ in pairs), name
        checked += 1
    assert checked >= 6


def test_the_recipe_tolerance_reaches_evaluation(tmp_path: Path) -> None:
    # The bug this file guards: eval used the default 1% number tolerance whatever the recipe
    # said, while the reward used the recipe's. A count answered 5% off is right at 10%.
    task = get_benchmark("synth-image").load(data_dir=make_synth_dir(tmp_path))[1]
    assert task.answer == "4"
    for tol, right in (("0.01", False), ("0.1", True)):
        recipe = load_recipe(None, [f"reward.number_rel_tol={tol}", "reward.judge.base_url=null"])
        scoring = scoring_for("synth-image", None, None, recipe.reward)
        assert scoring.score(task, "4.2")[0]["accuracy"] == float(right)
        assert compute_reward(task, "4.2", answer_chars=3, successful_tool_calls=0,
                              well_formed=True, cfg=recipe.reward).correct is right
