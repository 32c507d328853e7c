"""`pyvision data distill` end to end against a real HTTP teacher on loopback: a scripted
OpenAI-compatible server that answers like a model would (right, wrong, malformed, crashing code,
duplicate code, no tools), through our agent loop and sandbox; what was kept and rejected and why,
the LLaMA-Factory export, the data card in files and store; faults (the server dies mid-run and a
re-run finishes the rest with nothing drawn twice, garbage, timeouts, refused images, an
unreachable teacher); selection; the data stage mixing distilled and scripted data.
"""

from __future__ import annotations

import json
import re
import threading
from collections import Counter
from pathlib import Path

import pytest
from typer.testing import CliRunner

from pipelines.core.records import Task, read_conversations, write_tasks
from pipelines.data.distill import Candidate, select
from pipelines.store import Store
from pyvision_cli.data import app
from tests.helpers import FakeOpenAI, chat_completion, interrupt_after_requests

runner = CliRunner()
WIDTHS = {"good-a": 300, "good-b": 240, "wrong": 200, "badformat": 180, "crash": 160}
FAST = ["--set", "sandbox.timeout_s=10", "--set", "agent.image_max_pixels=12544",
        "--set", "data.distill.client.backoff_s=0", "--set", "data.distill.concurrency=4"]


@pytest.fixture
def tasks_dir(tmp_path: Path) -> Path:
    from PIL import Image

    root = tmp_path / "tasks"
    (root / "media").mkdir(parents=True)
    tasks = []
    for name, width in WIDTHS.items():
        Image.new("RGB", (width, 60), (200, 40, 40)).save(root / "media" / f"{name}.png")
        family = "measure" if name.startswith("good") else name
        tasks.append(Task(id=name, data_source="synth/image-search",
                          question=f"How wide is the image in pixels? [{name} w={width}]",
                          images=[f"media/{name}.png"], answer=str(width), answer_type="number",
                          metadata={"family": family}))
    write_tasks(root / "tasks.jsonl", tasks)
    return root


class Teacher:
    """A scripted teacher: reads the task from the prompt and answers as the task's name says.

    Good tasks get three variants in turn: code that shows and prints the width; the same code
    with a comment (an exact duplicate once comments are dropped); a direct answer without code
    (right, but no tool use on a task that needs it)."""

    def __init__(self, *, die_after: int | None = None, port: int = 0) -> None:
        self.first_turns: Counter[str] = Counter()
        self.lock = threading.Lock()
        self.die_after = die_after
        self.served = 0
        self.server = FakeOpenAI(self.respond, threaded=True, port=port,
                                 models=[{"id": "teacher-vl", "owned_by": "vllm"}])
        self.url = self.server.url
        self.port = self.server.httpd.server_address[1]

    def respond(self, body: dict):
        with self.lock:
            self.served += 1
            if self.die_after is not None and self.served > self.die_after:
                threading.Thread(target=self.server.close, daemon=True).start()
                return 503, {"error": {"message": "shutting down"}}
        prompt = "".join(p.get("text", "") for p in body["messages"][0]["content"])
        found = re.search(r"\[(\S+) w=(\d+)\]", prompt)
        if found is None:  # a task it cannot read (the synthetic ones): a wrong answer
            return 200, chat_completion("<answer>\n\\boxed{unknown}\n</answer>")
        name, width = found.groups()
        last = body["messages"][-1]
        if last["role"] == "user" and len(body["messages"]) == 1:
            with self.lock:
                variant = self.first_turns[name] % 3
                self.first_turns[name] += 1
            if name.startswith("good") and variant == 2:
                return 200, chat_completion(f"I can read it.\n<answer>\n\\boxed{{{width}}}\n"
                                            "</answer>")
            code = {"crash": "print(1 / 0)"}.get(
                name, "print(image_clue_0.size[0])\nplt.imshow(image_clue_0); plt.show()")
            if variant == 1:
                code = "# measure the width\n" + code
            # vLLM keeps the stop string when asked (include_stop_str_in_output).
            assert body.get("include_stop_str_in_output") is True
            return 200, chat_completion(f"Let me measure.\n<code>\n```python\n{code}\n```\n"
                                        "</code>", "</code>")
        printed = re.search(r"Text Result:\n(\S+)", "".join(
            p.get("text", "") for p in last["content"]))
        value = printed.group(1) if printed else "0"
        if name == "wrong":
            value = "123"
        closing = "</code>" if name == "badformat" else "</answer>"
        return 200, chat_completion(f"The code printed {value}.\n<answer>\n\\boxed{{{value}}}\n"
                                    f"{closing}", usage={"prompt_tokens": 300,
                                                         "completion_tokens": 12, "cost": 0.001})

    def close(self) -> None:
        self.server.close()


def _distill(teacher_url: str, tasks: Path, out: Path, *extra: str):
    return runner.invoke(app, ["distill", "--teacher", teacher_url, "--tasks", str(tasks),
                               "--out", str(out), "--k", "3", "--json", *FAST, *extra])


def test_distill_end_to_end_keeps_only_verified_and_selected(tasks_dir: Path,
                                                             tmp_path: Path) -> None:
    teacher = Teacher()
    out = tmp_path / "out"
    try:
        result = _distill(teacher.url, tasks_dir, out)
        again = _distill(teacher.url, tasks_dir, out)  # resume: nothing left to draw
    finally:
        teacher.close()
    assert result.exit_code == 0, result.output
    card = json.loads(result.stdout)
    assert card["tasks"] == {"tried": 5, "with_samples": 5, "with_kept_data": 2}
    s = card["samples"]
    # good-a / good-b: 3 verified each; the others always write code and fail one check.
    assert s["drawn"] == 15 and s["accepted"] == 6
    assert s["rejected"] == {"wrong_answer": 3, "format": 3, "code_error": 3}
    assert card["by_family"]["measure"]["acceptance"] == 1.0
    assert card["by_family"]["crash"]["rejected"] == {"code_error": 3}
    # Per good task: one of the two code variants (exact duplicates of each other) is kept, the
    # direct answer loses to tool use, the other code variant is a duplicate.
    assert card["selection"]["kept"] == 2
    assert card["selection"]["dropped"] == {"duplicate": 2, "over_max_per_task": 2}
    assert card["kept"]["tool_calls"] == {"1": 2} and card["kept"]["turns"] == {"2": 2}
    assert card["teacher"]["served_model"] == "teacher-vl" and card["teacher"]["server"] == "vllm"
    assert card["teacher"]["sampling"]["temperature"] == 0.7 and card["teacher"]["k"] == 3
    # 2 requests per trajectory but the direct answers (2); a cost came with the 13 answers.
    assert card["usage"]["requests"] == 28 and card["usage"]["cost"] == pytest.approx(0.013)
    assert card["kept"]["visual_tokens"] > 0 and card["kept"]["images"] == 4

    # The SFT data: conversations with the prompt image and the interpreter's figure, exported.
    convs, _ = read_conversations(out)
    assert sorted(c.metadata["task_id"] for c in convs) == ["good-a", "good-b"]
    info = json.loads((out / "dataset_info.json").read_text())
    assert info["pyvision_distill"]["file_name"] == "pyvision_distill.jsonl"
    rows = [json.loads(line) for line in (out / "pyvision_distill.jsonl").read_text().splitlines()]
    assert len(rows) == 2
    for row in rows:
        assert [t["from"] for t in row["conversations"]] == ["human", "gpt", "human", "gpt"]
        assert len(row["images"]) == 2 and all((out / p).is_file() for p in row["images"])
        assert "<interpreter>" in row["conversations"][2]["value"]
        assert row["conversations"][1]["value"].endswith("</code>")
    assert "| measure | 2 | 6 | 6 | 100.0% | 2 | - |" in (out / "card.md").read_text()

    # The store has the card and a row per sample.
    store = Store()
    assert store.distill_card(str(out.resolve()))["samples"]["drawn"] == 15
    samples = store.distill_samples(str(out.resolve()))
    assert len(samples) == 15 and sum(r["kept"] for r in samples) == 2
    assert Counter(r["verdict"] for r in samples)["accepted"] == 6

    # Run again: everything was drawn, so no request is made and the card is the same.
    assert again.exit_code == 0, again.output
    assert json.loads(again.stdout)["samples"] == s
    assert sum(teacher.first_turns.values()) == 15


def test_the_teacher_dies_mid_run_and_a_rerun_draws_only_the_rest(tasks_dir: Path,
                                                                   tmp_path: Path) -> None:
    out = tmp_path / "out"
    teacher = Teacher(die_after=12)
    try:
        dead = _distill(teacher.url, tasks_dir, out, "--set", "data.distill.client.max_retries=1")
    finally:
        teacher.close()
    assert dead.exit_code == 2
    line = " ".join(dead.output.split())
    assert "teacher http://127.0.0.1" in line and "did not answer after 2 tries" in line
    assert "kept in" in line and "run the same command again" in line
    assert not (out / "manifest.json").exists()
    index = [json.loads(x) for x in (out / "samples" / "index.jsonl").read_text().splitlines()]
    finished = {(r["task_id"], r["sample"]) for r in index}
    assert 0 < len(finished) < 15

    back = Teacher(port=teacher.port)
    try:
        result = _distill(back.url, tasks_dir, out)
    finally:
        back.close()
    assert result.exit_code == 0, result.output
    index = [json.loads(x) for x in (out / "samples" / "index.jsonl").read_text().splitlines()]
    keys = [(r["task_id"], r["sample"]) for r in index]
    assert len(keys) == len(set(keys)) == 15  # nothing drawn twice
    assert sum(back.first_turns.values()) == 15 - len(finished)
    assert json.loads(result.stdout)["samples"]["drawn"] == 15


@pytest.mark.parametrize(("respond", "message"), [
    (lambda body: (200, b"<html>Bad gateway</html>"), "returned malformed output"),
    (lambda body: (400, {"message": "image input is not supported by this model"}),
     "refuses images (HTTP 400: image input is not supported by this model)"),
    (lambda body: (422, {"detail": "Unexpected fields in the request: {'top_p'}"}),
     "rejected the request (HTTP 422): Unexpected fields in the request: {'top_p'}"),
])
def test_garbage_and_refusals_are_one_line(tasks_dir: Path, tmp_path: Path, respond,
                                           message: str) -> None:
    with FakeOpenAI(respond) as server:
        result = _distill(server.url, tasks_dir, tmp_path / "out", "--limit", "1",
                          "--set", "data.distill.client.max_retries=1")
    assert result.exit_code == 2 and "Traceback" not in result.output
    lines = [ln for ln in result.output.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1 and message in " ".join(result.output.split())
    assert not (tmp_path / "out" / "manifest.json").exists()


def test_a_teacher_that_times_out_is_named_with_the_wait(tasks_dir: Path, tmp_path: Path) -> None:
    release = threading.Event()

    def slow(body: dict):
        release.wait(5)
        return 200, chat_completion("<answer>\\boxed{1}</answer>")

    with FakeOpenAI(slow, threaded=True) as server:
        result = _distill(server.url, tasks_dir, tmp_path / "out", "--limit", "1",
                          "--set", "data.distill.client.timeout_s=0.3",
                          "--set", "data.distill.client.max_retries=1")
        release.set()
    assert result.exit_code == 2
    assert "did not answer after 2 tries: no answer within 0.3 s" in " ".join(result.output.split())


def test_unreachable_teacher_and_bad_input_write_nothing(tasks_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    down = _distill("http://127.0.0.1:9", tasks_dir, out)
    assert down.exit_code == 2 and "teacher http://127.0.0.1:9 does not answer" in down.output
    assert "--teacher" in " ".join(down.output.split()) and not out.exists()
    missing = runner.invoke(app, ["distill", "--teacher", "http://127.0.0.1:9", "--tasks",
                                  str(tmp_path / "nope"), "--out", str(out)])
    assert missing.exit_code == 2 and "tasks folder not found" in missing.output
    bad_k = runner.invoke(app, ["distill", "--teacher", "http://127.0.0.1:9", "--tasks",
                                str(tasks_dir), "--out", str(out), "--k", "0"])
    assert bad_k.exit_code == 2 and "'--k'" in bad_k.output and not out.exists()


def _cand(task: str, sample: int, family: str = "f", turns: int = 2, calls: int = 1,
          sig: str | None = None, needs: bool = True) -> Candidate:
    return Candidate(task, sample, family, turns, 100 + sample, calls, needs,
                     sig if sig is not None else f"print({task}{sample} * 17 + width_of_it)")


def test_selection_prefers_tools_then_fewer_turns_drops_near_duplicates_and_balances() -> None:
    cands = [_cand("t", 0, turns=1, calls=0), _cand("t", 1, turns=3),
             _cand("t", 2, turns=2, sig="print(t1 * 17 + width_of_it)  "),
             _cand("u", 0, turns=1, calls=0, needs=False), _cand("u", 1, turns=2)]
    kept = select(cands, max_per_task=1, balance="none", ratio=2.0, near_duplicate=0.9, seed=0)
    # t: the tool-using 2-turn one wins; its near-duplicate (same code bar spacing) never counts.
    assert [(c.task_id, c.sample) for c in kept] == [("t", 2), ("u", 0)]
    assert {(c.task_id, c.sample): c.outcome for c in cands}[("t", 1)] == "duplicate"
    # Balance: family "big" has 6 tasks, the two others 1 each (median 1, ratio 2 -> cap 2).
    many = [_cand(f"b{i}", 0, family="big") for i in range(6)] + \
        [_cand("x", 0, family="x"), _cand("y", 0, family="y")]
    kept = select(many, max_per_task=1, balance="family", ratio=2.0, near_duplicate=1.0, seed=3)
    assert Counter(c.family for c in kept) == {"big": 2, "x": 1, "y": 1}
    again = select([_cand(c.task_id, c.sample, family=c.family) for c in many], max_per_task=1,
                   balance="family", ratio=2.0, near_duplicate=1.0, seed=3)
    assert [c.task_id for c in again] == [c.task_id for c in kept]  # seeded: repeatable


def test_format_problems_name_each_miss() -> None:
    from pipelines.agent.protocol import format_problems

    code = "Look.\n<code>\n```python\nprint(1)\n```\n</code>"
    assert format_problems([code, "So 1.\n<answer>\n\\boxed{1}\n</answer>"]) == []
    assert format_problems([code, "<answer>\n\\boxed{1}\n</code>"]) == [
        "turn 2 (the answer) has a code block", "turn 2 has 1 <answer> and 0 </answer> tags"]
    assert format_problems([code + " more", "<answer>\\boxed{1}</answer>"]) == [
        "turn 1: the code is not one <code>```python ... ```</code> block"]
    assert "turn 1 writes an <interpreter> turn itself" in format_problems(
        [code.replace("</code>", "</code><interpreter>1</interpreter>"), "<answer>1</answer>"])
    assert format_problems(["<answer>\\boxed{1}</answer><|im_end|>"]) == [
        "turn 1 has a chat-template marker", "turn 1 goes on after </answer>"]


def test_the_data_stage_mixes_distilled_and_scripted_data(tasks_dir: Path, tmp_path: Path) -> None:
    """`pyvision run`'s data stage with a teacher: scripted trajectories of the synthetic SFT
    tasks and the teacher's verified ones of data.distill.tasks, in one LLaMA-Factory export."""
    from pipelines.config.recipe import load_recipe
    from pipelines.data_stage import run_data_stage
    from pipelines.rundir import stage_dir

    teacher = Teacher()
    try:
        recipe = load_recipe(None, [
            f"runs_dir={tmp_path / 'runs'}", "model.tiny=null", "model.base=some/model",
            "data.synth.image_search.n_train=2", "data.synth.image_search.n_heldout=0",
            "data.synth.video.n_train=0", "data.synth.video.n_heldout=0",
            "data.synth.sft_fraction=1.0", f"data.distill.teacher={teacher.url}",
            f"data.distill.tasks=[{tasks_dir}]", "data.distill.k=3",
            "data.sft_sources=[scripted,distill]", "data.distill.client.backoff_s=0",
            "agent.image_max_pixels=12544"])
        sd = stage_dir(recipe, "data", "mix", runs_dir=None, store=Store(), recipe_path=None)
        sd.begin()
        result = run_data_stage(recipe, sd, show_progress=False)
    finally:
        teacher.close()
    summary = result["summary"]
    # Synthetic tasks have answers the teacher cannot know: their samples are rejected.
    assert summary["distill/samples"] == 3 * (2 + 5) and summary["distill/kept"] == 2
    rows = (Path(result["outputs"]["sft_dataset_dir"]) / "pyvision_sft.jsonl").read_text()
    assert len(rows.splitlines()) == summary["image-search/trajectories_kept"] + 2
    assert rows.count("The code printed 300.") + rows.count("The code printed 240.") == 2


def test_first_ctrl_c_stops_a_distillation_keeping_finished_samples(tasks_dir: Path,
                                                                    tmp_path: Path) -> None:
    hang = threading.Event()
    answered = []

    def respond(body: dict):
        if len(answered) >= 2:
            hang.wait(120)
        answered.append(1)
        return 200, chat_completion("<answer>\n\\boxed{300}\n</answer>")

    server = FakeOpenAI(respond, threaded=True)
    out = tmp_path / "out"
    code, err, stopped_in = interrupt_after_requests(
        ["data", "distill", "--teacher", server.url, "--tasks", str(tasks_dir), "--out", str(out),
         "--k", "1", "--concurrency", "1", "--set", "agent.image_max_pixels=12544"],
        server, 3, hang, tmp_path, {"PYVISION_STORE": str(tmp_path / "s.duckdb")})
    # Seconds (interpreter shutdown on a loaded machine), not the hung request's 120 s.
    assert stopped_in < 60, err
    assert code != 0 and "the 2 samples drawn in this run are kept" in " ".join(err.split())
    index = (out / "samples" / "index.jsonl").read_text().splitlines()
    assert len(index) == 2 and not (out / "manifest.json").exists()
