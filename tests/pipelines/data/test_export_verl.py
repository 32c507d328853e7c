"""verl RL parquet: read back by verl's own RLHFDataset with the tiny model's processor."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from pipelines.agent.prompts import build_initial_messages, variant_for
from pipelines.config.agent import AgentConfig
from pipelines.core.records import Task, read_tasks
from pipelines.data.export_verl import AGENT_NAME, PlaceholderMismatch, export_verl, task_row
from pipelines.data.synth import synthesize
from pipelines.errors import DataError

# Small context images keep the processor's token count (and the test) small.
AGENT = AgentConfig(image_max_pixels=50176)


@pytest.fixture(scope="module")
def task_dirs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("verl-tasks")
    synthesize("image-search", 3, 0, root / "img", progress=False)
    synthesize("video", 2, 0, root / "vid", progress=False)
    return root / "img", root / "vid"


def _rlhf_dataset(path: str, model_dir: Path):
    from omegaconf import OmegaConf
    from transformers import AutoProcessor, AutoTokenizer
    from verl.utils.dataset.rl_dataset import RLHFDataset

    config = OmegaConf.create({"max_prompt_length": 4096, "filter_overlong_prompts": True,
                               "filter_overlong_prompts_workers": 1, "return_raw_chat": True,
                               "cache_dir": str(Path(path).parent / "cache")})
    processor = AutoProcessor.from_pretrained(model_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    return RLHFDataset(path, tokenizer, config, processor=processor), processor


def test_rlhf_dataset_reads_the_export_with_our_prompts(task_dirs, tiny_model_dir, tmp_path):
    from qwen_vl_utils import process_vision_info

    img, vid = task_dirs
    info = export_verl([img, vid], tmp_path / "out", name="rl", agent_cfg=AGENT,
                       val_sources=[vid])
    assert (info["rows"], info["val_rows"], info["skipped"]) == (5, 2, {})
    assert info["prompts"] == {"image@v1": 3, "video@v1": 4}
    dataset, _ = _rlhf_dataset(info["train"], tiny_model_dir)
    assert len(dataset) == 5  # the processor counted every prompt; none was filtered out
    for i in range(len(dataset)):
        row = dataset[i]
        task = Task.model_validate_json(row["extra_info"]["task"])
        root = Path(row["extra_info"]["media_root"])
        assert root.is_absolute() and row["agent_name"] == AGENT_NAME
        assert row["index"] == i and row["reward_model"]["ground_truth"] == task.answer
        ours, prompt_info, _ = build_initial_messages(task, root, variant_for(task, AGENT), AGENT)
        assert row["extra_info"]["prompt_version"] == prompt_info.version
        content = row["raw_prompt"][0]["content"]
        if task.video:
            # On-demand video: the text is the whole first turn and no frame is in the context.
            assert content == ours[0]["content"][0]["text"]
            continue
        # Same parts in the same order: the text verl renders equals what the local engine sends.
        assert [p["type"] for p in content] == [p["type"] for p in ours[0]["content"]]
        for theirs, mine in zip(content, ours[0]["content"]):
            if mine["type"] == "text":
                assert theirs["text"] == mine["text"]
        images, _videos = process_vision_info(row["raw_prompt"], image_patch_size=14)
        expected = [p["image"].size for p in ours[0]["content"] if p["type"] == "image"]
        assert [im.size for im in images] == expected and expected[0] != (1152, 768)
    val, _ = _rlhf_dataset(info["val"], tiny_model_dir)
    assert len(val) == 2 and val[0]["extra_info"]["split"] == "val"


def test_uniform_video_frames_become_context_images(task_dirs, tiny_model_dir, tmp_path):
    from qwen_vl_utils import process_vision_info

    agent = AgentConfig(video_context="uniform", uniform_frames=3, image_max_pixels=50176)
    info = export_verl([task_dirs[1]], tmp_path / "out", name="rl", agent_cfg=agent)
    assert info["prompts"] == {"video_frames@v1": 2}
    dataset, _ = _rlhf_dataset(info["train"], tiny_model_dir)
    images, _ = process_vision_info(dataset[1]["raw_prompt"], image_patch_size=14)
    assert len(images) == 3
    frames = sorted((tmp_path / "out" / "rl_frames" / "1").glob("*.png"))
    assert [f.name for f in frames] == ["0.png", "1.png", "2.png"]


def _bad_tasks(root: Path, good: Path) -> Path:
    """A tasks file with one good row and three bad ones (lines 2, 3, 4)."""
    rows = [json.loads(line) for line in (good / "tasks.jsonl").read_text().splitlines()][:2]
    ok = dict(rows[0], images=[str((good / rows[0]["images"][0]).resolve())])
    missing = dict(ok, id="missing", images=[str(root / "nope.png")])
    literal = dict(ok, id="literal", question="What is in <image> here?")
    root.mkdir(parents=True)
    (root / "tasks.jsonl").write_text("\n".join(
        [json.dumps(ok), json.dumps(missing), "{not json", json.dumps(literal)]) + "\n")
    return root


def test_bad_rows_are_reported_with_file_and_line(task_dirs, tmp_path):
    src = _bad_tasks(tmp_path / "bad", task_dirs[0])
    info = export_verl([src], tmp_path / "out", agent_cfg=AGENT)
    assert info["rows"] == 1 and info["read"] == 4
    assert info["skipped"] == {"missing_media": 1, "malformed_json": 1, "placeholder_mismatch": 1}
    problems = "\n".join(info["problems"])
    assert f"{src / 'tasks.jsonl'}:2: missing media file" in problems
    assert f"{src / 'tasks.jsonl'}:3: malformed JSON" in problems
    assert "row 'literal'" in problems and "placeholders" in problems
    with pytest.raises(DataError, match=r"tasks\.jsonl:2: missing media file"):
        export_verl([src], tmp_path / "strict", agent_cfg=AGENT, strict=True)
    assert not (tmp_path / "strict" / "pyvision_rl.parquet").exists()  # nothing half-written


def test_a_literal_placeholder_is_a_placeholder_mismatch(task_dirs, tmp_path):
    src = _bad_tasks(tmp_path / "bad", task_dirs[0])
    literal = next(t for t in read_tasks(src)[0] if t.id == "literal")
    with pytest.raises(PlaceholderMismatch) as caught:
        task_row(literal, src, AGENT, index=0, split="train")
    assert isinstance(caught.value, DataError)
    assert caught.value.message == ("task literal: 2 <image> placeholders in the prompt but 1 "
                                    "context images")
    assert caught.value.hint == "remove literal <image>/<video>/<audio> from the question text"


def test_the_skip_reason_is_the_error_type_not_its_text(task_dirs, tmp_path, monkeypatch):
    from pipelines.data import export_verl as module

    def row(task, *args, **kwargs):
        if task.id.endswith("0"):  # media that cannot be used, whose message says "placeholders"
            raise DataError(f"task {task.id}: the image named placeholders.png cannot be opened")
        if task.id.endswith("1"):
            raise PlaceholderMismatch(f"task {task.id}: not what the prompt holds")
        return real(task, *args, **kwargs)

    real = module.task_row
    monkeypatch.setattr(module, "task_row", row)
    info = export_verl([task_dirs[0]], tmp_path / "out", agent_cfg=AGENT)
    assert info["rows"] == 1
    assert info["skipped"] == {"bad_media": 1, "placeholder_mismatch": 1}
    assert any(p.endswith("cannot be opened") for p in info["problems"])
    assert any(p.endswith("not what the prompt holds") for p in info["problems"])


def test_cli_export_verl(task_dirs, tmp_path):
    from pyvision_cli.main import app

    runner = CliRunner()
    out = tmp_path / "out"
    result = runner.invoke(app, ["data", "export", "--format", "verl", "--source",
                                 str(task_dirs[0]), "--out", str(out), "--name", "mix", "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["rows"] == 3 and (out / "mix.parquet").is_file()
    result = runner.invoke(app, ["data", "export", "--format", "verl", "--source",
                                 str(tmp_path / "none"), "--out", str(out)])
    assert result.exit_code == 2 and "tasks file not found" in result.output


def test_cli_export_verl_names_skipped_rows_in_one_line(task_dirs, tmp_path):
    from pyvision_cli.main import app

    runner = CliRunner()
    src = _bad_tasks(tmp_path / "bad", task_dirs[0])
    result = runner.invoke(app, ["data", "export", "--format", "verl", "--source", str(src),
                                 "--out", str(tmp_path / "out")])
    assert result.exit_code == 0, result.output
    warning = [line for line in result.stderr.splitlines() if line.startswith("warning:")]
    assert warning == [
        ("warning: skipped 3 rows: 1 malformed_json, 1 missing_media, 1 placeholder_mismatch; "
         f"first: {src / 'tasks.jsonl'}:2: missing media file {tmp_path / 'bad' / 'nope.png'}")]
    assert "problems" not in result.stderr  # named once, in the warning
    (src / "tasks.jsonl").write_text("\n".join(
        (src / "tasks.jsonl").read_text().splitlines()[1:]) + "\n")  # no good row left
    result = runner.invoke(app, ["data", "export", "--format", "verl", "--source", str(src),
                                 "--out", str(tmp_path / "none")])
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(
        f"error: no usable task in {src} (skipped 3 rows: 1 malformed_json, 1 missing_media, "
        f"1 placeholder_mismatch; first: {src / 'tasks.jsonl'}:1: missing media file")
    assert not (tmp_path / "none").exists()


def test_parallel_export_writes_the_same_rows(task_dirs, tmp_path, monkeypatch):
    import pyarrow.parquet as pq

    from pipelines.data import export_verl as module

    serial = export_verl(list(task_dirs), tmp_path / "serial", agent_cfg=AGENT)
    monkeypatch.setattr(module, "PARALLEL_MIN_ROWS", 2)
    monkeypatch.setattr(module.os, "cpu_count", lambda: 2)
    parallel = export_verl(list(task_dirs), tmp_path / "parallel", agent_cfg=AGENT)
    assert pq.read_table(serial["train"]).to_pylist() == pq.read_table(parallel["train"]).to_pylist()
