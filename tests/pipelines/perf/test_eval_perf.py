"""`pyvision perf eval` prints the promised JSON (shape and counts only: timings would flake)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from pyvision_cli.perf import app


def test_perf_eval_json_shape(tiny_model_dir: Path) -> None:
    result = CliRunner().invoke(app, ["eval", "--json", "--model", str(tiny_model_dir),
                                      "--n-image", "2", "--n-video", "1", "--max-new-tokens", "8",
                                      "--max-turns", "2"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["model"]["path"] == str(tiny_model_dir) and data["model"]["parameters"] > 0
    assert data["settings"]["max_new_tokens_per_turn"] == 8
    assert data["settings"]["draft_tokens"] == 8  # agent.draft_tokens' default
    assert data["settings"]["torch_threads"] == 1  # agent.cpu_threads' default
    assert data["model"]["dtype"] == "float32"
    # --device auto: the GPU where torch sees one
    assert data["model"]["device"] == ("cuda:0" if torch.cuda.is_available() else "cpu")
    families = data["families"]
    assert {f: row["benchmark"] for f, row in families.items()} == {
        "image": "synth-image", "video": "synth-video"}
    for family, n in (("image", 2), ("video", 1)):
        model, scripted = families[family]["model"], families[family]["scripted"]
        assert model["n"] == scripted["n"] == n
        assert model["samples_per_s"] > 0 and scripted["samples_per_s"] > 0
        assert sum(model["stop_reasons"].values()) == n
        # The scripted policy makes exactly one real sandbox call per sample, then answers.
        assert (scripted["mean_turns"], scripted["mean_tool_calls"]) == (2, 1)
        assert scripted["stop_reasons"] == {"answered": n}
        assert 0.0 <= model["accuracy"] <= 1.0
        work = model["work"]  # every sample prefilled its prompt and decoded at least a token
        assert work["prefill_slots"] >= work["tokens_prefilled"] > 0
        assert work["decode_rows"] >= work["decode_steps"] > 0
        assert work["decode_keys"] > work["decode_rows"]
        assert work["draft_tokens"] >= work["draft_kept"] >= 0
        assert "work" not in scripted
        for row in (model, scripted):  # the tree holds this process (/proc counts in ticks)
            assert row["cpu"]["tree_s"] >= row["cpu"]["process_s"] - 0.03 > 0
            assert row["cpu"]["cpu_bound_samples_per_s"] == pytest.approx(
                n * data["settings"]["cpus"] / row["cpu"]["tree_s"], rel=0.05)
            # The evaluating thread's own share (Linux keeps it): within the process's.
            assert 0 < row["cpu"]["thread_on_cpu_s"] <= row["cpu"]["process_s"] + 0.05
            assert row["cpu"]["thread_runqueue_s"] >= 0
    # The scripted rows' sandbox calls ran in other processes (each is tens of ms of CPU there):
    # the trees used more than this process alone.
    assert sum(families[f]["scripted"]["cpu"]["tree_s"] - families[f]["scripted"]["cpu"]["process_s"]
               for f in families) > 0.1
    assert families["image"]["model"]["mean_visual_tokens"] > 0
    assert families["video"]["model"]["mean_visual_tokens"] == 0  # on-demand video context
    # A video prompt is text until its question: its instructions went through the model once,
    # as a prompt head that its first turn continued.
    assert families["video"]["model"]["work"]["tokens_shared"] > 100


def test_perf_eval_turns_off_drafts_and_shared_heads_and_loads_a_dtype(tiny_model_dir: Path) -> None:
    result = CliRunner().invoke(app, ["eval", "--json", "--model", str(tiny_model_dir),
                                      "--n-image", "2", "--n-video", "1", "--max-new-tokens", "8",
                                      "--max-turns", "2", "--draft-tokens", "0",
                                      "--dtype", "bfloat16", "--threads", "2",
                                      "--no-share-prefixes"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["settings"]["draft_tokens"] == 0
    assert data["settings"]["torch_threads"] == 2
    assert data["model"]["dtype"] == "bfloat16"  # the model measured is the one asked for
    work = data["families"]["image"]["model"]["work"]
    assert work["draft_tokens"] == work["draft_kept"] == 0 and work["decode_steps"] > 0
    # --no-share-prefixes: the video prompt's instructions go through the model with it.
    assert data["settings"]["share_prefixes"] is False
    assert data["families"]["video"]["model"]["work"]["tokens_shared"] == 0


def test_perf_eval_text_names_the_cpu_bound(tiny_model_dir: Path) -> None:
    result = CliRunner().invoke(app, ["eval", "--model", str(tiny_model_dir), "--n-image", "1",
                                      "--n-video", "0", "--max-new-tokens", "8",
                                      "--max-turns", "2"])
    assert result.exit_code == 0, result.output
    out = result.output  # after the model loading's progress bars; the console wraps lines
    text = " ".join(out[out.index("image (synth-image): model "):].split())
    assert "video" not in text
    assert text.count("its CPU time allows at most") == 2 and "cores)" in text


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message where there is no GPU")
def test_perf_eval_on_cuda_without_a_gpu_is_a_clear_error(tiny_model_dir: Path) -> None:
    result = CliRunner().invoke(app, ["eval", "--json", "--model", str(tiny_model_dir),
                                      "--n-image", "1", "--n-video", "0", "--device", "cuda"])
    assert result.exit_code == 2
    assert "torch sees no GPU" in result.output and "--device cpu" in result.output
    assert "{" not in result.stdout  # no JSON half-printed


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_perf_eval_runs_the_model_on_cuda(tiny_model_dir: Path) -> None:
    """The evaluation path on a GPU: batched greedy turns with drafts checked on CUDA (the
    sandboxes stay on the CPU), every sample ending with a reason."""
    result = CliRunner().invoke(app, ["eval", "--json", "--model", str(tiny_model_dir),
                                      "--n-image", "3", "--n-video", "2", "--max-new-tokens", "16",
                                      "--max-turns", "2", "--batch-size", "2",
                                      "--device", "cuda"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["model"]["device"] == "cuda:0" and data["settings"]["draft_tokens"] == 8
    for family, n in (("image", 3), ("video", 2)):
        model = data["families"][family]["model"]
        assert model["n"] == n and sum(model["stop_reasons"].values()) == n
        assert model["work"]["decode_steps"] > 0 and model["mean_total_tokens"] > 0
