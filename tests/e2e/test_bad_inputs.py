"""Bad inputs, as a new user makes them: each ends in exit code 2 and one `error:` line that names
the bad thing, with no traceback, and leaves nothing behind (no store, no run folder, no output).

Every case runs the real `pyvision` command line in-process (Typer's CliRunner) from an empty
working directory holding only the case's inputs; the store is `$PYVISION_STORE` in that folder
(tests/conftest.py). The inputs are small files written for each case: nothing here loads a model,
so the whole module takes seconds.
"""

from __future__ import annotations

import json
import os
import struct
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
from typer.testing import CliRunner

from pyvision_cli.main import app
from tests.helpers import REPO

runner = CliRunner()
RECIPES = REPO / "pipelines" / "recipes"
TINY = str(RECIPES / "tiny-cpu.yaml")


# -- inputs -----------------------------------------------------------------------------------------


def png_bytes(width: int = 8, height: int = 6, rgb: tuple[int, int, int] = (200, 30, 30)) -> bytes:
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (width, height), rgb).save(buf, format="PNG")
    return buf.getvalue()


def bomb_png(width: int = 30000, height: int = 30000) -> bytes:
    """A 200-byte PNG whose header claims 900 megapixels (PIL refuses it as a decompression
    bomb on open; a reader that decoded it would need 2.7 GB)."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return (struct.pack(">I", len(data)) + kind + data
                + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr)
            + chunk(b"IDAT", zlib.compress(b"\0" * 1024)) + chunk(b"IEND", b""))


def safetensors_bytes(truncate: int = 0) -> bytes:
    header = json.dumps({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}).encode()
    data = struct.pack("<Q", len(header)) + header + b"\0" * 16
    return data[: len(data) - truncate] if truncate else data


def task_row(i: int = 0, image: str = "media/a.png", **extra) -> dict:
    return {"id": f"t{i}", "data_source": "synth/image-search", "question": "What colour?",
            "images": [image], "answer": "red", "answer_type": "text", "split": "heldout",
            "metadata": {"family": "color"}, **extra}


def write_tasks(folder: Path, lines: list[bytes | dict], media: dict[str, bytes] | None = None
                ) -> Path:
    (folder / "media").mkdir(parents=True, exist_ok=True)
    for name, data in (media or {"a.png": png_bytes()}).items():
        (folder / "media" / name).write_bytes(data)
    (folder / "tasks.jsonl").write_bytes(b"".join(
        (line if isinstance(line, bytes) else json.dumps(line).encode()) + b"\n"
        for line in lines))
    return folder


def make_inputs(inp: Path) -> None:
    """Every input the cases below name, good and bad, under ``inp``."""
    inp.mkdir()
    (inp / "latin1.yaml").write_bytes(b"name: caf\xe9\nseed: 1\n")
    (inp / "list.yaml").write_text("- name\n- seed\n")
    (inp / "broken.yaml").write_text("name: x\nrl: [1, 2\n")
    (inp / "unknown-key.yaml").write_text("name: x\nrl:\n  lerning_rate: 0.1\n")
    (inp / "a-file").write_text("not a folder\n")
    (inp / "code-latin1.py").write_bytes(b"print('caf\xe9')\n")
    (inp / "code.py").write_text("print('hello')\n")
    (inp / "preds-latin1.jsonl").write_bytes(
        b'{"id": "1", "question": "q", "answer": "A", "prediction": "caf\xe9"}\n')
    (inp / "preds-broken.jsonl").write_text('{"id": "1", "prediction": "A"}\n{"id": \n')
    (inp / "preds-empty.jsonl").write_text("")
    (inp / "not-duckdb.duckdb").write_text("this is not a database\n" * 4)
    (inp / "empty.duckdb").write_bytes(b"")
    (inp / "store-dir").mkdir()
    (inp / "corrupt.png").write_bytes(b"\x89PNG\r\n\x1a\n not really")
    (inp / "bomb.png").write_bytes(bomb_png())
    (inp / "good.png").write_bytes(png_bytes())
    write_tasks(inp / "tasks", [task_row(0), task_row(1)])
    write_tasks(inp / "tasks-broken-json", [task_row(0), b'{"id": "t1", "question": ', task_row(2)])
    write_tasks(inp / "tasks-latin1", [task_row(0), b'{"id": "t1", "question": "caf\xe9"}'])
    write_tasks(inp / "tasks-missing-media", [task_row(0, image="media/nope.png")])
    write_tasks(inp / "tasks-name-too-long", [task_row(0), task_row(1, image="media/" + "x" * 300 + ".png")])
    write_tasks(inp / "tasks-bomb", [task_row(0, image="media/bomb.png")],
                media={"bomb.png": bomb_png()})
    write_tasks(inp / "tasks-empty", [])
    write_tasks(inp / "tasks-corrupt-image", [task_row(0), task_row(1, image="media/bad.png")],
                media={"a.png": png_bytes(), "bad.png": b"\x89PNG\r\n\x1a\n not really"})
    (inp / "model-empty").mkdir()
    (inp / "model-no-weights").mkdir()
    (inp / "model-no-weights" / "config.json").write_text('{"model_type": "qwen2_5_vl"}')
    (inp / "model-bad-config").mkdir()
    (inp / "model-bad-config" / "config.json").write_text('{"model_type": ')
    (inp / "model-bad-config" / "model.safetensors").write_bytes(safetensors_bytes())
    for name, data in (("model-truncated", safetensors_bytes(truncate=5)),
                       ("model-garbage", b"\x00" * 64)):
        (inp / name).mkdir()
        (inp / name / "config.json").write_text('{"model_type": "qwen2_5_vl"}')
        (inp / name / "model.safetensors").write_bytes(data)
    (inp / "model-ok").mkdir()
    (inp / "model-ok" / "config.json").write_text('{"model_type": "qwen2_5_vl"}')
    (inp / "model-ok" / "model.safetensors").write_bytes(safetensors_bytes())
    for name, file, data in (("model-torn-tokenizer", "tokenizer.json", b'{"version": "1.0",\n "model": {'),
                             ("model-template-latin1", "chat_template.jinja", b"{{ 'caf\xe9' }}"),
                             ("model-no-type", "config.json", b'{"architectures": []}')):
        (inp / name).mkdir()
        (inp / name / "config.json").write_text('{"model_type": "qwen2_5_vl"}')
        (inp / name / "model.safetensors").write_bytes(safetensors_bytes())
        (inp / name / file).write_bytes(data)
    (inp / "sft-data").mkdir()
    (inp / "sft-data" / "dataset_info.json").write_text('{"pyvision_sft": {"file_name": "t.jsonl"}}')
    (inp / "sft-data" / "t.jsonl").write_text("")
    (inp / "sft-data-no-file").mkdir()
    (inp / "sft-data-no-file" / "dataset_info.json").write_text('{"pyvision_sft": {"file_name": "nope.json"}, "x": "y"}')
    (inp / "sft-data-folder" / "dataset_info.json").mkdir(parents=True)
    (inp / "sft-data-no-media").mkdir()
    (inp / "sft-data-no-media" / "dataset_info.json").write_text(json.dumps({"pyvision_sft": {
        "file_name": "t.jsonl", "formatting": "sharegpt",
        "columns": {"messages": "conversations", "images": "images"}}}))
    (inp / "sft-data-no-media" / "t.jsonl").write_text(
        json.dumps({"conversations": [], "images": []}) + "\n"
        + json.dumps({"conversations": [], "images": ["../trajectories/media/a.png"]}) + "\n")
    (inp / "sft-data-bad-row").mkdir()
    (inp / "sft-data-bad-row" / "dataset_info.json").write_text('{"pyvision_sft": {"file_name": "t.jsonl"}}')
    (inp / "sft-data-bad-row" / "t.jsonl").write_text('{"conversations": []}\n{"conv\n')
    (inp / "sft-data-broken").mkdir()
    (inp / "sft-data-broken" / "dataset_info.json").write_text('{"pyvision_sft": ')
    (inp / "corrupt-parquet").mkdir()
    (inp / "corrupt-parquet" / "test-00000-of-00001.parquet").write_bytes(bytes(range(256)) * 8)
    (inp / "vstar-no-label").mkdir()
    (inp / "vstar-no-label" / "test.jsonl").write_text(
        '{"question_id": 0, "text": "Which? (A) x (B) y", "category": "direct_attributes"}\n')
    (inp / "conversations-broken").mkdir()
    (inp / "conversations-broken" / "conversations.jsonl").write_text('{"id": "c1", "messages": [\n')
    (inp / "lora-broken").mkdir()
    (inp / "lora-broken" / "adapter_config.json").write_text('{"peft_type": "LORA", "r": ')


@dataclass(frozen=True)
class Case:
    argv: str
    """The command line after `pyvision`; {i} is the inputs folder."""
    names: tuple[str, ...]
    """What the error line must contain (the bad thing, named)."""
    setup: Callable[[Path], None] | None = None


M_OK = "--model {i}/model-ok"
EVAL = f"eval -c {TINY} --benchmarks synth-image --data-dir {{i}}/tasks"
RL = "rl --tasks {i}/tasks --run-id r1"

CASES: dict[str, Case] = {
    # recipes and --set
    "recipe-not-utf8": Case("rl -c {i}/latin1.yaml", ("latin1.yaml:1", "not UTF-8", "0xe9")),
    "recipe-missing": Case("rl -c {i}/nope.yaml", ("recipe not found", "nope.yaml")),
    "recipe-is-folder": Case("rl -c {i}/store-dir", ("config file", "store-dir", "not a file")),
    "recipe-broken-yaml": Case("sft -c {i}/broken.yaml", ("invalid YAML", "broken.yaml:")),
    "recipe-is-a-list": Case("rl -c {i}/list.yaml", ("list.yaml", "mapping")),
    "recipe-unknown-key": Case("rl -c {i}/unknown-key.yaml", ("rl.lerning_rate", "rl.learning_rate")),
    "set-unknown-key": Case("rl --set rl.lerning_rate=1", ("rl.lerning_rate", "rl.learning_rate")),
    "set-without-equals": Case("rl --set rl.learning_rate", ("--set expects dotted.key=value",)),
    "set-bad-value": Case("rl --set rl.learning_rate=fast", ("rl.learning_rate", "--set rl.learning_rate=VALUE")),
    "set-out-of-bounds": Case("sft --set seed=-1", ("'seed'",)),
    "run-recipe-missing": Case("run {i}/nope.yaml", ("recipe not found", "nope.yaml")),
    "run-bad-from": Case(f"run {TINY} --from training", ("'--from'", "training")),
    # `run` has no --model to pass: its hint names the earlier stages
    "run-sft-without-data": Case(f"run {TINY} --run-id fresh --from sft --until sft", ("no base model for run 'fresh'", "run the earlier stages first (pyvision run RECIPE --run-id fresh)")),
    "run-rl-without-data": Case(f"run {TINY} --run-id fresh --from rl --until rl", ("no model to start RL from in run 'fresh'", "run the earlier stages first (pyvision run RECIPE --run-id fresh)")),
    "run-eval-without-models": Case(f"run {TINY} --run-id fresh --from eval --until eval", ("run 'fresh' has no model to evaluate",)),
    "run-report-of-nothing": Case(f"run {TINY} --run-id fresh --from report", ("run 'fresh' has nothing to report",)),
    "run-from-after-until": Case(f"run {TINY} --from rl --until sft", ("--from rl comes after --until sft",)),
    # run ids: one rule for every command
    "eval-run-id-traversal": Case(f"{EVAL} {M_OK} --run-id ../../etc", ("../../etc", "not a valid run id")),
    "rl-run-id-space": Case("rl --run-id 'a b'", ("'a b'", "not a valid run id")),
    "sft-run-id-empty": Case("sft --run-id ''", ("--run-id is empty",)),
    "run-run-id-slash": Case(f"run {TINY} --run-id a/b", ("'a/b'", "not a valid run id")),
    "prepare-base-model-missing": Case("data prepare --run-id p1 --set model.tiny=null --set model.base={i}/nope", ("model.base not found", "nope")),
    "prepare-pretrain-init-missing": Case("data prepare --run-id p1 --set model.tiny.init=pretrain --set model.pretrain.init={i}/nope", ("model.pretrain.init", "nope", "is not a model folder")),
    "run-base-model-missing": Case(f"run {TINY} --run-id p1 --set model.tiny=null --set model.base={{i}}/model-empty", ("model.base folder", "model-empty", "is empty")),
    "run-unknown-dataset": Case(f"run {TINY} --run-id d2 --until data --set 'data.datasets=[nope]'", ("unknown dataset 'nope'",)),
    "run-sft-source-missing": Case(f"run {TINY} --run-id d1 --until data --set 'data.sft_sources=[scripted, {{i}}/nope]'", ("conversations file not found", "nope")),
    "run-distill-tasks-missing": Case(f"run {TINY} --run-id d3 --until data --set data.distill.teacher=http://127.0.0.1:9/v1 --set 'data.distill.tasks=[{{i}}/nope]'", ("tasks file not found", "nope")),
    "run-teacher-down": Case(f"run {TINY} --run-id d4 --until data --set data.distill.teacher=http://127.0.0.1:9/v1", ("teacher http://127.0.0.1:9/v1", "does not answer")),
    "prepare-run-id-dots": Case("data prepare --run-id ..", ("'..'", "not a valid run id")),
    "score-run-id-traversal": Case("eval score --benchmark vstar --run-id ../x", ("'../x'", "not a valid run id")),
    "eval-run-id-newline": Case(f"{EVAL} {M_OK} --run-id $'a\\nb'", ("not a valid run id",)),
    # eval arguments
    "eval-no-model": Case("eval --benchmarks vstar", ("--model is required",)),
    "eval-benchmarks-comma": Case(f"eval {M_OK} --benchmarks ,", ("--benchmarks ','", "names no benchmark")),
    "eval-benchmarks-spaces": Case(f"eval {M_OK} --benchmarks ' , '", ("names no benchmark",)),
    "eval-benchmarks-empty-set": Case(f"{EVAL.split(' --benchmarks')[0]} {M_OK} --set eval.benchmarks=[]", ("no benchmark to evaluate",)),
    "eval-unknown-benchmark": Case(f"eval {M_OK} --benchmarks vstr", ("unknown benchmark 'vstr'", "vstar")),
    "eval-unknown-engine": Case(f"eval {M_OK} --engine tgi", ("'--engine'", "tgi")),
    "eval-unknown-harness": Case(f"eval {M_OK} --harness lmms", ("'--harness'", "lmms")),
    "eval-limit-zero": Case(f"{EVAL} {M_OK} --limit 0", ("'--limit'",)),
    "eval-max-turns-text": Case(f"{EVAL} {M_OK} --max-turns many", ("'--max-turns'", "valid integer")),
    "eval-data-dir-missing": Case(f"eval -c {TINY} {M_OK} --benchmarks synth-image --data-dir {{i}}/nope", ("--data-dir", "nope", "not found")),
    "eval-data-dir-file": Case(f"eval -c {TINY} {M_OK} --benchmarks synth-image --data-dir {{i}}/a-file", ("a-file",)),
    "eval-data-dir-empty": Case(f"eval -c {TINY} {M_OK} --benchmarks synth-image --data-dir {{i}}/tasks-empty", ("tasks-empty",)),
    "eval-tasks-broken-json": Case(f"eval -c {TINY} {M_OK} --benchmarks synth-image --data-dir {{i}}/tasks-broken-json", ("tasks.jsonl:2", "malformed JSON")),
    "eval-tasks-not-utf8": Case(f"eval -c {TINY} {M_OK} --benchmarks synth-image --data-dir {{i}}/tasks-latin1", ("tasks.jsonl:2", "not UTF-8")),
    "eval-tasks-missing-media": Case(f"eval -c {TINY} {M_OK} --benchmarks synth-image --data-dir {{i}}/tasks-missing-media", ("tasks.jsonl:1", "nope.png")),
    "eval-corrupt-parquet": Case(f"eval -c {TINY} {M_OK} --benchmarks vstar --data-dir {{i}}/corrupt-parquet", ("test-00000-of-00001.parquet", "not a readable parquet file")),
    "eval-decompression-bomb": Case(f"eval -c {TINY} {M_OK} --benchmarks synth-image --data-dir {{i}}/tasks-bomb", ("bomb.png", "cannot be read")),
    "eval-openai-local-folder": Case(f"{EVAL} {M_OK} --engine openai", ("model server", "model-ok", "is not a server URL")),
    "eval-served-model-local-folder": Case(f"{EVAL} {M_OK} --served-model qwen", ("--served-model names a model on a server",)),
    "eval-include-path-without-lmms": Case(f"{EVAL} {M_OK} --include-path {{i}}", ("--include-path only applies",)),
    # models
    "eval-model-missing": Case(f"{EVAL} --model {{i}}/nope", ("model not found", "nope")),
    "eval-model-bare-name": Case(f"{EVAL} --model x", ("model not found: x",)),
    "eval-model-is-file": Case(f"{EVAL} --model {{i}}/a-file", ("a-file", "not a model folder")),
    "eval-model-empty-folder": Case(f"{EVAL} --model {{i}}/model-empty", ("model-empty", "is empty")),
    "eval-model-no-weights": Case(f"{EVAL} --model {{i}}/model-no-weights", ("model-no-weights", "no weights")),
    "eval-model-bad-config": Case(f"{EVAL} --model {{i}}/model-bad-config", ("config.json:1", "malformed JSON")),
    "eval-model-torn-tokenizer": Case(f"{EVAL} --model {{i}}/model-torn-tokenizer", ("tokenizer.json:2", "malformed JSON")),
    "eval-model-template-not-utf8": Case(f"{EVAL} --model {{i}}/model-template-latin1", ("chat_template.jinja:1", "not UTF-8")),
    "eval-model-no-model-type": Case(f"{EVAL} --model {{i}}/model-no-type", ("config.json has no 'model_type'",)),
    "rl-model-torn-tokenizer": Case(f"{RL} --model {{i}}/model-torn-tokenizer", ("tokenizer.json:2", "malformed JSON")),
    "eval-model-truncated-safetensors": Case(f"{EVAL} --model {{i}}/model-truncated", ("model.safetensors", "truncated")),
    "eval-model-garbage-safetensors": Case(f"{EVAL} --model {{i}}/model-garbage", ("model.safetensors", "no valid safetensors header")),
    "rl-model-empty-folder": Case(f"{RL} --model {{i}}/model-empty", ("model-empty", "is empty")),
    "rl-model-truncated-safetensors": Case(f"{RL} --model {{i}}/model-truncated", ("model.safetensors", "truncated")),
    "rl-tasks-missing": Case(f"rl {M_OK} --tasks {{i}}/nope --run-id r1", ("tasks file not found", "nope")),
    "rl-tasks-empty": Case(f"rl {M_OK} --tasks {{i}}/tasks-empty --run-id r1", ("no usable RL prompts", "tasks-empty")),
    "rl-tasks-not-utf8": Case(f"rl {M_OK} --tasks {{i}}/tasks-latin1 --run-id r1", ("tasks.jsonl:2", "not UTF-8")),
    "rl-tasks-corrupt-image": Case(f"rl {M_OK} --tasks {{i}}/tasks-corrupt-image --run-id r1", ("RL prompts", "row 't1'", "corrupt image", "bad.png")),
    "rl-sanity-and-dry-run": Case("rl --sanity --dry-run", ("--sanity and --dry-run cannot be combined",)),
    "rl-no-model": Case("rl --run-id r1 --tasks {i}/tasks", ("no model to start RL from in run 'r1'", "--model")),
    "rl-unknown-engine": Case("rl --engine ray", ("'--engine'", "ray")),
    "sft-model-garbage": Case("sft --model {i}/model-garbage --dataset-dir {i}/sft-data --dataset pyvision_sft", ("model.safetensors", "no valid safetensors header")),
    "sft-dataset-media-missing": Case(f"sft {M_OK} --dataset-dir {{i}}/sft-data-no-media --dataset pyvision_sft", ("t.jsonl:2 names ../trajectories/media/a.png, which is not in", "sft-data-no-media")),
    "sft-dataset-row-broken": Case(f"sft {M_OK} --dataset-dir {{i}}/sft-data-bad-row --dataset pyvision_sft", ("t.jsonl:2", "malformed JSON")),
    "sft-dataset-info-broken": Case(f"sft {M_OK} --dataset-dir {{i}}/sft-data-broken --dataset pyvision_sft", ("dataset_info.json:1", "malformed JSON")),
    "sft-dataset-file-missing": Case(f"sft {M_OK} --dataset-dir {{i}}/sft-data-no-file --dataset pyvision_sft", ("dataset 'pyvision_sft' names nope.json, which is not in", "sft-data-no-file")),
    "sft-dataset-entry-not-object": Case(f"sft {M_OK} --dataset-dir {{i}}/sft-data-no-file --dataset x", ("dataset 'x' is not an object",)),
    "sft-dataset-info-is-folder": Case(f"sft {M_OK} --dataset-dir {{i}}/sft-data-folder --dataset pyvision_sft", ("dataset_info.json is a folder",)),
    "sft-dataset-unknown": Case(f"sft {M_OK} --dataset-dir {{i}}/sft-data --dataset other", ("dataset 'other'", "pyvision_sft")),
    "sft-no-data-stage": Case("sft --run-id fresh", ("no base model for run 'fresh'",)),
    "agent-model-empty": Case("agent run --model {i}/model-empty --question q --image {i}/good.png", ("model-empty", "is empty")),
    "agent-image-and-video": Case(f"agent run {M_OK} --question q --image {{i}}/good.png --video {{i}}/a.mp4", ("either --image",)),
    "agent-image-bomb": Case(f"agent run {M_OK} --question q --image {{i}}/bomb.png", ("bomb.png",)),
    "agent-image-corrupt": Case(f"agent run {M_OK} --question q --image {{i}}/corrupt.png", ("corrupt.png",)),
    "agent-server-down": Case("agent run --model http://127.0.0.1:9/v1 --question q --image {i}/good.png", ("http://127.0.0.1:9/v1", "does not answer")),
    "agent-question-empty": Case(f"agent run {M_OK} --question '' --image {{i}}/good.png", ("--question is empty",)),
    "agent-question-blank": Case(f"agent run {M_OK} --question '  ' --image {{i}}/good.png", ("--question is empty",)),
    "agent-model-empty-text": Case("agent run --model '' --question q --image {i}/good.png", ("--model is empty",)),
    "agent-served-model-empty": Case(f"agent run {M_OK} --question q --image {{i}}/good.png --served-model ''", ("--served-model is empty",)),
    "merge-no-lora": Case("merge --out {i}/merged", ("--engine lora needs --lora",)),
    "merge-unknown-engine": Case("merge --out {i}/merged --engine fsdp", ("'--engine'", "fsdp")),
    "merge-adapter-config-broken": Case("merge --out {i}/merged --lora {i}/lora-broken --base {i}/model-ok", ("lora-broken/adapter_config.json:1", "malformed JSON")),
    "tiny-unknown-size": Case("model tiny {i}/tiny --size huge", ("'--size'", "huge")),
    "tiny-out-is-file": Case("model tiny {i}/a-file", ("a-file", "is a file")),
    "tiny-out-under-file": Case("model tiny {i}/a-file/model", ("a-file", "is a file")),
    # predictions
    "score-not-utf8": Case("eval score --benchmark vsibench --predictions {i}/preds-latin1.jsonl", ("preds-latin1.jsonl:1", "not UTF-8")),
    "score-broken-line": Case("eval score --benchmark vsibench --predictions {i}/preds-broken.jsonl", ("preds-broken.jsonl:", )),
    "score-empty": Case("eval score --benchmark vsibench --predictions {i}/preds-empty.jsonl", ("preds-empty.jsonl", "no predictions")),
    "score-synth-missing-column": Case("eval score --benchmark synth-image --predictions {i}/preds-broken.jsonl", ("missing column 'data_source'", "`pyvision data synth` writes them")),
    "sandbox-memory-too-low": Case("sandbox run {i}/code.py --memory-mb 256", ("'--memory-mb'", "greater than or equal to 512")),
    "set-nan": Case("rl --set rl.learning_rate=.nan --dry-run", ("'rl.learning_rate'", "a finite number")),
    "score-missing": Case("eval score --benchmark vsibench --predictions {i}/nope.jsonl", ("predictions file not found",)),
    "score-is-folder": Case("eval score --benchmark vsibench --predictions {i}/store-dir", ("store-dir", "not a file")),
    "score-unknown-benchmark": Case("eval score --benchmark vsi --predictions {i}/preds-broken.jsonl", ("unknown benchmark 'vsi'",)),
    "score-neither": Case("eval score --benchmark vstar", ("exactly one of --predictions and --run-id",)),
    "score-model-tag-without-run": Case("eval score --benchmark vstar --predictions {i}/preds-broken.jsonl --model-tag x", ("--model-tag only applies with --run-id",)),
    # data commands
    "trajectories-broken-json": Case("data trajectories --tasks {i}/tasks-broken-json --out {i}/traj", ("tasks.jsonl:2", "malformed JSON")),
    "trajectories-not-utf8": Case("data trajectories --tasks {i}/tasks-latin1 --out {i}/traj", ("tasks.jsonl:2", "not UTF-8")),
    "trajectories-missing-media": Case("data trajectories --tasks {i}/tasks-missing-media --out {i}/traj", ("tasks.jsonl:1", "nope.png")),
    "trajectories-out-is-file": Case("data trajectories --tasks {i}/tasks --out {i}/a-file", ("a-file", "is a file")),
    "trajectories-decompression-bomb": Case("data trajectories --tasks {i}/tasks-bomb --out {i}/traj", ("bomb.png",)),
    "agent-video-corrupt": Case(f"agent run {M_OK} --question q --video {{i}}/corrupt.png", ("corrupt.png",)),
    "trajectories-tasks-missing": Case("data trajectories --tasks {i}/nope --out {i}/traj", ("tasks file not found",)),
    "validate-strict-not-utf8": Case("data validate {i}/tasks-latin1 --strict", ("tasks.jsonl:2", "not UTF-8")),
    "validate-missing": Case("data validate {i}/nope", ("not found", "nope")),
    "validate-strict-name-too-long": Case("data validate {i}/tasks-name-too-long --strict", ("tasks.jsonl:2", "missing media file", "xxxx.png")),
    "eval-tasks-name-too-long": Case(f"eval -c {TINY} {M_OK} --benchmarks synth-image --data-dir {{i}}/tasks-name-too-long", ("tasks.jsonl:2", "missing media file")),
    "validate-strict-bomb": Case("data validate {i}/tasks-bomb --strict", ("bomb.png",)),
    "synth-n-float": Case("data synth --kind image-search --n 1e11 --out {i}/s", ("'--n'", "valid integer")),
    "synth-n-huge": Case("data synth --kind image-search --n 100000000000 --out {i}/s", ("--n",)),
    "synth-n-too-big-for-disk": Case("data synth --kind image-search --n 10000000 --out {i}/s", ("10,000,000 image-search tasks", "of disk")),
    "synth-unknown-kind": Case("data synth --kind images --n 2 --out {i}/s", ("'--kind'", "images")),
    "synth-unknown-split": Case("data synth --kind video --n 2 --split test --out {i}/s", ("'--split'", "test")),
    "synth-unknown-family": Case("data synth --kind video --n 2 --families colour --out {i}/s", ("family 'colour'",)),
    "synth-out-not-empty": Case("data synth --kind image-search --n 2 --out {i}/model-ok", ("model-ok", "exists and is not empty", "--force")),
    "trajectories-out-not-empty": Case("data trajectories --tasks {i}/tasks --out {i}/model-ok", ("model-ok", "exists and is not empty", "--force")),
    "synth-out-is-file": Case("data synth --kind image-search --n 2 --out {i}/a-file", ("a-file", "is a file")),
    "export-unknown-format": Case("data export --format sharegpt --source {i}/tasks --out {i}/x", ("'--format'", "sharegpt")),
    "export-source-missing": Case("data export --format verl --source {i}/nope --out {i}/x", ("nope",)),
    "export-out-is-file": Case("data export --format verl --source {i}/tasks --out {i}/a-file", ("a-file", "is a file")),
    "distill-teacher-not-url": Case("data distill --teacher localhost:8000 --tasks {i}/tasks --out {i}/d", ("teacher localhost:8000 is not a server URL", "e.g. http://localhost:8000/v1")),
    "distill-k-zero": Case("data distill --teacher http://127.0.0.1:9 --tasks {i}/tasks --out {i}/d --k 0", ("'--k'", "greater than or equal to 1")),
    "download-unknown": Case("data download vstar2 --out {i}/d", ("vstar2",)),
    "import-from-missing": Case("data import vstar --from-dir {i}/nope --out {i}/d", ("nope",)),
    "import-from-empty": Case("data import vstar --from-dir {i}/store-dir --out {i}/d", ("no data for 'vstar'", "store-dir")),
    "import-missing-column": Case("data import vstar --from-dir {i}/vstar-no-label --out {i}/d", ("test.jsonl:1", "missing column 'label'")),
    "import-corrupt-parquet": Case("data import hrbench --from-dir {i}/corrupt-parquet --out {i}/d", ("test-00000-of-00001.parquet", "not a readable parquet file")),
    "export-llamafactory-no-usable-row": Case("data export --format llamafactory --source {i}/conversations-broken --out {i}/x", ("no usable conversation", "conversations.jsonl:1", "malformed_json")),
    "export-verl-no-usable-row": Case("data export --format verl --source {i}/tasks-missing-media --out {i}/x", ("no usable task", "tasks.jsonl:1", "missing_media")),
    # sandbox
    "sandbox-code-not-utf8": Case("sandbox run {i}/code-latin1.py", ("code-latin1.py:1", "not UTF-8")),
    "sandbox-code-missing": Case("sandbox run {i}/nope.py", ("code file not found",)),
    "sandbox-code-is-folder": Case("sandbox run {i}/store-dir", ("store-dir", "not a file")),
    "sandbox-unknown-isolation": Case("sandbox run {i}/code-latin1.py --isolation docker", ("'--isolation'", "docker")),
    "sandbox-out-dir-is-file": Case("sandbox run {i}/code.py --out-dir {i}/a-file", ("a-file", "is a file")),
    "sandbox-image-corrupt": Case("sandbox run {i}/code.py --image {i}/corrupt.png", ("corrupt.png",)),
    "sandbox-image-decompression-bomb": Case("sandbox run {i}/code.py --image {i}/bomb.png", ("bomb.png",)),
    "sandbox-video-missing": Case("sandbox run {i}/code.py --video {i}/nope.mp4", ("nope.mp4",)),
    # the store
    "store-is-folder": Case(f"{EVAL} {M_OK} --store {{i}}/store-dir", ("store-dir", "folder, not a DuckDB file")),
    "store-not-duckdb": Case(f"{EVAL} {M_OK} --store {{i}}/not-duckdb.duckdb", ("not-duckdb.duckdb", "not a DuckDB database")),
    "store-empty-file": Case(f"{RL} {M_OK} --store {{i}}/empty.duckdb", ("empty.duckdb", "not a DuckDB database")),
    "store-under-a-file": Case(f"{RL} {M_OK} --store {{i}}/a-file/s.duckdb", ("a-file", "is a file")),
    "report-store-missing": Case("report --store {i}/nope.duckdb", ("store not found", "nope.duckdb")),
    "report-store-folder": Case("report --store {i}/store-dir", ("store-dir", "folder")),
    "report-store-not-duckdb": Case("report --format json --store {i}/not-duckdb.duckdb", ("not a DuckDB database",)),
    "report-table-with-out": Case("report --format table --out {i}/r", ("--out is for report files", "--format table")),
    "report-json-with-out": Case("report --format json --out {i}/r", ("--out is for report files", "--format json")),
    "report-unknown-format": Case("report --format pdf", ("'--format'", "pdf")),
    "report-store-under-missing-folder": Case("report --store {i}/nope/s.duckdb", ("store not found", "nope")),
    "score-run-not-in-store": Case("eval score --benchmark mathverse --run-id r --store {i}/nope/s.duckdb", ("'r'",)),
    "run-store-is-folder": Case(f"run {TINY} --store {{i}}/store-dir", ("store-dir", "folder, not a DuckDB file")),
    "report-unknown-run": Case("report --run nope", ()),
    # command lines
    "unknown-command": Case("train", ("No such command 'train'",)),
    "unknown-option": Case("rl --epochs 3", ("No such option: --epochs",)),
    "unknown-subcommand": Case("data synthesize", ("No such command 'synthesize'",)),
    "missing-argument": Case("model tiny", ("Missing argument", "out_dir")),
    "perf-eval-nothing-to-measure": Case("perf eval --n-image 0 --n-video 0", ("nothing to measure",)),
    "perf-eval-model-missing": Case("perf eval --model {i}/nope", ("model not found", "nope")),
    "perf-rl-tasks-missing": Case("perf rl --size nano --tasks {i}/nope", ("tasks file not found", "nope")),
    "perf-rl-model-missing": Case("perf rl --model {i}/nope", ("policy model not found", "nope")),
    "perf-rl-set-unknown-key": Case("perf rl --set rl.bogus=1", ("unknown config key 'rl.bogus'", "with --set rl.bogus=1;")),
    "probe-model-missing": Case("model probe {i}/nope", ("model not found", "nope")),
    "perf-unknown-size": Case("perf eval --size large", ("'--size'", "large")),
}


def _snapshot(root: Path) -> dict[str, tuple[int, int]]:
    """Every file and folder under ``root``: files with size and mtime (a folder's mtime changes
    when a writability probe comes and goes, which leaves nothing behind)."""
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns) if p.is_file()
            else (0, 0) for p in sorted(root.rglob("*"))}


def run_case(tmp_path: Path, argv: str) -> tuple:
    import shlex

    inp = tmp_path / "in"
    make_inputs(inp)
    before = _snapshot(tmp_path)
    args = [a.replace("{i}", str(inp)) for a in shlex.split(argv.replace("$'a\\nb'", "A_NL_B"))]
    args = [a.replace("A_NL_B", "a\nb") for a in args]
    result = runner.invoke(app, args, prog_name="pyvision")
    return result, before, _snapshot(tmp_path)


def assert_clean(result, before, after, names: tuple[str, ...]) -> None:
    output = result.output
    assert result.exit_code == 2, output
    assert "Traceback" not in output and result.exception is None or \
        isinstance(result.exception, SystemExit), output
    lines = [line for line in output.splitlines() if line.strip()]
    assert len(lines) == 1, output
    assert lines[0].startswith("error: "), output
    for name in names:
        assert name in lines[0], f"{name!r} not in {lines[0]!r}"
    assert after == before, f"created or changed: {sorted(set(after.items()) ^ set(before.items()))}"


@pytest.fixture(autouse=True)
def _in_empty_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Run from the test's own folder: `runs/`, `data/` and the store would appear there."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PYVISION_CACHE", str(tmp_path / "cache"))


@pytest.mark.parametrize("name", list(CASES))
def test_bad_input_is_one_line_exit_2_and_leaves_nothing(name: str, tmp_path: Path) -> None:
    case = CASES[name]
    result, before, after = run_case(tmp_path, case.argv)
    assert_clean(result, before, after, case.names)


# -- read-only places (a folder made read-only; as root, a read-only system folder) ----------------


@pytest.fixture
def read_only_dir(tmp_path: Path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        probe = ro / "probe"
        probe.touch()
    except OSError:
        yield ro
    else:
        probe.unlink()
        candidate = Path("/sys")  # root writes anywhere but there
        try:
            (candidate / "pyvision-probe").mkdir()
        except OSError:
            yield candidate
        else:  # pragma: no cover - no read-only place on this machine
            (candidate / "pyvision-probe").rmdir()
            pytest.skip("no read-only folder available")
    finally:
        ro.chmod(0o755)


READ_ONLY_CASES = {
    "synth-out": ("data synth --kind image-search --n 2 --out {ro}/s", ("not writable",)),
    "tiny-out": ("model tiny {ro}/m", ("not writable",)),
    "report-out": ("report --format html --out {ro}/report", ("not writable",)),
    "store-folder": (f"{EVAL} {M_OK} --store {{ro}}/s.duckdb", ("not writable",)),
    "runs-folder": (f"{RL} {M_OK} --set runs_dir={{ro}}/runs", ("runs folder", "not writable")),
    "trajectories-out": ("data trajectories --tasks {i}/tasks --out {ro}/t", ("not writable",)),
}


@pytest.mark.parametrize("name", list(READ_ONLY_CASES))
def test_read_only_output_is_one_line_exit_2(name: str, tmp_path: Path, read_only_dir: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    argv, names = READ_ONLY_CASES[name]
    if name == "report-out":  # a store to report on
        _store_with_a_run(tmp_path / "in-store.duckdb")
        monkeypatch.setenv("PYVISION_STORE", str(tmp_path / "in-store.duckdb"))
    result, before, after = run_case(tmp_path, argv.replace("{ro}", str(read_only_dir)))
    assert_clean(result, before, after, names)


@pytest.mark.skipif(os.geteuid() == 0, reason="root can write a read-only file")
def test_read_only_store_file_is_one_line_exit_2(tmp_path: Path) -> None:
    path = tmp_path / "ro.duckdb"
    _store_with_a_run(path)
    path.chmod(0o444)
    result, before, after = run_case(tmp_path, f"{RL} {M_OK} --store {path}")
    assert_clean(result, before, after, ("ro.duckdb", "read-only"))


def _store_with_a_run(path: Path) -> None:
    from pipelines.store import Store

    Store(path).upsert_run("demo", "demo")


# -- odd but good inputs, empty stores, interrupted writers ----------------------------------------


def test_a_utf8_bom_is_accepted_in_recipes_tasks_and_predictions(tmp_path: Path):
    from tests.benchmarks.test_benchmarks import vsibench_rows

    inp = tmp_path / "in"
    make_inputs(inp)
    bom = b"\xef\xbb\xbf"
    recipe = inp / "bom.yaml"
    recipe.write_bytes(bom + b"name: with-bom\nseed: 1\n")
    from pipelines.config.recipe import load_recipe

    assert load_recipe(recipe).name == "with-bom"
    tasks = inp / "tasks" / "tasks.jsonl"
    tasks.write_bytes(bom + tasks.read_bytes())
    from pipelines.core.records import read_tasks

    assert [t.id for t in read_tasks(tasks, strict=True)[0]] == ["t0", "t1"]
    rows = "".join(json.dumps({**r, "prediction": r["ground_truth"]}) + "\n"
                   for r in vsibench_rows()).encode()
    plain, with_bom = inp / "plain.jsonl", inp / "bom.jsonl"
    plain.write_bytes(rows)
    with_bom.write_bytes(bom + rows)
    scores = [runner.invoke(app, ["eval", "score", "--benchmark", "vsibench", "--predictions",
                                  str(p), "--json"]) for p in (plain, with_bom)]
    assert all(s.exit_code == 0 for s in scores), scores[1].output
    assert json.loads(scores[0].stdout) == json.loads(scores[1].stdout)


def test_an_empty_store_reports_nothing_in_every_format(tmp_path: Path):
    from pipelines.store import Store

    Store().migrate()  # exists, holds no run
    for fmt in ("table", "json", "markdown", "html"):
        out = ["--out", str(tmp_path / "rep")] if fmt in ("markdown", "html") else []
        result = runner.invoke(app, ["report", "--format", fmt, *out])
        assert result.exit_code == 0, (fmt, result.output)
    assert not (tmp_path / "rep").exists()


def test_a_terminated_synth_leaves_no_temp_folder(tmp_path: Path):
    import signal
    import subprocess
    import sys
    import time

    out = tmp_path / "s"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, "-m", "pyvision_cli.main", "data", "synth", "--kind",
                             "image-search", "--n", "500", "--out", str(out)], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not list(tmp_path.glob(".s.*.tmp/media/*")):  # writing has begun
        assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 128 + signal.SIGTERM
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_a_temp_folder_of_a_killed_writer_goes_with_the_next_write(tmp_path: Path):
    from pipelines.fsutil import atomic_dir

    dead = tmp_path / ".out.999999999.abcd1234.tmp"  # no such pid
    alive = tmp_path / f".out.{os.getpid()}.abcd1234.tmp"  # a writer still at work
    other = tmp_path / ".other.999999999.abcd1234.tmp"
    for folder in (dead, alive, other):
        (folder / "media").mkdir(parents=True)
    with atomic_dir(tmp_path / "out") as tmp:
        (tmp / "x").write_text("done")
    assert not dead.exists() and alive.is_dir() and other.is_dir()
    assert (tmp_path / "out" / "x").read_text() == "done"
    with pytest.raises(RuntimeError), atomic_dir(tmp_path / "a" / "b" / "new"):
        raise RuntimeError("failed half way")
    assert not (tmp_path / "a").exists()  # the folders made for it go too


def test_an_existing_empty_folder_is_replaced_and_a_full_one_kept(tmp_path: Path):
    from pipelines.fsutil import atomic_dir

    empty, full = tmp_path / "empty", tmp_path / "full"
    empty.mkdir()
    (full / "mine").mkdir(parents=True)
    with atomic_dir(empty) as tmp:
        (tmp / "x").write_text("done")
    assert (empty / "x").read_text() == "done"
    with pytest.raises(FileExistsError), atomic_dir(full) as tmp:
        (tmp / "x").write_text("done")
    assert [p.name for p in full.iterdir()] == ["mine"]
    (tmp_path / "failed").mkdir()
    with pytest.raises(RuntimeError), atomic_dir(tmp_path / "failed"):
        raise RuntimeError("failed half way")
    assert (tmp_path / "failed").is_dir()  # kept as it was
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty", "failed", "full"]


def test_synth_into_an_existing_empty_folder(tmp_path: Path):
    (tmp_path / "s").mkdir()
    result = runner.invoke(app, ["data", "synth", "--kind", "image-search", "--n", "2", "--out",
                                 str(tmp_path / "s")])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "s" / "manifest.json").is_file()
    assert len((tmp_path / "s" / "tasks.jsonl").read_text().splitlines()) == 2


@pytest.mark.parametrize("out,names", [
    ("{i}/a-file", ("a-file", "is a file")), ("{i}/a-file/model", ("a-file", "is a file")),
    ("{i}/tasks", ("tasks", "is not empty and holds no pretrained model", "--force"))])
def test_pretrain_out_is_checked_before_anything_is_written(out: str, names: tuple[str, ...],
                                                            tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch):
    import pipelines.models.pretrain

    def no_training(*args, **kwargs):  # a missed check fails here at once, not after the run
        raise AssertionError("pretraining started")

    monkeypatch.setattr(pipelines.models.pretrain, "pretrain", no_training)
    result, before, after = run_case(tmp_path, f"model pretrain --out {out}")
    assert_clean(result, before, after, names)


@pytest.mark.parametrize("init,names", [
    ("{i}/no-such-model", ("model.pretrain.init", "no-such-model", "is not a model folder")),
    ("{i}/tasks", ("model.pretrain.init", "has no config.json"))])
def test_a_continued_pretraining_start_is_checked_before_anything_is_written(
        init: str, names: tuple[str, ...], tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    import pipelines.models.pretrain

    def no_training(*args, **kwargs):
        raise AssertionError("pretraining started")

    monkeypatch.setattr(pipelines.models.pretrain, "pretrain", no_training)
    result, before, after = run_case(tmp_path, f"model pretrain --set model.pretrain.init={init}")
    assert_clean(result, before, after, names)


@pytest.mark.parametrize("flag,name,data", [
    ("--video", "empty.mp4", b""), ("--video", "junk.mp4", b"\x00" * 512),
    ("--image", "junk.png", b"\x00" * 512)])
def test_undecodable_media_is_one_line_on_the_real_stderr(flag: str, name: str, data: bytes,
                                                          tmp_path: Path):
    """What the decoders print themselves (decord's C++ log goes to fd 2, out of the test runner's
    reach, and PIL names its stream) stays out of the one-line error."""
    import subprocess
    import sys

    (tmp_path / name).write_bytes(data)
    (tmp_path / "code.py").write_text("print(1)\n")
    proc = subprocess.run([sys.executable, "-m", "pyvision_cli.main", "sandbox", "run",
                           str(tmp_path / "code.py"), flag, str(tmp_path / name)],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120,
                          check=False)
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and name in lines[0], proc.stderr
    assert "object at 0x" not in lines[0]


@pytest.mark.parametrize("folder", ["tasks-missing-media", "tasks-empty"])
def test_validate_without_usable_rows_reports_then_exits_2(folder: str, tmp_path: Path) -> None:
    # Not --strict: every finding is listed first (what to fix), then one error line, exit 2.
    result, before, after = run_case(tmp_path, f"data validate {{i}}/{folder}")
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert lines[-1].startswith("error: ") and "no usable rows" in lines[-1], result.output
    assert folder in lines[-1] and "rows kept" in result.output
    assert after == before


def test_validate_with_usable_rows_exits_0(tmp_path: Path) -> None:
    result, _, _ = run_case(tmp_path, "data validate {i}/tasks --json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["kept"] > 0
