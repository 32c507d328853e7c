"""Benchmark adapters: local layouts, media caching, prompts, validate, scoring files, offline.

Fixture rows use each benchmark's real schema (the hub columns); tiny images come from PIL and a
tiny mp4 from PyAV. Equality with lmms-eval's own scorers is in test_benchmarks_lmms_eval.py.
"""

from __future__ import annotations

import base64
import io
import json
import zipfile
from pathlib import Path
from typing import Any

import pytest

from benchmarks import BENCHMARKS, get_benchmark, score_predictions
from pipelines.core.records import Task
from pipelines.errors import DataError, UserError

# -- fixture rows in each benchmark's schema ------------------------------------------------------


def png_bytes(colour: tuple[int, int, int], size: tuple[int, int] = (24, 16)) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", size, colour).save(buf, format="PNG")
    return buf.getvalue()


def vstar_rows() -> list[dict[str, Any]]:
    return [
        {"question_id": 0, "category": "direct_attributes", "label": "A",
         "text": "What is the color of the woman's bag? (A) black (B) red (C) white (D) brown"},
        {"question_id": 1, "category": "direct_attributes", "label": "C",
         "text": "What is the material of the glove?\n(A) rubber\n(B) cotton\n(C) leather\n"
                 "(D) wool"},
        {"question_id": 2, "category": "relative_position", "label": "B",
         "text": "Is the dog on the left or right side of the bench? (A) left (B) right"},
        {"question_id": 3, "category": "relative_position", "label": "A",
         "text": "Is the cup above or below the lamp? (A) above (B) below"},
    ]


def hrbench_rows(offset: int = 0) -> list[dict[str, Any]]:
    """Three questions, each in two option rotations (cycle_category)."""
    base = [
        ("What colour is the flag on the tower?", ["red", "blue", "green", "white"], 0, "single"),
        ("What is written on the bus?", ["EXPRESS", "LOCAL", "CITY", "TOUR"], 2, "single"),
        ("Which is larger, the boat or the car?", ["the boat", "the car", "same size",
                                                   "cannot tell"], 0, "cross"),
    ]
    rows = []
    for cycle in range(2):
        for q, (question, options, gold, category) in enumerate(base):
            rotated = options[cycle:] + options[:cycle]
            rows.append({"index": offset + cycle * 10 + q, "question": question,
                         **{chr(65 + i): o for i, o in enumerate(rotated)},
                         "answer": chr(65 + rotated.index(options[gold])), "category": category,
                         "cycle_category": f"cycle_{cycle}"})
    return rows


_MV_WO = ("Please directly answer the question and provide the correct option letter, e.g., A, "
          "B, C, D.\nQuestion: ")
_MV_COT = ("Please first conduct reasoning, and then answer the question and provide the correct "
           "option letter, e.g., A, B, C, D, at the end.\nQuestion: ")


def mathverse_rows() -> list[dict[str, Any]]:
    choice_q = ("As shown in the figure, AB is parallel to CD and angle 1 = 50°. Find angle 2.\n"
                "Choices:\nA:40°\nB:50°\nC:130°\nD:150°")
    free = "Find the ratio of the two sides shown in the figure."
    meta = {"split": "testmini", "source": "GeoQA", "subject": "Plane Geometry",
            "subfield": "Angle"}
    return [
        {"sample_index": "1", "problem_index": "1", "problem_version": "Text Dominant",
         "question": choice_q, "answer": "C", "question_type": "multi-choice", "metadata": meta,
         "query_wo": _MV_WO + choice_q, "query_cot": _MV_COT + choice_q,
         "question_for_eval": choice_q},
        {"sample_index": "2", "problem_index": "2", "problem_version": "Vision Only",
         "question": "", "answer": "\\frac{3}{2}", "question_type": "free-form", "metadata": meta,
         "query_wo": "According to the question shown in the image, please directly answer the "
                     "question.", "query_cot": "According to the question shown in the image, "
                     "please first conduct reasoning, and then answer the question.",
         "question_for_eval": free},
        {"sample_index": "3", "problem_index": "3", "problem_version": "Text Only",
         "question": "A rectangle has sides 3 and 4. What is its diagonal?", "answer": "5",
         "question_type": "free-form", "metadata": meta,
         "query_wo": "Please directly answer the question.\nQuestion: A rectangle has sides 3 "
                     "and 4. What is its diagonal?",
         "query_cot": "Please first conduct reasoning, and then answer the question.\nQuestion: "
                      "A rectangle has sides 3 and 4. What is its diagonal?",
         "question_for_eval": "A rectangle has sides 3 and 4. What is its diagonal?"},
        {"sample_index": "4", "problem_index": "4", "problem_version": "Vision Intensive",
         "question": "Find the height of the triangle.", "answer": "2\\sqrt{3}",
         "question_type": "free-form", "metadata": meta,
         "query_wo": "Please directly answer.\nQuestion: Find the height of the triangle.",
         "query_cot": "Please reason first.\nQuestion: Find the height of the triangle.",
         "question_for_eval": "Find the height of the triangle."},
    ]


def vsibench_rows() -> list[dict[str, Any]]:
    mc = ["A. chair", "B. table", "C. sofa", "D. lamp"]
    rows = [
        ("object_counting", "How many chair(s) are in this room?", None, "3"),
        ("object_counting", "How many lamp(s) are in this room?", None, "12"),
        ("object_abs_distance", ("What is the distance between the sofa and the tv (in "
                                "meters)?"), None, "2.5"),
        ("object_size_estimation", ("What is the length of the longest dimension of the table "
                                   "(in centimeters)?"), None, "120"),
        ("room_size_estimation", "What is the size of this room (in square meters)?", None,
         "23.4"),
        ("object_rel_distance", "Which object is the closest to the bed?", mc, "B"),
        ("route_planning", "How do you get from the door to the window?",
         ["A. turn left", "B. turn right", "C. go forward", "D. turn back"], "C"),
        ("obj_appearance_order", "Which order do the objects first appear in?",
         ["A. chair, table", "B. table, chair", "C. lamp, sofa", "D. sofa, lamp"], "A"),
        ("object_rel_direction_easy", "Is the chair to the left or the right of the table?",
         ["A. left", "B. right"], "A"),
        ("object_rel_direction_medium", "Is the lamp front-left or front-right of the sofa?",
         ["A. front-left", "B. front-right", "C. back-left"], "B"),
        ("object_rel_direction_hard", ("Standing at the sofa facing the tv, is the lamp to the "
                                      "front-left, front-right, back-left or back-right?"),
         ["A. front-left", "B. front-right", "C. back-left", "D. back-right"], "D"),
    ]
    out = []
    for i, (qtype, question, options, gt) in enumerate(rows):
        dataset, scene = (("arkitscenes", "41069025") if i % 2 == 0
                          else ("scannet", "scene0011_00"))
        out.append({"id": i + 1, "dataset": dataset, "scene_name": scene, "question_type": qtype,
                    "question": question, "options": options, "ground_truth": gt})
    return out


def write_tiny_mp4(path: Path, frames: int = 4) -> Path:
    import av
    import numpy as np

    path.parent.mkdir(parents=True, exist_ok=True)
    with av.open(str(path), "w") as container:
        stream = container.add_stream("mpeg4", rate=4)
        stream.width, stream.height, stream.pix_fmt = 32, 32, "yuv420p"
        for i in range(frames):
            image = np.full((32, 32, 3), 40 * i, dtype=np.uint8)
            for packet in stream.encode(av.VideoFrame.from_ndarray(image, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return path


# -- local layouts -------------------------------------------------------------------------------


def make_vstar_dir(root: Path) -> Path:
    """V* as ``datasets.save_to_disk`` output (a DatasetDict with a ``test`` split)."""
    import datasets
    from PIL import Image

    rows = vstar_rows()
    columns = {k: [r[k] for r in rows] for k in rows[0]}
    columns["image"] = [Image.new("RGB", (20 + i, 12), (50 * i, 80, 120)) for i in range(len(rows))]
    features = datasets.Features({"question_id": datasets.Value("int64"),
                                  "category": datasets.Value("string"),
                                  "label": datasets.Value("string"),
                                  "text": datasets.Value("string"), "image": datasets.Image()})
    ds = datasets.Dataset.from_dict(columns, features=features)
    datasets.DatasetDict({"test": ds}).save_to_disk(str(root))
    return root


def make_hrbench_dir(root: Path) -> Path:
    """HR-Bench as the hub's parquet files, both splits side by side, images in base64."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder = root / "hrbench_version_split"
    folder.mkdir(parents=True)
    for split, offset in (("hrbench_4k", 0), ("hrbench_8k", 100)):
        rows = hrbench_rows(offset)
        for r in rows:
            # The two rotations of a question share their image, as in the real data.
            colour = (30 * (r["index"] % 10), 90, 160)
            r["image"] = base64.b64encode(png_bytes(colour)).decode()
        pq.write_table(pa.Table.from_pylist(rows), folder / f"{split}-00000-of-00001.parquet")
    return root


def make_mathverse_dir(root: Path) -> Path:
    """MathVerse as JSONL with images as relative paths (and none for the text-only row)."""
    rows = mathverse_rows()
    (root / "images").mkdir(parents=True)
    for i, r in enumerate(rows):
        if r["problem_version"] == "Text Only":
            r["image"] = ""
        else:
            (root / "images" / f"{r['sample_index']}.png").write_bytes(png_bytes((10 * i, 0, 0)))
            r["image"] = f"images/{r['sample_index']}.png"
    (root / "testmini.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return root


def make_vsibench_dir(root: Path) -> Path:
    """VSI-Bench rows as JSONL; one scene's video as a file, the other inside the official zip."""
    rows = vsibench_rows()
    root.mkdir(parents=True, exist_ok=True)
    (root / "test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    write_tiny_mp4(root / "arkitscenes" / "41069025.mp4")
    video = write_tiny_mp4(root / "tmp" / "scene0011_00.mp4")
    with zipfile.ZipFile(root / "scannet.zip", "w") as zf:
        zf.write(video, "scannet/scene0011_00.mp4")
    video.unlink()
    (root / "tmp").rmdir()
    return root


LAYOUTS = {"vstar": make_vstar_dir, "hrbench4k": make_hrbench_dir,
           "hrbench8k": make_hrbench_dir, "mathverse": make_mathverse_dir,
           "vsibench": make_vsibench_dir}


@pytest.fixture(scope="module")
def loaded(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[list[Task], Path]]:
    """Every public benchmark's fixture, written in its local layout and loaded back once."""
    out = {}
    for name, make in LAYOUTS.items():
        data_dir = make(tmp_path_factory.mktemp(f"{name}-data") / "copy")
        cache = tmp_path_factory.mktemp(f"{name}-cache")
        out[name] = (get_benchmark(name).load(data_dir=data_dir, cache_dir=cache), cache)
    return out


# -- loading -------------------------------------------------------------------------------------


def test_vstar_loads_saved_dataset_with_images_cached(loaded) -> None:
    tasks, cache = loaded["vstar"]
    assert [t.id for t in tasks] == ["0", "1", "2", "3"]
    assert [t.answer for t in tasks] == ["A", "C", "B", "A"]
    assert tasks[0].options == ["black", "red", "white", "brown"]
    assert tasks[1].options == ["rubber", "cotton", "leather", "wool"]
    for t in tasks:
        (image,) = t.images
        assert Path(image).is_absolute() and Path(image).is_file()
        assert Path(image).parent == (cache / "vstar" / "media").resolve()
        assert t.metadata["row"]["text"] and "image" not in t.metadata["row"]


def test_hrbench_reads_only_its_split_and_stores_shared_images_once(loaded) -> None:
    tasks4k, cache = loaded["hrbench4k"]
    tasks8k, _ = loaded["hrbench8k"]
    assert sorted(int(t.id) for t in tasks4k) == [0, 1, 2, 10, 11, 12]
    assert sorted(int(t.id) for t in tasks8k) == [100, 101, 102, 110, 111, 112]
    # Rows 0 and 10 are rotations of one question with the same image bytes: one file.
    by_id = {t.id: t for t in tasks4k}
    assert by_id["0"].images == by_id["10"].images
    assert len(list((cache / "hrbench4k" / "media").iterdir())) == 3
    assert by_id["10"].options == ["blue", "green", "white", "red"]
    assert by_id["10"].answer == "D"


def test_mathverse_relative_images_text_only_rows_and_answer_types(loaded) -> None:
    tasks, _ = loaded["mathverse"]
    by_id = {t.id: t for t in tasks}
    assert by_id["1"].answer_type == "choice"
    assert by_id["1"].options == ["40°", "50°", "130°", "150°"]
    assert by_id["2"].answer_type == "math"
    assert by_id["3"].images == []
    assert Path(by_id["4"].images[0]).name == "4.png"


@pytest.mark.parametrize("damage", ["truncated", "member"])
def test_a_corrupt_vsibench_zip_is_a_data_error_naming_it(tmp_path: Path, damage: str) -> None:
    """A truncated official zip, or one whose video is corrupt inside, was a BadZipFile
    traceback; it is one line naming the archive, with no partial video left in the cache."""
    data = make_vsibench_dir(tmp_path / "copy")
    archive = data / "scannet.zip"
    whole = archive.read_bytes()
    if damage == "truncated":
        archive.write_bytes(whole[: len(whole) // 2])
    else:  # the member's bytes changed, the central directory intact: a CRC mismatch
        with zipfile.ZipFile(archive) as zf:
            offset = zf.getinfo("scannet/scene0011_00.mp4").header_offset + 200
        archive.write_bytes(whole[:offset] + bytes(64) + whole[offset + 64:])
    cache = tmp_path / "cache"
    with pytest.raises(DataError, match=r"scannet\.zip is not a readable zip archive") as caught:
        get_benchmark("vsibench").load(data_dir=data, cache_dir=cache)
    assert "download it again" in caught.value.hint
    assert not [p for p in cache.rglob("*") if p.is_file()]


def test_vsibench_finds_videos_and_extracts_from_zip(loaded) -> None:
    tasks, cache = loaded["vsibench"]
    assert len(tasks) == 11
    extracted = cache / "vsibench" / "videos" / "scannet" / "scene0011_00.mp4"
    assert extracted.is_file()
    for t in tasks:
        assert t.video and Path(t.video).is_file() and t.images == []
        if t.metadata["row"]["dataset"] == "scannet":
            assert Path(t.video) == extracted.resolve()
    counting = next(t for t in tasks if t.metadata["question_type"] == "object_counting")
    assert counting.answer_type == "number" and counting.metadata["metric"] == "mra"
    route = next(t for t in tasks if t.metadata["question_type"] == "route_planning")
    assert route.answer_type == "choice" and route.options[2] == "go forward"


def test_vsibench_missing_video_names_the_file(tmp_path: Path) -> None:
    data = tmp_path / "copy"
    data.mkdir()
    (data / "test.jsonl").write_text(json.dumps(vsibench_rows()[0]) + "\n")
    with pytest.raises(DataError, match=r"arkitscenes/41069025\.mp4 not found"):
        get_benchmark("vsibench").load(data_dir=data, cache_dir=tmp_path / "cache")


def test_limit_and_reload_reuse_cached_media(tmp_path: Path) -> None:
    data = make_hrbench_dir(tmp_path / "copy")
    bench = get_benchmark("hrbench4k")
    first = bench.load(data_dir=data, limit=2, cache_dir=tmp_path / "cache")
    media = tmp_path / "cache" / "hrbench4k" / "media"
    stamps = {p.name: p.stat().st_mtime_ns for p in media.iterdir()}
    again = bench.load(data_dir=data, limit=2, cache_dir=tmp_path / "cache")
    assert len(first) == 2 and [t.images for t in again] == [t.images for t in first]
    assert {p.name: p.stat().st_mtime_ns for p in media.iterdir()} == stamps


def test_hrbench_vlmevalkit_tsv_loads_and_parquet_wins_over_it(tmp_path: Path) -> None:
    import pandas as pd

    rows = hrbench_rows()
    for r in rows:
        r["image"] = base64.b64encode(png_bytes((r["index"], 0, 0))).decode()
    rows[0]["D"] = None  # an option column left empty in the tsv: NaN, dropped from options
    data = tmp_path / "copy"
    data.mkdir()
    pd.DataFrame(rows).to_csv(data / "hr_bench_4k.tsv", sep="\t", index=False)
    bench = get_benchmark("hrbench4k")
    tasks = bench.load(data_dir=data, cache_dir=tmp_path / "cache")
    assert sorted(int(t.id) for t in tasks) == [0, 1, 2, 10, 11, 12]
    first = next(t for t in tasks if t.id == "0")
    assert first.options == ["red", "blue", "green"] and "D. " not in first.question
    make_hrbench_dir(data)  # the hub's parquet copy of the same split, beside the tsv
    assert len(bench.load(data_dir=data, cache_dir=tmp_path / "cache")) == 6


def test_missing_column_is_a_data_error_with_location(tmp_path: Path) -> None:
    rows = vstar_rows()
    del rows[1]["label"]
    (tmp_path / "test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(DataError, match=r"test\.jsonl:2: missing column 'label'"):
        get_benchmark("vstar").load(data_dir=tmp_path, cache_dir=tmp_path / "cache")


@pytest.mark.parametrize(("line", "message"), [
    (b'{"question_id": 7, "label": "A"',
     r"test\.jsonl:2: malformed JSON \(Expecting ',' delimiter at column 32\)"),
    (b'{"label": "caf\xe9"}', r"test\.jsonl:2: malformed JSON \(not UTF-8 text: byte 0xe9"),
])
def test_a_bad_jsonl_line_is_a_data_error_at_its_line_and_column(tmp_path: Path, line: bytes,
                                                                 message: str) -> None:
    rows = vstar_rows()
    (tmp_path / "test.jsonl").write_bytes(json.dumps(rows[0]).encode() + b"\n" + line + b"\n")
    with pytest.raises(DataError, match=message):
        get_benchmark("vstar").load(data_dir=tmp_path, cache_dir=tmp_path / "cache")


@pytest.mark.parametrize("damage", ["garbage", "truncated"])
def test_corrupt_parquet_is_a_data_error_naming_the_file(tmp_path: Path, damage: str) -> None:
    data = make_hrbench_dir(tmp_path / "copy")
    parquet = data / "hrbench_version_split" / "hrbench_4k-00000-of-00001.parquet"
    whole = parquet.read_bytes()
    parquet.write_bytes(bytes(range(256)) * 8 if damage == "garbage" else whole[: len(whole) // 2])
    with pytest.raises(DataError, match=r"hrbench_4k-00000-of-00001\.parquet is not a readable "
                                        r"parquet file") as caught:
        get_benchmark("hrbench4k").load(data_dir=data, cache_dir=tmp_path / "cache")
    assert "download it again" in caught.value.hint


def test_corrupt_inline_image_is_a_data_error(tmp_path: Path) -> None:
    rows = hrbench_rows()[:1]
    rows[0]["image"] = base64.b64encode(b"not an image at all").decode()
    (tmp_path / "hr_bench_4k.jsonl").write_text(json.dumps(rows[0]) + "\n")
    with pytest.raises(DataError, match="cannot be decoded"):
        get_benchmark("hrbench4k").load(data_dir=tmp_path, cache_dir=tmp_path / "cache")


# -- prompts (exact text the agent receives) ----------------------------------------------------


def test_prompt_snapshots(loaded) -> None:
    vstar = {t.id: t for t in loaded["vstar"][0]}
    assert vstar["1"].question == (
        "What is the material of the glove?\nA. rubber\nB. cotton\nC. leather\nD. wool\n"
        "Answer with the option's letter from the given choices directly.")
    hr = {t.id: t for t in loaded["hrbench4k"][0]}
    assert hr["0"].question == ("What colour is the flag on the tower?\nA. red\nB. blue\n"
                                "C. green\nD. white\nAnswer the option letter directly.")
    mv = {t.id: t for t in loaded["mathverse"][0]}
    assert mv["3"].question == ("Please first conduct reasoning, and then answer the question."
                                "\nQuestion: A rectangle has sides 3 and 4. What is its "
                                "diagonal?")
    vsi = {t.id: t for t in loaded["vsibench"][0]}
    assert vsi["1"].question == ("These are frames of a video.\nHow many chair(s) are in this "
                                 "room?\nPlease answer the question using a single word or "
                                 "phrase.")
    assert vsi["6"].question == (
        "These are frames of a video.\nWhich object is the closest to the bed?\nOptions:\n"
        "A. chair\nB. table\nC. sofa\nD. lamp\n"
        "Answer with the option's letter from the given choices directly.")
    for name, (tasks, _) in loaded.items():
        bench = get_benchmark(name)
        assert all(bench.question_text(t) == t.question for t in tasks), name


def test_mathverse_query_type_switches_prompt() -> None:
    row = mathverse_rows()[0]
    assert get_benchmark("mathverse", query_type="query_wo").task_from_row(row).question \
        == row["query_wo"]
    with pytest.raises(UserError, match="query_type"):
        get_benchmark("mathverse", query_type="query_xx")


# -- validate -----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_validate_gold_answers_score_full_marks(loaded, name: str) -> None:
    tasks, _ = loaded[name]
    get_benchmark(name).validate(tasks)


def test_validate_names_failing_ids() -> None:
    rows = vsibench_rows()
    rows[0]["ground_truth"] = "three-ish"  # not a number: the reference scorer gives 0
    bench = get_benchmark("vsibench")
    tasks = [bench.task_from_row(r) for r in rows]
    with pytest.raises(DataError, match=r"failing ids: 1\b"):
        bench.validate(tasks)


def test_validate_never_calls_the_judge() -> None:
    def judge(question: str, prediction: str, gold: str) -> float:
        raise AssertionError("validate must be model-free")

    bench = get_benchmark("mathverse", judge=judge)
    bench.validate([bench.task_from_row(r) for r in mathverse_rows()])


# -- per-benchmark scoring details ---------------------------------------------------------------


def test_vstar_scores_by_category() -> None:
    bench = get_benchmark("vstar")
    tasks = [bench.task_from_row(r) for r in vstar_rows()]
    preds = ["A", "<answer>\\boxed{B}</answer>", "(B)", None]
    samples = [(t, bench.score(t, p)) for t, p in zip(tasks, preds)]
    assert samples[1][1] == {"vstar_overall_acc": 0.0, "vstar_direct_attributes_acc": 0.0}
    assert bench.aggregate(samples) == {"vstar_overall_acc": 0.5,
                                        "vstar_direct_attributes_acc": 0.5,
                                        "vstar_relative_position_acc": 0.5}


def test_hrbench_cycles_average_and_judge_fallback() -> None:
    calls = []

    def judge(question: str, prediction: str, gold: str) -> float | None:
        calls.append((prediction, gold))
        return 1.0 if "crimson" in prediction else None

    bench = get_benchmark("hrbench4k", judge=judge)
    tasks = {t.id: t for t in (bench.task_from_row(r) for r in hrbench_rows())}
    # cycle_0: ids 0,1,2 ; cycle_1: ids 10,11,12 (gold letters A,C,A / D,B,D).
    preds = {"0": "A", "1": "C", "2": "the car",       # cycle_0: 2/3
             "10": "a crimson flag", "11": "B", "12": "maybe"}  # cycle_1: judge 1, 1, 0
    samples = [(tasks[i], bench.score(tasks[i], p)) for i, p in preds.items()]
    agg = bench.aggregate(samples)
    assert agg["average"] == pytest.approx((2 / 3 + 2 / 3) / 2)
    assert agg["single"] == pytest.approx((1.0 + 1.0) / 2)
    assert agg["cross"] == pytest.approx((0.0 + 0.0) / 2)
    assert agg["judged"] == pytest.approx(1 / 6)
    assert ("a crimson flag", "D. red") in calls
    # Without a judge an unreadable answer scores 0 and nothing is called.
    plain = get_benchmark("hrbench4k")
    assert plain.score(tasks["10"], "a crimson flag")["average"] == 0.0


def test_mathverse_judge_then_rules() -> None:
    def judge(question: str, prediction: str, gold: str) -> float | None:
        return None if "unsure" in prediction else float(prediction.strip() == gold)

    bench = get_benchmark("mathverse", judge=judge)
    tasks = {t.id: t for t in (bench.task_from_row(r) for r in mathverse_rows())}
    judged = bench.score(tasks["3"], "5")
    assert judged == {"gpt_eval_score": 1.0, "text_only": 1.0, "judged": 1.0}
    ruled = bench.score(tasks["2"], "unsure, but \\boxed{1.5}")
    assert ruled == {"gpt_eval_score": 1.0, "vision_only": 1.0, "judged": 0.0}
    assert bench.score(tasks["1"], "unsure: (C) 130°")["gpt_eval_score"] == 1.0
    agg = bench.aggregate([(tasks["3"], judged), (tasks["2"], ruled)])
    assert agg == {"gpt_eval_score": 1.0, "text_only": 1.0, "vision_only": 1.0, "judged": 0.5}


def test_vsibench_scores_follow_reference_rules() -> None:
    bench = get_benchmark("vsibench")
    tasks = {t.id: t for t in (bench.task_from_row(r) for r in vsibench_rows())}
    assert bench.score(tasks["1"], "three") == {"object_counting_mra": 1.0}
    # |4-3|/3 = 0.33 <= 1 - t for t in 0.50, 0.55, 0.60, 0.65: 4 of 10 thresholds.
    assert bench.score(tasks["1"], "There are 4 chairs") == {"object_counting_mra": 0.4}
    assert bench.score(tasks["1"], "no idea") == {"object_counting_mra": 0.0}
    assert bench.score(tasks["1"], None) == {"object_counting_mra": 0.0}
    assert bench.score(tasks["6"], "B. table") == {"object_rel_distance_accuracy": 1.0}
    assert bench.score(tasks["6"], "b") == {"object_rel_distance_accuracy": 1.0}
    # The reference compares the first word: "(B)" is not "B".
    assert bench.score(tasks["6"], "(B)") == {"object_rel_distance_accuracy": 0.0}


# -- registry and prediction files ---------------------------------------------------------------


def test_registry_names_and_unknown_name_suggestion() -> None:
    assert list(BENCHMARKS) == ["vstar", "hrbench4k", "hrbench8k", "mathverse", "vsibench",
                                "synth-image", "synth-video"]
    for name in BENCHMARKS:
        assert get_benchmark(name).name == name
    with pytest.raises(UserError, match="did you mean 'vstar'"):
        get_benchmark("vstr")
    with pytest.raises(UserError, match="does not take"):
        get_benchmark("vstar", judge=lambda q, p, g: 1.0)


def test_importing_the_package_imports_no_heavy_library() -> None:
    import subprocess
    import sys

    code = ("import sys, benchmarks; "
            "print([m for m in ('datasets', 'numpy', 'math_verify', 'torch', 'benchmarks.vstar') "
            "if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def _write_predictions(path: Path, rows: list[dict[str, Any]], preds: list[str | None]) -> Path:
    path.write_text("".join(json.dumps({**r, "prediction": p}) + "\n"
                            for r, p in zip(rows, preds)))
    return path


def test_score_predictions_matches_scoring_loaded_tasks(loaded, tmp_path: Path) -> None:
    rows = vsibench_rows()
    preds = ["3", "ten", "2.5 meters", "1 meter", "", "B", "C.", "a", "A", "B", "(D)"]
    result = score_predictions("vsibench", _write_predictions(tmp_path / "p.jsonl", rows, preds))
    bench = get_benchmark("vsibench")
    tasks = loaded["vsibench"][0]
    expected = bench.aggregate([(t, bench.score(t, p)) for t, p in zip(tasks, preds)])
    assert result["benchmark"] == "vsibench" and result["n"] == 11
    assert result["aggregate"] == expected
    assert result["per_sample"][0] == {"id": "1", "scores": {"object_counting_mra": 1.0}}
    assert result["per_sample"][4]["scores"] == {"room_size_estimation_mra": 0.0}


def test_score_predictions_reports_bad_lines(tmp_path: Path) -> None:
    path = tmp_path / "p.jsonl"
    rows = vstar_rows()
    path.write_text(json.dumps({**rows[0], "prediction": "A"}) + "\n{not json\n")
    with pytest.raises(DataError, match=r"p\.jsonl:2: malformed JSON"):
        score_predictions("vstar", path)
    # A line cut short: the column is where this line ends, not "1" of a next line.
    path.write_text('{"question_id": 1, "prediction": "A"\r\n')
    with pytest.raises(DataError, match=r"p\.jsonl:1: malformed JSON \(Expecting ',' "
                                        r"delimiter at column 37\)"):
        score_predictions("vstar", path)
    path.write_text(json.dumps(rows[0]) + "\n")
    with pytest.raises(DataError, match=r"p\.jsonl:1: no 'prediction' field"):
        score_predictions("vstar", path)
    path.write_text(json.dumps({**rows[0], "prediction": "A"}) + "\n"
                    + json.dumps({"question_id": 9, "prediction": "A"}) + "\n")
    with pytest.raises(DataError, match=r"p\.jsonl:2: missing column 'text'"):
        score_predictions("vstar", path)
    with pytest.raises(UserError, match="predictions file not found"):
        score_predictions("vstar", tmp_path / "absent.jsonl")


# -- offline ------------------------------------------------------------------------------------


def test_offline_without_data_dir_fails_fast_with_the_route(monkeypatch, tmp_path) -> None:
    import time

    from benchmarks import sources

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(sources, "hub_unreachable_reason",
                        lambda hf_id, timeout_s=8.0: "ConnectError: [Errno 101] unreachable")
    start = time.monotonic()
    with pytest.raises(UserError) as info:
        get_benchmark("vstar").load(cache_dir=tmp_path)
    message = str(info.value)
    assert time.monotonic() - start < 5
    assert "lmms-lab-encoder/vstar-bench" in message
    assert "--data-dir" in message and "pyvision data download vstar" in message


def test_hub_offline_mode_turns_a_cache_miss_into_the_same_error(monkeypatch, tmp_path) -> None:
    import datasets

    from benchmarks import sources

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")

    def no_network(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("must not probe the network in offline mode")

    def cache_miss(*args: Any, **kwargs: Any) -> None:
        raise ConnectionError("Couldn't reach 'DreamMr/HR-Bench' on the Hub (LocalEntryNotFound)")

    monkeypatch.setattr(sources, "hub_unreachable_reason", no_network)
    monkeypatch.setattr(datasets, "load_dataset", cache_miss)
    with pytest.raises(UserError, match=r"DreamMr/HR-Bench.*--data-dir.*pyvision data download "
                                        r"hrbench`"):
        get_benchmark("hrbench8k").load(cache_dir=tmp_path)


def test_hub_path_loads_through_datasets_with_limit(monkeypatch, tmp_path) -> None:
    import datasets

    from benchmarks import sources

    saved = datasets.load_from_disk(str(make_vstar_dir(tmp_path / "copy")))["test"]
    calls = []

    def fake_load_dataset(path: str, name: str | None = None, split: str | None = None):
        calls.append((path, name, split))
        return saved

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(sources, "hub_unreachable_reason", lambda hf_id, timeout_s=8.0: None)
    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    tasks = get_benchmark("vstar").load(limit=2, cache_dir=tmp_path / "cache")
    assert calls == [("lmms-lab-encoder/vstar-bench", None, "test")]
    assert [t.id for t in tasks] == ["0", "1"]
    assert all(Path(t.images[0]).is_file() for t in tasks)


# -- synthetic held-out sets --------------------------------------------------------------------


def make_synth_dir(root: Path) -> Path:
    media = root / "media"
    media.mkdir(parents=True)
    (media / "a.png").write_bytes(png_bytes((200, 0, 0)))
    write_tiny_mp4(media / "v.mp4")
    tasks = [
        Task(id="s1", data_source="synth/image-search", question="What colour is the square?",
             images=["media/a.png"], answer="B", answer_type="choice",
             options=["blue", "red", "green"], metadata={"family": "colour"}, split="heldout"),
        Task(id="s2", data_source="synth/image-search", question="How many squares are there?",
             images=["media/a.png"], answer="4", answer_type="number",
             metadata={"family": "count"}, split="heldout"),
        Task(id="s3", data_source="synth/image-search", question="Name the shape.",
             images=["media/a.png"], answer="a square", answer_type="text",
             metadata={"family": "shape"}, split="heldout"),
        Task(id="s4", data_source="synth/image-search", question="Training only.",
             images=["media/a.png"], answer="1", answer_type="number", split="train"),
        Task(id="v1", data_source="synth/video", question="How far did the ball roll (m)?",
             video="media/v.mp4", answer="2.0", answer_type="number",
             metadata={"family": "distance", "metric": "mra"}, split="heldout"),
        Task(id="v2", data_source="synth/video", question="Which object appears first?",
             video="media/v.mp4", answer="A", answer_type="choice", options=["ball", "box"],
             metadata={"family": "order"}, split="heldout"),
    ]
    (root / "tasks.jsonl").write_text("".join(t.model_dump_json() + "\n" for t in tasks))
    return root


def test_synth_image_loads_heldout_and_scores_with_verify(tmp_path: Path) -> None:
    bench = get_benchmark("synth-image")
    tasks = bench.load(data_dir=make_synth_dir(tmp_path / "data"))
    assert [t.id for t in tasks] == ["s1", "s2", "s3"]
    assert all(Path(p).is_absolute() and Path(p).is_file() for t in tasks for p in t.images)
    assert tasks[0].question == ("What colour is the square?\nOptions:\nA. blue\nB. red\n"
                                 "C. green")
    bench.validate(tasks)
    samples = [(t, bench.score(t, p)) for t, p in zip(tasks, ["red", "4.0", "Square."])]
    assert bench.aggregate(samples) == {"accuracy": 1.0, "colour_accuracy": 1.0,
                                        "count_accuracy": 1.0, "shape_accuracy": 1.0}
    samples = [(t, bench.score(t, p)) for t, p in zip(tasks, ["(A)", "four", None])]
    assert bench.aggregate(samples)["accuracy"] == pytest.approx(1 / 3)


def test_synth_video_reports_mra(tmp_path: Path) -> None:
    bench = get_benchmark("synth-video", mra_threshold=0.5)
    tasks = bench.load(data_dir=make_synth_dir(tmp_path / "data"))
    assert [t.id for t in tasks] == ["v1", "v2"] and Path(tasks[0].video).is_file()
    bench.validate(tasks)
    samples = [(tasks[0], bench.score(tasks[0], "2.62")), (tasks[1], bench.score(tasks[1], "B"))]
    agg = bench.aggregate(samples)
    assert agg["mra"] == pytest.approx(0.4)  # |2.62-2|/2 = 0.31 <= 1-t for t in 0.50..0.65
    assert agg["accuracy"] == 0.0  # MRA 0.4 < 0.5, and B is wrong


def test_synth_needs_a_data_dir() -> None:
    with pytest.raises(UserError, match="--data-dir"):
        get_benchmark("synth-image").load()


def test_json_records_reads_a_list_or_the_list_inside_an_object(tmp_path: Path) -> None:
    from benchmarks.sources import json_records

    (tmp_path / "a.json").write_text(json.dumps([{"q": 1}, {"q": 2}]))
    (tmp_path / "b.json").write_text(json.dumps({"version": "1", "data": [{"q": 3}]}))
    (tmp_path / "c.json").write_text("7")
    (tmp_path / "d.json").write_text('[{"q": 1},\n{"q": }]')
    assert json_records(tmp_path / "a.json") == [{"q": 1}, {"q": 2}]
    assert json_records(tmp_path / "b.json") == [{"q": 3}]
    assert json_records(tmp_path / "c.json") == []  # no records, not a crash
    with pytest.raises(DataError, match=r"d\.json:2: malformed JSON"):
        json_records(tmp_path / "d.json")
