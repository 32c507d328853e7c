"""A judge that stops answering in the middle of an evaluation: every sample says which scorer
decided it, the summary and the report count and mark the rule fallbacks, and `pyvision eval
score --run-id` asks the judge again for exactly those samples once it is back.

The judge is a tiny OpenAI-compatible server on loopback (tests/helpers.FakeOpenAI), stopped
after the second sample and started again on the same port.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
from typer.testing import CliRunner

from pipelines.eval.runner import run_eval
from pipelines.report import collect, results_table, to_html, to_markdown
from pipelines.store import Store
from pyvision_cli.eval import app as eval_app
from pyvision_cli.report import app as report_app
from tests.benchmarks.test_benchmarks import make_mathverse_dir
from tests.helpers import FakeOpenAI, chat_completion
from tests.pipelines.eval.test_eval import (  # noqa: F401 - autouse
    _media_cache,
    _recipe,
    _tool_then_answer,
)

runner = CliRunner()
JUDGE_MODEL = "Qwen/Qwen2.5-72B-Instruct"
RESCORE = "pyvision eval score --run-id outage --model-tag s --benchmark mathverse"


@pytest.fixture(scope="module")
def mathverse_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_mathverse_dir(tmp_path_factory.mktemp("benchmarks") / "mathverse")


def _judge(port: int = 0) -> FakeOpenAI:
    """A judge that finds every answer right (the rules find the scripted "A" wrong for all four
    MathVerse fixtures, so each sample's score says which scorer decided it)."""
    return FakeOpenAI(lambda body: (200, chat_completion("Judgement: 1")), port=port)


def _evaluate_with_an_outage(mathverse_dir: Path, capsys: pytest.CaptureFixture
                             ) -> tuple[Store, int, str]:
    store = Store()
    judge = _judge()
    port = judge.httpd.server_address[1]
    recipe = _recipe(f"reward.judge.base_url={judge.url}", "reward.judge.max_retries=0",
                     "reward.judge.backoff_s=0", "reward.judge.timeout_s=5")
    seen: list[str] = []

    def stop_the_judge_after_two(name: str, rec) -> None:
        seen.append(rec.sample_id)
        if len(seen) == 2:
            judge.close()

    try:
        results = run_eval(recipe, model="scripted", model_tag="s", benchmarks=["mathverse"],
                           run_id="outage", store=store,
                           data_dirs={"mathverse": mathverse_dir},
                           policy=_tool_then_answer("print(1)"),
                           on_sample=stop_the_judge_after_two, show_progress=True,
                           register_run={"name": recipe.name, "recipe_path": None,
                                         "config": recipe.model_dump(mode="json")})
    finally:
        judge.close()
    assert len(judge.requests) == 2 and len(seen) == 4
    assert results["mathverse"]["gpt_eval_score"] == 0.5
    return store, port, capsys.readouterr().err


def test_a_judge_outage_is_counted_marked_and_scored_again(mathverse_dir: Path,
                                                           capsys: pytest.CaptureFixture) -> None:
    store, port, stderr = _evaluate_with_an_outage(mathverse_dir, capsys)

    # Per sample: which scorer decided, and a scorer string that says so.
    records = store.eval_records("outage", "s", "mathverse")
    assert Counter(r["scored_by"] for r in records) == {"judge": 2, "rule_fallback": 2}
    scores = store.eval_scores("outage", "s", "mathverse")
    for r in records:
        judged = r["scored_by"] == "judge"
        assert scores[r["sample_id"]]["gpt_eval_score"] == (1.0 if judged else 0.0)
        assert r["scorer"].endswith(f"; judge {JUDGE_MODEL}" if judged else
                                    f"; rule fallback (judge {JUDGE_MODEL} did not answer)")
    aggregate_scorers = {a["scorer"] for a in store.eval_aggregates(["outage"])}
    assert aggregate_scorers == {
        f"{_reference()}; judge {JUDGE_MODEL}; rule fallback for 2 of 4 samples"}

    # The evaluation summary counts them and says how to score them again.
    flat = " ".join(stderr.split())
    assert "over 4 samples (4 new" in flat and "judge 2, rule fallback 2" in flat
    assert "the judge did not answer for 2 of 4 samples" in flat and RESCORE in flat

    # The report counts and marks them in every format.
    data = collect(store, ["outage"])
    assert data.scoring == [{"run": "outage", "model": "s", "benchmark": "mathverse", "n": 4,
                             "judge": 2, "rules": 0, "rule_fallback": 2}]
    assert results_table(data)[1] == [["outage", "s", "50.0*"]]
    markdown, html = to_markdown(data), to_html(data)
    for text in (markdown, html):
        assert "judge did not answer for 2 of 4 samples" in text and RESCORE in text
    assert "| outage | s | mathverse | 4 | 2 | 0 | 2 |" in markdown
    assert '<table class="scoring">' in html
    report = runner.invoke(report_app, ["--format", "json", "--run", "outage"])
    assert report.exit_code == 0, report.output
    assert json.loads(report.stdout)["scoring"] == data.scoring
    table = runner.invoke(report_app, ["--format", "table", "--run", "outage"])
    assert table.exit_code == 0 and "50.0*" in table.output and RESCORE in table.output

    # Re-scoring while the judge is still down changes nothing, and says so.
    down = runner.invoke(eval_app, ["score", "--run-id", "outage", "--benchmark", "mathverse",
                                    "--json"])
    assert down.exit_code == 0, down.output
    assert json.loads(down.stdout)["models"]["s"]["still_fallback"] == 2
    assert "still did not answer" in down.output

    # The judge is back where the run's stored recipe says: only the fallback samples are sent.
    with _judge(port) as judge:
        again = runner.invoke(eval_app, ["score", "--run-id", "outage", "--benchmark", "mathverse",
                                         "--model-tag", "s", "--json"])
    assert again.exit_code == 0, again.output
    result = json.loads(again.stdout)["models"]["s"]
    assert (result["rescored"], result["judged"], result["still_fallback"]) == (2, 2, 0)
    assert result["scored_by"] == {"judge": 4} and result["aggregate"]["gpt_eval_score"] == 1.0
    assert len(judge.requests) == 2
    assert {r["scored_by"] for r in store.eval_records("outage")} == {"judge"}
    assert all(v["gpt_eval_score"] == 1.0 for v in store.eval_scores("outage", "s",
                                                                      "mathverse").values())
    assert {a["scorer"] for a in store.eval_aggregates(["outage"])} == {
        f"{_reference()}; judge {JUDGE_MODEL}"}
    after = collect(store, ["outage"])
    assert results_table(after)[1] == [["outage", "s", "100.0"]]
    assert "did not answer" not in to_markdown(after)


def test_rescoring_refuses_what_it_cannot_do(mathverse_dir: Path,
                                             capsys: pytest.CaptureFixture) -> None:
    _evaluate_with_an_outage(mathverse_dir, capsys)
    cases = [
        (["--run-id", "nope", "--benchmark", "mathverse"], "run 'nope' has no stored samples"),
        (["--run-id", "outage", "--benchmark", "mathverse", "--set",
          "reward.judge.base_url=null"], "reward.judge.base_url is not set"),
        (["--run-id", "outage", "--benchmark", "mathverse", "--predictions", "x.jsonl"],
         "exactly one of --predictions and --run-id"),
        (["--benchmark", "mathverse", "--predictions", "x.jsonl", "--model-tag", "s"],
         "--model-tag only applies with --run-id"),
    ]
    for args, needle in cases:
        result = runner.invoke(eval_app, ["score", *args])
        assert result.exit_code == 2, (args, result.output)
        assert needle in " ".join(result.output.split()), (args, result.output)
        assert "Traceback" not in result.output


def _reference() -> str:
    from benchmarks import get_benchmark

    return get_benchmark("mathverse").reference


class _StubJudge:
    """A Judge whose endpoint is down (None) or says ``verdict``."""

    def __init__(self, verdict: float | None) -> None:
        self.verdict = verdict
        self.asked = 0

    def judge(self, question: str, prediction: str, gold: str, data_source: str) -> float | None:
        self.asked += 1
        return self.verdict


@pytest.mark.parametrize(("prediction", "verdict", "scored_by", "score"), [
    ("B", None, "rules", 0.0),            # the rules read the letter: the judge is not asked
    ("", None, "rules", 0.0),             # nothing to judge
    ("the tall one", 1.0, "judge", 1.0),  # no letter: the judge decides
    ("the tall one", None, "rule_fallback", 0.0),  # ... or would have, but is down
])
def test_hrbench_records_who_decided(prediction: str, verdict: float | None, scored_by: str,
                                     score: float) -> None:
    from benchmarks.hrbench import HRBench4K
    from pipelines.config.reward import RewardConfig
    from pipelines.eval.judging import scoring_for
    from tests.benchmarks.test_benchmarks import hrbench_rows

    judge = _StubJudge(verdict)
    scoring = scoring_for("hrbench4k", judge, JUDGE_MODEL, RewardConfig())
    task = HRBench4K().task_from_row(hrbench_rows()[0], images=[])
    scores, by = scoring.score(task, prediction)
    assert (by, scores["average"]) == (scored_by, score)
    assert judge.asked == (scored_by != "rules")
    assert ("rule fallback" in scoring.sample_scorer(by)) == (by == "rule_fallback")
