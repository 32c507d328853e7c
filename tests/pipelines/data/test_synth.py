"""Synthetic tasks, solvers and cold-start trajectories; the data CLI and validation."""

from __future__ import annotations

import contextlib
import io
import json
import random
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from typer.testing import CliRunner

from benchmarks.scoring import verify
from pipelines.core.records import read_conversations, read_tasks
from pipelines.data.solvers import plan
from pipelines.data.synth import FAMILIES, synthesize
from pipelines.data.vocab import PALETTE
from pipelines.errors import UserError
from pyvision_cli.data import app


@pytest.fixture(scope="module")
def image_set(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("synth") / "image"
    synthesize("image-search", 10, 7, out, families=FAMILIES["image-search"], progress=False)
    return out


@pytest.fixture(scope="module")
def video_set(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("synth") / "video"
    synthesize("video", 6, 7, out, progress=False)
    return out


def test_deterministic_prefix_stable_and_splits_disjoint(tmp_path, image_set):
    again = tmp_path / "again"
    synthesize("image-search", 10, 7, again, families=FAMILIES["image-search"], progress=False)
    assert (again / "tasks.jsonl").read_bytes() == (image_set / "tasks.jsonl").read_bytes()
    for f in (image_set / "media").iterdir():
        assert (again / "media" / f.name).read_bytes() == f.read_bytes()
    prefix = tmp_path / "prefix"
    synthesize("image-search", 5, 7, prefix, families=FAMILIES["image-search"], progress=False)
    assert (prefix / "tasks.jsonl").read_text().splitlines() == \
        (image_set / "tasks.jsonl").read_text().splitlines()[:5]
    other = tmp_path / "other"
    synthesize("image-search", 5, 8, other, families=FAMILIES["image-search"], progress=False)
    held = tmp_path / "held"
    synthesize("image-search", 5, 7, held, split="heldout", families=FAMILIES["image-search"],
               progress=False)
    for d in (other, held):
        imgs = {f.read_bytes() for f in (d / "media").iterdir()}
        assert not imgs & {f.read_bytes() for f in (prefix / "media").iterdir()}


def test_tasks_made_on_threads_are_the_bytes_made_on_one(tmp_path, image_set, monkeypatch):
    """Tasks are made two at a time (their media encoding releases the GIL); the set is the
    one a single thread makes, and a task that fails ends the set with nothing written."""
    from pipelines.data import synth, synth_image

    monkeypatch.setattr(synth, "_SYNTH_THREADS", 1)
    one = tmp_path / "one"
    synthesize("image-search", 10, 7, one, families=FAMILIES["image-search"], progress=False)
    assert (one / "tasks.jsonl").read_bytes() == (image_set / "tasks.jsonl").read_bytes()
    assert sorted(p.name for p in (one / "media").iterdir()) == \
        sorted(p.name for p in (image_set / "media").iterdir())
    for f in (image_set / "media").iterdir():
        assert (one / "media" / f.name).read_bytes() == f.read_bytes()

    monkeypatch.setattr(synth, "_SYNTH_THREADS", 2)
    real = synth_image.make_image_task

    def make(family, rng, index, split, root):
        if index == 6:
            raise OSError("disk full")
        return real(family, rng, index, split, root)

    monkeypatch.setattr(synth_image, "make_image_task", make)
    with pytest.raises(OSError, match="disk full"):
        synthesize("image-search", 40, 7, tmp_path / "broken", progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["one"]  # no set, no temporary folder


def test_videos_are_repeatable_and_lossless(tmp_path, video_set):
    """The same seed gives the same clip bytes (the lossy encoder did not), and every decoded
    frame holds exactly the palette colours that were drawn."""
    import decord

    again = tmp_path / "again"
    synthesize("video", 6, 7, again, progress=False)
    for f in (video_set / "media").iterdir():
        assert (again / "media" / f.name).read_bytes() == f.read_bytes(), f.name
    tasks, _ = read_tasks(video_set)
    for t in tasks:
        frames = decord.VideoReader(str(video_set / t.video)).get_batch(
            list(range(t.metadata["frames"]))).asnumpy()
        allowed = {tuple(c) for c in PALETTE.values()} | {(t.metadata["background"],) * 3}
        colours = {tuple(c) for c in np.unique(frames.reshape(-1, 3), axis=0)}
        assert colours <= allowed, colours - allowed


def test_every_family_is_valid_and_answers_follow_from_the_scene(image_set, video_set):
    tasks, report = read_tasks(image_set)
    assert report.kept == 10 and {t.metadata["family"] for t in tasks} == set(FAMILIES["image-search"])
    for t in tasks:
        meta = t.metadata
        img = np.asarray(Image.open(t.image_paths(image_set)[0]).convert("RGB")).astype(int)
        if meta["family"] == "count":
            n = sum(o["colour"] == meta["target"] for o in meta["objects"])
            assert t.answer == str(n) == str(meta["count"])
        elif meta["family"] == "measure":
            bar = next(o for o in meta["objects"] if o["colour"] == meta["target"])
            assert int(t.answer) == bar["box"][2] - bar["box"][0] and meta["metric"] == "mra"
        elif meta["family"] == "color":
            (obj,) = [o for o in meta["objects"] if o["colour"] != "grey"]
            x0, y0, x1, y1 = obj["box"]
            centre = img[(y0 + y1) // 2 + 2, (x0 + x1) // 2]
            assert tuple(centre) == PALETTE[obj["colour"]]
            expected = obj["colour"] if t.answer_type == "text" else \
                chr(65 + t.options.index(obj["colour"]))
            assert t.answer == expected
        elif meta["family"] == "position":
            assert t.options[ord(t.answer) - 65] == meta["relation"]
    vtasks, _ = read_tasks(video_set)
    assert {t.metadata["family"] for t in vtasks} == set(FAMILIES["video"])
    for t in vtasks:
        if t.metadata["family"] == "count":
            n = sum(o["colour"] == t.metadata["target"] for o in t.metadata["objects"])
            assert t.answer == str(n) and t.metadata["metric"] == "mra"
        if t.metadata["family"] == "order":
            assert t.options[ord(t.answer) - 65] == t.metadata["order"][0]


def _run_plan(task, root):
    import decord
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    p = plan(task, random.Random(task.id))
    env = {"np": np, "plt": plt, "Image": Image}
    if task.video:
        env["video_clue_0"] = decord.VideoReader(str(task.video_path(root)))
    else:
        env["image_clue_0"] = Image.open(task.image_paths(root)[0]).convert("RGB")
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        for step in p.steps:
            exec(step.code, env)  # noqa: S102 - the solver's own code, as the sandbox runs it
    plt.close("all")
    return buf.getvalue().strip().splitlines()[-1] if buf.getvalue().strip() else ""


def test_solver_plans_reach_the_right_answer(tmp_path):
    img = tmp_path / "img"
    vid = tmp_path / "vid"
    synthesize("image-search", 24, 1, img, progress=False)
    synthesize("video", 18, 1, vid, progress=False)
    solved = 0
    for root in (img, vid):
        tasks, _ = read_tasks(root)
        for t in tasks:
            printed = _run_plan(t, root)
            solved += verify(t, printed).correct
    # Every solver must succeed: the code is exact on lossless PNGs; on mp4 the distance can be
    # off by a pixel, which MRA still counts as correct.
    assert solved == 42


def test_plans_restate_the_question_and_name_their_colours(image_set, video_set):
    from pipelines.data.vocab import PALETTE

    for root in (image_set, video_set):
        tasks, _ = read_tasks(root)
        for t in tasks:
            p = plan(t, random.Random(0))
            for step in p.steps:
                assert step.thought.startswith(f"The question: {t.question.splitlines()[0]}\n")
            code = "\n".join(s.code for s in p.steps)
            # Every colour triple in the code follows its own name (``cyan = (40, 200, 210)``,
            # ``"A": (" cyan", (40, 200, 210))`` or the free-form table's ``"cyan": (...)``), and
            # the code never names a colour it has not given a value (no NameError to copy).
            for line in code.splitlines():
                for name, (r, g, b) in PALETTE.items():
                    for at in [i for i in range(len(line)) if line.startswith(f"({r}, {g}, {b})", i)]:
                        assert re.search(rf'\b{name}(?: = |", |": )$', line[:at]), line
            bound = set(re.findall(r"^(\w+) = \(\d+, \d+, \d+\)$", code, re.MULTILINE))
            used = {w for w in re.findall(r"\w+", re.sub(r'"[^"]*"', "", code)) if w in PALETTE}
            assert used <= bound, (used - bound, code)
            # A multiple-choice table names each option as the question does, by its letter.
            if t.answer_type == "choice" and t.metadata["family"] in ("color", "order"):
                for i, o in enumerate(t.options):
                    assert f'"{chr(65 + i)}": (" {o}", ' in code


def test_no_video_code_opens_like_image_code(image_set, video_set):
    """Which medium a step reads is settled on its code's first line: a video step never opens with
    a line an image step opens with (colour constants compared by shape, whatever the colour).
    Video counting once opened like image counting, and RL on the image's code rewrote the video's
    (docs/tiny-recipe.md)."""
    def openings(root: Path) -> dict[str, set[str]]:
        out: dict[str, set[str]] = {}
        for t in read_tasks(root)[0]:
            for seed in range(8):
                for step in plan(t, random.Random(seed)).steps:
                    first = re.sub(r"^\w+ = \(\d+, \d+, \d+\)$", "COLOUR = (R, G, B)",
                                   step.code.splitlines()[0])
                    out.setdefault(first, set()).add(t.metadata["family"])
        return out

    image, video = openings(image_set), openings(video_set)
    assert {f for fams in video.values() for f in fams} == {"count", "distance", "order"}
    assert "from scipy import ndimage" in image and "COLOUR = (R, G, B)" in image
    assert not set(image) & set(video), {k: (image[k], video[k]) for k in set(image) & set(video)}


def test_plan_code_uses_only_the_question(image_set):
    tasks, _ = read_tasks(image_set)
    for t in tasks:
        code = "\n".join(s.code for s in plan(t, random.Random(0)).steps)
        for obj in t.metadata["objects"]:
            assert str(obj["box"][0]) + ", " + str(obj["box"][1]) not in code


def test_trajectories_run_in_the_sandbox_and_are_exported(tmp_path, image_set, video_set):
    from pipelines.config.agent import AgentConfig
    from pipelines.data.export_llamafactory import export_llamafactory
    from pipelines.data.trajectories import make_trajectories

    agent = AgentConfig(image_max_pixels=12544)
    m = make_trajectories(image_set, tmp_path / "ti", agent_cfg=agent, limit=8, progress=False)
    v = make_trajectories(video_set, tmp_path / "tv", agent_cfg=agent, progress=False)
    # The text task's solver zooms in and reads the word, as a model that can read would.
    assert m["tasks"] == 8 and m["kept"] == 8 and m["dropped"] == {}
    assert v["kept"] + sum(v["dropped"].values()) == 6 and v["kept"] >= 5
    convs, report = read_conversations(tmp_path / "ti")
    assert report.kept == 8
    first = convs[0]
    assert first.messages[0].content.startswith("<image_clue_0><image></image_clue_0>")
    assert "<interpreter>\nText Result:\n" in first.messages[2].content
    final = first.messages[-1].content
    assert "\\boxed{" in final and final.endswith("</answer>")
    info = export_llamafactory([(tmp_path / "ti", convs)], tmp_path / "lf")
    assert info["rows"] == 8 and info["images"] == sum(len(c.images) for c in convs)
    with pytest.raises(UserError, match="already holds finished trajectories"):
        make_trajectories(image_set, tmp_path / "ti", agent_cfg=agent, progress=False)


def test_llamafactory_reads_the_export_with_the_tiny_processor(tmp_path, image_set, tiny_model_dir):
    """LLaMA-Factory's own loader tokenises our export; image pads match the processor's count."""
    from llamafactory.data import get_template_and_fix_tokenizer
    from llamafactory.hparams import DataArguments
    from transformers import AutoProcessor

    from pipelines.config.agent import AgentConfig
    from pipelines.data.export_llamafactory import export_llamafactory
    from pipelines.data.trajectories import make_trajectories

    make_trajectories(image_set, tmp_path / "t", agent_cfg=AgentConfig(image_max_pixels=12544),
                      limit=2, progress=False)
    convs, _ = read_conversations(tmp_path / "t")
    export_llamafactory([(tmp_path / "t", convs)], tmp_path / "lf")
    row = json.loads((tmp_path / "lf" / "pyvision_sft.jsonl").read_text().splitlines()[0])
    processor = AutoProcessor.from_pretrained(tiny_model_dir)
    tok = processor.tokenizer
    template = get_template_and_fix_tokenizer(tok, DataArguments(template="qwen2_vl"))
    images = [Image.open(tmp_path / "lf" / p).convert("RGB") for p in row["images"]]
    msgs = [{"role": "user" if t["from"] == "human" else "assistant", "content": t["value"]}
            for t in row["conversations"]]
    mm = template.mm_plugin.process_messages(msgs, images, [], [], processor)
    ids = [i for a, b in template.encode_multiturn(tok, mm) for i in a + b]
    grids = processor.image_processor(images=images)["image_grid_thw"]
    expected = sum(int(g.prod()) // 4 for g in grids)
    assert ids.count(tok.convert_tokens_to_ids("<|image_pad|>")) == expected


def test_validate_reports_bad_rows_with_locations(tmp_path, image_set):
    bad = tmp_path / "bad"
    shutil.copytree(image_set, bad)
    tasks = (bad / "tasks.jsonl").read_text().splitlines()
    row = json.loads(tasks[1])
    row["answer"] = ""
    tasks[1] = json.dumps(row)
    tasks.insert(2, "{not json")
    (bad / "tasks.jsonl").write_text("\n".join(tasks) + "\n")
    (bad / "media" / Path(json.loads(tasks[0])["images"][0]).name).write_bytes(b"\x89PNG broken")
    Path(bad / json.loads(tasks[3])["images"][0]).unlink()
    runner = CliRunner()
    result = runner.invoke(app, ["validate", str(bad), "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["skipped"] == {"empty_answer": 1, "malformed_json": 1, "missing_media": 1,
                                 "corrupt_media": 1}
    assert any(":2:" in p for p in report["problems"]) and any(":3:" in p for p in report["problems"])
    strict = runner.invoke(app, ["validate", str(bad), "--strict"])
    assert strict.exit_code == 2 and "tasks.jsonl:" in strict.output


def test_synth_cli_and_refusals(tmp_path):
    runner = CliRunner()
    out = tmp_path / "s"
    ok = runner.invoke(app, ["synth", "--kind", "video", "--n", "2", "--out", str(out), "--json"])
    assert ok.exit_code == 0, ok.output
    assert json.loads(ok.stdout)["n"] == 2 and (out / "manifest.json").is_file()
    again = runner.invoke(app, ["synth", "--kind", "video", "--n", "2", "--out", str(out)])
    assert again.exit_code == 2 and "--force" in again.output
    bad = runner.invoke(app, ["synth", "--kind", "audio", "--n", "2", "--out", str(tmp_path / "x")])
    assert bad.exit_code == 2 and "'--kind'" in bad.output and "audio" in bad.output
    assert not (tmp_path / "x").exists()
