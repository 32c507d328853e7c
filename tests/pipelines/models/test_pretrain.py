"""Pretraining the tiny base: the curriculum is a pure function of (seed, index), the encoder
trains only what it should, a short run repeats byte for byte and resumes exactly, and the shipped
base meets the probe's thresholds."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipelines.config.model import PretrainConfig
from pipelines.models.curriculum import (
    FAMILIES,
    IMAGE,
    example_rng,
    make_example,
    random_token_copy,
    stream_example,
)
from pipelines.models.encoding import Encoder
from pipelines.models.pretrain import MANIFEST, file_digests, pretrain, shipped_base


def test_examples_are_a_function_of_seed_family_and_index():
    for fam in FAMILIES:
        a, b = make_example(3, fam, 17), make_example(3, fam, 17)
        assert a.pieces == b.pieces and a.text
        assert make_example(4, fam, 17).pieces != a.pieces
    mix = PretrainConfig().mixture
    # Example i of the stream does not depend on the batch it lands in, or on how many follow.
    assert [stream_example(0, i, mix, 8).family for i in range(40)] == \
        [stream_example(0, i, mix, 8).family for i in range(40)]
    assert all(stream_example(0, i, mix, 8).family == "copy" for i in range(8))
    assert {stream_example(0, i, mix, 0).family for i in range(200)} == set(mix)
    both = {**mix, "table_code": 0.2}
    assert {stream_example(0, i, both, 0).family for i in range(200)} == set(FAMILIES)


def _untrained_text(ex) -> str:
    return "".join(t for t, trained in ex.pieces if not trained and isinstance(t, str))


def test_a_context_comes_before_the_example_and_is_not_trained():
    from pipelines.models.curriculum import CONTEXT_FAMILIES, USER

    for fam in CONTEXT_FAMILIES:
        for i in range(30):
            plain, behind = make_example(5, fam, i), make_example(5, fam, i, context_share=1.0)
            assert behind.target == plain.target  # the same reply, trained the same way
            assert len(_untrained_text(behind)) > len(_untrained_text(plain))
            # The context goes before the question: after the chat's opening, else first.
            opening = plain.pieces[0][0]
            chat_opening = isinstance(opening, str) and opening.endswith(USER)
            if chat_opening:
                assert behind.text.startswith(opening)
            assert behind.text.endswith(plain.text[len(opening) if chat_opening else 0:])
    # At 0 (the default) every example is the one the shipped base was pretrained on.
    assert all(make_example(5, f, i, context_share=0.0) == make_example(5, f, i)
               for f in CONTEXT_FAMILIES for i in range(10))


def test_a_table_code_reply_names_every_option_in_order():
    import re

    from pipelines.models.probe import TABLE_ENTRY

    for i in range(40):
        ex = make_example(1, "table_code", i)
        options = re.findall(r"\(([A-D])\) ([a-z]+)", ex.text.split("<|im_start|>assistant")[0])
        assert 2 <= len(options) <= 4
        assert TABLE_ENTRY.findall(ex.target) == options


def test_encoder_trains_only_the_trained_pieces(tiny_model_dir):
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(tiny_model_dir)
    encode = Encoder(processor, max_tokens=4096)
    ex = random_token_copy(example_rng(0, "t", 0), lo=8, hi=8, repeats=2)
    enc = encode(ex)
    span = enc.ids[:8]
    special = set(processor.tokenizer.all_special_ids)
    assert not special & set(span)  # random draws land on regular tokens only
    trained = [t for t, lab in zip(enc.ids, enc.labels) if lab != -100]
    assert trained[:8] == span and trained[-9:-1] == span  # both repeats, not the original
    assert all(lab == -100 for lab in enc.labels[:8])
    picture = next(make_example(0, "image_text", i) for i in range(50)
                   if IMAGE in make_example(0, "image_text", i).text)
    enc = encode(picture)
    pad = processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    assert enc.ids.count(pad) == int(enc.grid.prod()) // 4  # one token per 2x2 merged patch
    answer = picture.pieces[-3][0]
    trained_text = processor.tokenizer.decode([t for t, lab in zip(enc.ids, enc.labels)
                                               if lab != -100])
    assert trained_text.startswith(answer) and "<|vision_start|>" not in trained_text


SHORT = PretrainConfig(steps=6, induction_steps=2, batch_size=4, warmup_steps=2, save_every=3,
                       log_every=2, max_tokens=96)


def _run(tmp: Path, name: str, *, resume: bool = False) -> Path:
    out = tmp / name / "model"
    pretrain(SHORT, size="nano", seed=0, out=out, work=tmp / name, resume=resume, probe_n=2,
             show_progress=False)
    return out


@pytest.mark.slow
def test_a_short_pretraining_repeats_byte_for_byte_and_resumes_exactly(tmp_path):
    import shutil

    a, b = _run(tmp_path, "a"), _run(tmp_path, "b")
    assert file_digests(a) == file_digests(b)
    manifest = json.loads((a / MANIFEST).read_text())
    assert manifest["sha256"] == file_digests(a) and manifest["config"]["steps"] == 6
    # Resume from the step-3 checkpoint of a run: the same final weights as the straight run.
    (tmp_path / "c" / "checkpoints").mkdir(parents=True)
    shutil.copytree(tmp_path / "a" / "checkpoints" / "step_3",
                    tmp_path / "c" / "checkpoints" / "step_3")
    c = _run(tmp_path, "c", resume=True)
    assert file_digests(c)["model.safetensors"] == file_digests(a)["model.safetensors"]


@pytest.mark.slow
def test_continued_pretraining_starts_from_the_init_model(tmp_path):
    from safetensors.torch import load_file

    start = _run(tmp_path, "start")
    cfg = SHORT.model_copy(update={"init": str(start), "steps": 2, "induction_steps": 0,
                                   "learning_rate": 1e-12, "context_share": 0.5,
                                   "mixture": {"lookup": 0.5, "table_code": 0.5}})
    out = tmp_path / "cont" / "model"
    manifest = pretrain(cfg, size="nano", seed=7, out=out, work=tmp_path / "cont", probe_n=2,
                        show_progress=False)
    assert manifest["init"]["path"] == str(start)
    assert manifest["init"]["sha256"] == file_digests(start)
    assert manifest["init"]["manifest"]["config"]["steps"] == SHORT.steps
    # A step of 1e-12 leaves the init's weights (a random init at seed 7 would not be near them).
    before, after = load_file(start / "model.safetensors"), load_file(out / "model.safetensors")
    assert before.keys() == after.keys()
    assert max(float((before[k] - after[k]).abs().max()) for k in before) < 1e-6
    assert (start / "tokenizer.json").read_bytes() == (out / "tokenizer.json").read_bytes()


def test_the_shipped_base_meets_the_probe_thresholds():
    from pipelines.models.probe import THRESHOLDS, probe_path

    base = shipped_base("small")
    result = probe_path(base, n=50, seed=1)
    assert result["meets_thresholds"], result["scores"]
    manifest = json.loads((base / MANIFEST).read_text())
    assert manifest["sha256"] == file_digests(base)
    assert set(manifest["probe"]) == set(THRESHOLDS)


def test_the_shipped_base_is_checked_before_it_is_used(tmp_path, monkeypatch):
    import shutil

    from pipelines.errors import UserError
    from pipelines.models import pretrain as pt
    from pipelines.models.pretrain import copy_shipped_base

    copy = copy_shipped_base("small", tmp_path / "ok")
    assert file_digests(copy) == file_digests(shipped_base("small"))
    with pytest.raises(UserError, match="no pretrained tiny base of size 'nano'"):
        copy_shipped_base("nano", tmp_path / "none")
    broken = tmp_path / "weights" / "tiny-small"
    shutil.copytree(shipped_base("small"), broken)
    (broken / "config.json").write_text("{}")
    monkeypatch.setattr(pt, "shipped_base", lambda size: broken)
    with pytest.raises(UserError, match="does not match its manifest"):
        copy_shipped_base("small", tmp_path / "bad")
    assert not (tmp_path / "bad").exists()


@pytest.mark.slow
def test_pretrain_json_is_the_stage_manifest_whether_it_trained_now_or_before(tmp_path,
                                                                              monkeypatch):
    # A script reads the same shape either way (a fresh run used to print the training
    # manifest, without the model's folder or the run id).
    from typer.testing import CliRunner

    from pyvision_cli.main import app

    monkeypatch.chdir(tmp_path)
    short = [f"model.pretrain.{k}={v}" for k, v in SHORT.model_dump().items()
             if k in ("steps", "induction_steps", "batch_size", "warmup_steps", "save_every",
                      "log_every", "max_tokens")]
    args = ["model", "pretrain", "--out", str(tmp_path / "m"), "--json",
            "--set", "model.tiny.size=nano", *[a for s in short for a in ("--set", s)]]
    fresh, again = CliRunner().invoke(app, args), CliRunner().invoke(app, args)
    assert fresh.exit_code == 0 and again.exit_code == 0, fresh.output + again.output
    assert json.loads(fresh.stdout) == json.loads(again.stdout)
    stage = json.loads(fresh.stdout)
    assert stage["outputs"]["model"] == str(tmp_path / "m") and stage["stage"] == "pretrain"
    assert set(stage["summary"]) >= {"final_loss", "probe/copy"}


def test_probe_prints_every_skill_and_thresholds_only_those_that_have_one():
    from typer.testing import CliRunner

    from pipelines.models.probe import SKILLS, THRESHOLDS
    from pyvision_cli.main import app

    result = CliRunner().invoke(app, ["model", "probe", str(shipped_base("small")), "--n", "6",
                                      "--json"])
    assert result.exit_code == 0, result.output
    scores = json.loads(result.stdout)["scores"]
    assert list(scores) == list(SKILLS)
    lines = result.stderr.splitlines()
    for skill in SKILLS:
        line = next(x for x in lines if x.startswith(skill + " "))
        assert ("threshold" in line and "no threshold" not in line) == (skill in THRESHOLDS)
    # The shipped base was pretrained without contexts: it looks nothing up behind the prompt.
    assert scores["lookup_far"] == 0.0 and scores["table_copy"] == 0.0
