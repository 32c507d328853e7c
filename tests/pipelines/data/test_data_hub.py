"""Real datasets: offline download fails fast; import converts published layouts; export."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
from PIL import Image

from pipelines.core.records import Conversation, Message, read_conversations, read_tasks
from pipelines.data import hub
from pipelines.data.export_llamafactory import export_llamafactory
from pipelines.errors import DataError, UserError


def test_offline_download_fails_fast_with_import_route(tmp_path, monkeypatch):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    # Point the hub client at a closed local port: a real connection attempt that is refused.
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
    start = time.monotonic()
    with pytest.raises(DataError) as exc:
        hub.download("pyvision-image-sft", tmp_path / "out", timeout_s=2)
    assert time.monotonic() - start < 15
    msg = str(exc.value)
    assert "pyvision-image-sft" in msg and "Agents-X/PyVision-Image-SFT-Data" in msg
    assert "pyvision data import pyvision-image-sft --from-dir DIR" in msg
    assert not (tmp_path / "out" / "manifest.json").exists()


def test_offline_env_var_is_respected(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(DataError, match="HF_HUB_OFFLINE"):
        hub.download("vsibench", tmp_path)


def test_unknown_dataset_suggests():
    with pytest.raises(UserError, match="did you mean 'pyvision-image-sft'"):
        hub.get_dataset("pyvision-image-stf")


def _img(path: Path, size=(40, 30)) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", size, (200, 10, 10)).save(path)


def test_import_sft_published_layout(tmp_path):
    src = tmp_path / "copy"
    _img(src / "images" / "mmpr" / "1_0.png")
    _img(src / "images" / "mmpr" / "1_1.png")
    rows = [
        {"conversations": [
            {"role": "user", "content": "<image_clue_0><image></image_clue_0>\n\nSolve it."},
            {"role": "assistant", "content": "<code>\n```python\nplt.show()\n```\n</code>"},
            {"role": "user", "content": "<interpreter>\nImage Result:\n<image>\n</interpreter>"},
            {"role": "assistant", "content": "<answer>\n\\boxed{3}\n</answer>"}],
         "images": ["mmpr/1_0.png", "mmpr/1_1.png"], "source_dataset": "mmpr"},
        {"conversations": [{"role": "user", "content": "<image>q"},
                           {"role": "assistant", "content": "a"}],
         "images": ["mmpr/missing.png"], "source_dataset": "mmpr"},
        {"conversations": [{"role": "user", "content": "<image><image>q"},
                           {"role": "assistant", "content": "a"}],
         "images": ["mmpr/1_0.png"], "source_dataset": "mmpr"},
    ]
    (src / "pyvision_image_sft_data.json").write_text(json.dumps(rows))
    out = tmp_path / "out"
    manifest = hub.import_dataset("pyvision-image-sft", src, out)
    assert manifest["kept"] == 1 and manifest["read"] == 3
    assert manifest["skipped"] == {"missing_media": 1, "placeholder_mismatch": 1}
    assert any("pyvision_image_sft_data.json:2" in p for p in manifest["problems"])
    convs, _report = read_conversations(out)
    assert len(convs) == 1 and convs[0].data_source == "mmpr"
    assert (out / convs[0].images[0]).is_file()
    with pytest.raises(DataError, match=r"pyvision_image_sft_data.json:2: missing media"):
        hub.import_dataset("pyvision-image-sft", src, tmp_path / "strict", strict=True)


def test_import_counts_a_torn_or_non_utf8_jsonl_line_and_keeps_the_rest(tmp_path):
    src = tmp_path / "copy"
    _img(src / "images" / "1_0.png")
    good = {"conversations": [{"role": "user", "content": "<image>q"},
                              {"role": "assistant", "content": "<answer>\\boxed{3}</answer>"}],
            "images": ["1_0.png"]}
    (src / "part.jsonl").write_bytes(json.dumps(good).encode() + b"\n\n{\"caf\xe9\": 1}\n"
                                     + b'{"conversations": [' + b"\n")
    manifest = hub.import_dataset("pyvision-image-sft", src, tmp_path / "out")
    assert manifest["read"] == 3 and manifest["kept"] == 1  # the blank line is not a row
    assert manifest["skipped"] == {"malformed_json": 2}
    assert [p.split(": ")[0] for p in manifest["problems"]] == [
        f"{src / 'part.jsonl'}:3", f"{src / 'part.jsonl'}:4"]


def test_import_skips_rows_whose_fields_have_the_wrong_shape(tmp_path):
    src = tmp_path / "copy"
    _img(src / "images" / "a.png")
    turns = [{"role": "user", "content": "<image>q"}, {"role": "assistant", "content": "a"}]
    sft = [{"conversations": turns, "images": ["a.png"]},
           {"conversations": ["hello", "world"], "images": ["a.png"]},
           {"conversations": "hello", "images": ["a.png"]},
           {"conversations": turns, "images": [5]},
           {"conversations": turns, "images": "a.png"}]
    (src / "sft.json").write_text(json.dumps(sft))
    manifest = hub.import_dataset("pyvision-image-sft", src, tmp_path / "sft")
    assert manifest["kept"] == 1 and manifest["skipped"] == {"invalid_row": 4}
    assert [p.split(": ", 1)[1] for p in manifest["problems"]] == [
        "'conversations' must be a list of turn objects"] * 2 + ["'images' must be a list of paths"] * 2
    rl = [{"question": "How many?", "answer": "3", "image_path": "a.png"},
          {"question": "How many?", "answer": "3", "image_path": ["a.png"]},
          {"question": "Which?", "answer": ["A"], "image_path": "a.png"}]
    (src / "sft.json").unlink()
    (src / "rl.json").write_text(json.dumps(rl))
    manifest = hub.import_dataset("pyvision-image-rl", src, tmp_path / "rl")
    assert manifest["kept"] == 1 and manifest["skipped"] == {"invalid_row": 2}
    assert "'answer' must be text or a number, not list" in manifest["problems"][1]


def test_import_of_data_files_without_rows_says_so(tmp_path):
    src = tmp_path / "copy"
    src.mkdir()
    with pytest.raises(DataError, match=r"no data files \(\*\.json, \*\.jsonl, \*\.parquet\)"):
        hub.import_dataset("pyvision-image-sft", src, tmp_path / "a")
    (src / "data.json").write_text('{"count": 1}')
    with pytest.raises(DataError, match=r"no rows in the data files under .*copy \(a \.json file "
                                        r"holds a list of rows"):
        hub.import_dataset("pyvision-image-sft", src, tmp_path / "b")
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_import_rl_resolves_foreign_absolute_paths(tmp_path):
    src = tmp_path / "copy"
    _img(src / "vstar_bench" / "direct_attributes" / "sa_1.jpg")
    _img(src / "other" / "sa_1.jpg")  # same file name elsewhere: the longest path match wins
    rows = [
        {"id": "0", "question": "What is the material of the glove?\n(A) rubber\n(B) cotton\n"
                                "Answer with the option's letter from the given choices directly.",
         "answer": "A", "ability": "visual_search", "data_source": "vstar",
         "image_path": "/mnt/cluster/data/vstar_bench/direct_attributes/sa_1.jpg"},
        {"id": "1", "question": "How many?", "answer": "", "data_source": "x",
         "image_path": "/x/vstar_bench/direct_attributes/sa_1.jpg"},
        {"id": "2", "question": "How many cars?", "answer": "12", "data_source": "x",
         "image_path": "/nowhere/none.jpg"},
    ]
    (src / "pyvision_image_rl_data.json").write_text(json.dumps(rows))
    out = tmp_path / "out"
    manifest = hub.import_dataset("pyvision-image-rl", src, out)
    assert manifest["kept"] == 1 and manifest["skipped"] == {"empty_answer": 1, "missing_media": 1}
    tasks, _ = read_tasks(out)
    (task,) = tasks
    assert task.answer_type == "choice" and task.options == ["rubber", "cotton"]
    assert task.image_paths(out)[0].resolve() == (src / "vstar_bench/direct_attributes/sa_1.jpg").resolve()


@pytest.mark.parametrize("question,answer,expected", [
    ("Which?\n(A) x\n(B) y", "B", "choice"),
    ("How many?", "1,024", "number"),
    ("Find x.", "\\frac{1}{2}", "math"),
    ("What colour?", "dark red", "text"),
])
def test_infer_answer_type(question, answer, expected):
    assert hub.infer_answer_type(question, answer)[0] == expected


def test_tar_extraction_refuses_path_traversal(tmp_path):
    import io
    import tarfile

    archive = tmp_path / "evil.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        data = b"x"
        info = tarfile.TarInfo("../escape.txt")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    dest = tmp_path / "dest"
    dest.mkdir()
    with pytest.raises(DataError, match="unsafe member"):
        hub.extract_archive(archive, dest)
    assert not (tmp_path / "escape.txt").exists()


def test_export_llamafactory_layout(tmp_path):
    src = tmp_path / "src"
    _img(src / "media" / "a.png")
    _img(src / "media" / "b.png")
    conv = Conversation(id="t1", data_source="synth", images=["media/a.png", "media/b.png"], messages=[
        Message(role="user", content="<image>Question?"),
        Message(role="assistant", content="<code>\n```python\nplt.show()\n```\n</code>"),
        Message(role="user", content="<interpreter>\nImage Result:\n<image>\n</interpreter>"),
        Message(role="assistant", content="<answer>\n\\boxed{1}\n</answer>")])
    out = tmp_path / "lf"
    info = export_llamafactory([(src, [conv])], out, name="pyvision_sft")
    assert info == {"dataset_dir": str(out), "dataset": "pyvision_sft", "rows": 1, "images": 2,
                    "videos": 0, "images_resized": 0}
    ds_info = json.loads((out / "dataset_info.json").read_text())
    assert ds_info["pyvision_sft"]["formatting"] == "sharegpt"
    row = json.loads((out / "pyvision_sft.jsonl").read_text())
    assert [t["from"] for t in row["conversations"]] == ["human", "gpt", "human", "gpt"]
    assert all((out / p).resolve().is_file() for p in row["images"])
    bad = Conversation(id="t2", data_source="s", images=[], messages=[
        Message(role="user", content="<image>q"), Message(role="assistant", content="a")])
    with pytest.raises(DataError, match="1 <image> placeholders but 0 images"):
        export_llamafactory([(src, [bad])], out)


def _corrupt_parquet(folder: Path) -> None:
    folder.mkdir(parents=True)
    (folder / "test-00000-of-00001.parquet").write_bytes(bytes(range(256)) * 8)


def _vstar_without_label(folder: Path) -> None:
    folder.mkdir(parents=True)
    (folder / "test.jsonl").write_text(json.dumps({"question_id": 0, "text": "Which? (A) x (B) y",
                                                   "category": "direct_attributes"}) + "\n")


@pytest.mark.parametrize("name,make,match", [
    ("hrbench", _corrupt_parquet, r"test-00000-of-00001\.parquet is not a readable parquet file"),
    ("pyvision-image-rl", _corrupt_parquet, r"test-00000-of-00001\.parquet is not a readable"),
    ("vstar", Path.mkdir, "no data for 'vstar'"),
    ("vstar", _vstar_without_label, r"test\.jsonl:1: missing column 'label'"),
])
def test_a_failed_import_leaves_no_output_behind(tmp_path, name, make, match):
    make(tmp_path / "copy")
    with pytest.raises(DataError, match=match):
        hub.import_dataset(name, tmp_path / "copy", tmp_path / "new" / "out")
    assert not (tmp_path / "new").exists()  # nor the parent folder the import would have made
    existing = tmp_path / "existing"
    (existing / "raw").mkdir(parents=True)  # e.g. `data download`'s files
    with pytest.raises(DataError, match=match):
        hub.import_dataset(name, tmp_path / "copy", existing)
    assert [p.name for p in existing.iterdir()] == ["raw"]


@pytest.mark.parametrize("strict", [False, True])
def test_a_failed_import_into_an_earlier_one_leaves_it_as_it_was(tmp_path, strict):
    # The second import's rows were converted after the earlier tasks.jsonl had been emptied and
    # the media link pointed at the failed copy: the earlier import was gone, its manifest left.
    row = {"id": "t1", "question": "What is 1+1?", "answer": "2", "image_path": "images/a.png"}
    _img(tmp_path / "good" / "images" / "a.png")
    (tmp_path / "good" / "rows.jsonl").write_text(json.dumps(row) + "\n")
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "rows.jsonl").write_text(
        json.dumps(row | {"image_path": "images/missing.png"}) + "\n")
    out = tmp_path / "imp"
    hub.import_dataset("pyvision-image-rl", tmp_path / "good", out)
    before = {p.name: (os.readlink(p) if p.is_symlink() else p.read_bytes())
              for p in out.iterdir()}
    with pytest.raises(DataError, match="missing.png"):
        hub.import_dataset("pyvision-image-rl", tmp_path / "bad", out, strict=strict)
    assert {p.name: (os.readlink(p) if p.is_symlink() else p.read_bytes())
            for p in out.iterdir()} == before
    made = tmp_path / "made"  # an empty --out made beforehand keeps nothing of a failed import
    made.mkdir()
    with pytest.raises(DataError, match="missing.png"):
        hub.import_dataset("pyvision-image-rl", tmp_path / "bad", made, strict=strict)
    assert list(made.iterdir()) == []


def _conversations(folder: Path, lines: list[str]) -> Path:
    _img(folder / "media" / "a.png", size=(28, 28))
    (folder / "conversations.jsonl").write_text("\n".join(lines) + "\n")
    return folder


GOOD_CONVERSATION = json.dumps({"id": "c1", "data_source": "synth", "images": ["media/a.png"],
                                "messages": [{"role": "user", "content": "<image>Colour?"},
                                             {"role": "assistant", "content": "red"}]})


def test_cli_export_llamafactory_names_skipped_rows_and_fails_when_none_is_left(tmp_path):
    from typer.testing import CliRunner

    from pyvision_cli.main import app

    runner = CliRunner()
    src = _conversations(tmp_path / "src", [GOOD_CONVERSATION, '{"id": "c2", "messages": ['])
    out = tmp_path / "lf"
    result = runner.invoke(app, ["data", "export", "--format", "llamafactory", "--source",
                                 str(src), "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert (f"warning: skipped 1 row: 1 malformed_json; first: {src / 'conversations.jsonl'}:2: "
            "malformed JSON") in result.stderr.replace("\n", "")
    assert len((out / "pyvision_sft.jsonl").read_text().splitlines()) == 1
    bad = _conversations(tmp_path / "bad", ['{"id": "c2", "messages": ['])
    result = runner.invoke(app, ["data", "export", "--format", "llamafactory", "--source",
                                 str(bad), "--out", str(tmp_path / "none")])
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: no usable conversation in {bad} "
                                                   "(skipped 1 row: 1 malformed_json; first: ")
    assert not (tmp_path / "none").exists()
