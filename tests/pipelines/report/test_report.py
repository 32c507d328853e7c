"""`pyvision report` renders from a store filled by the test; the HTML is checked in Chromium."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
from typer.testing import CliRunner

from pipelines.report import (
    collect,
    paired_bootstrap,
    results_table,
    stratified_bootstrap,
    to_markdown,
    write_report,
)
from pipelines.store import EvalRecord, Store
from pyvision_cli.report import app

ACC = {"base": 0.10, "sft": 0.40, "rl": 0.55}


def fill_store(store: Store, run_id: str = "demo", shift: float = 0.0) -> None:
    store.upsert_run(run_id, "tiny-cpu", config={"seed": 0})
    for step in range(5):
        store.log_metrics(run_id, "sft", step + 1, {"loss": 3.0 - 0.5 * step})
        store.log_metrics(run_id, "rl", step, {"reward/mean": 0.2 + 0.1 * step + shift,
                                               "tool_calls/mean": 1.0 + 0.1 * step,
                                               "strategy/kept_groups": 4})
    for model, acc in ACC.items():
        for bench in ("synth-image", "synth-video"):
            for i in range(4):
                store.add_eval_record(EvalRecord(
                    run_id=run_id, model=model, benchmark=bench, sample_id=str(i),
                    benchmark_version="1", prompt_version="image@v1", prompt_hash="h",
                    scorer="verify@1", prediction="x", stop_reason="answered" if i else "max_turns",
                    turns=2, tool_calls=1, failed_calls=0, visual_tokens=64 if bench == "synth-image" else 16,
                    total_tokens=500, duration_s=0.1, trajectory=None, scores={"accuracy": float(i < 2)}))
            store.set_eval_aggregate(run_id, model, bench, {"accuracy": acc + shift, "color": acc},
                                     n=4, benchmark_version="1", prompt_version="image@v1",
                                     scorer="verify@1")


def test_results_table_orders_base_sft_rl():
    store = Store()
    fill_store(store)
    header, rows = results_table(collect(store))
    assert header == ["run", "model", "synth-image (accuracy)", "synth-video (accuracy)"]
    assert [r[1] for r in rows] == ["base", "sft", "rl"]
    assert rows[2][2] == "55.0"


def test_json_format_through_cli():
    store = Store()
    fill_store(store, "a")
    fill_store(store, "b", shift=0.05)
    result = CliRunner().invoke(app, ["--format", "json", "--run", "b"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert [r["run_id"] for r in data["runs"]] == ["b"]
    rl = [r for r in data["results"] if r["model"] == "rl" and r["metric"] == "accuracy"]
    assert {r["benchmark"] for r in rl} == {"synth-image", "synth-video"}
    assert rl[0]["value"] == pytest.approx(0.60)
    assert set(data["results"][0]) == {"run", "model", "benchmark", "metric", "value"}


def test_unknown_run_and_empty_store(tmp_path):
    store = Store()
    fill_store(store)
    bad = CliRunner().invoke(app, ["--format", "json", "--run", "nope"])
    assert bad.exit_code == 2 and "run 'nope' is not in the store" in bad.output
    empty = CliRunner().invoke(app, ["--format", "json", "--store", str(tmp_path / "none.duckdb")])
    assert empty.exit_code == 2 and "store not found" in empty.output


def test_markdown_and_html_files(tmp_path):
    store = Store()
    fill_store(store)
    written = write_report(store, None, ["markdown", "html", "json"], tmp_path / "rep")
    md = Path(written["markdown"]).read_text()
    assert "| demo | rl | 55.0 | 55.0 |" in md and "training_curves.png" in md
    assert Path(written["png:training_curves"]).stat().st_size > 1000
    html = Path(written["html"]).read_text()
    assert html.count("data:image/png;base64,") == 2 and "<table class=\"results\">" in html


def test_a_report_that_fails_midway_leaves_the_one_before_whole(tmp_path, monkeypatch):
    # A disk that fills up while a plot is written: the plot was written in place and left
    # truncated under the earlier report.html's name.
    import errno
    import os

    from matplotlib.figure import Figure

    store = Store()
    fill_store(store)
    out = tmp_path / "rep"
    write_report(store, None, ["markdown", "html"], out)
    before = {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()}

    def full_disk(self, fname, **kwargs):
        if hasattr(fname, "write"):
            fname.write(b"\x89PNG, cut short")
        else:
            Path(fname).write_bytes(b"\x89PNG, cut short")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(Figure, "savefig", full_disk)
    with pytest.raises(OSError) as failed:
        write_report(store, None, ["markdown", "html"], out)
    assert failed.value.errno == errno.ENOSPC
    after = {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()}
    assert after == before


def test_a_failed_report_leaves_no_folder_it_made(tmp_path, monkeypatch):
    # A report that failed after making --out (and its parents) left them behind, empty.
    import errno
    import os

    from matplotlib.figure import Figure

    store = Store()
    fill_store(store)

    def full_disk(self, fname, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(fname))

    monkeypatch.setattr(Figure, "savefig", full_disk)
    new = tmp_path / "new" / "rep"
    result = CliRunner().invoke(app, ["--format", "html", "--out", str(new)])
    assert result.exit_code == 2, result.output
    assert "cannot write" in result.output
    assert not (tmp_path / "new").exists()
    # A folder that was there before is the user's: kept, even empty.
    mine = tmp_path / "mine"
    mine.mkdir()
    with pytest.raises(OSError):
        write_report(store, None, ["html"], mine)
    assert mine.is_dir() and list(mine.iterdir()) == []


def _chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.mark.skipif(_chromium() is None, reason="chromium missing: CI installs it")
def test_html_renders_in_headless_chromium(tmp_path):
    store = Store()
    fill_store(store)
    written = write_report(store, None, ["html"], tmp_path / "rep")
    page = Path(written["html"])
    # A wrapper page loads the report in an iframe and records what the browser rendered.
    probe = tmp_path / "probe.html"
    probe.write_text(f"""<!doctype html><html><body><iframe id="r" src="{page.as_uri()}"></iframe>
<script>document.getElementById('r').onload = () => {{
  const d = document.getElementById('r').contentDocument;
  const imgs = [...d.images];
  const out = document.createElement('pre'); out.id = 'result';
  out.textContent = JSON.stringify({{
    rows: d.querySelectorAll('table.results tbody tr').length,
    cells: [...d.querySelectorAll('table.results tbody tr:last-child td')].map(c => c.textContent),
    images: imgs.length, loaded: imgs.filter(i => i.complete && i.naturalWidth > 100).length}});
  document.body.appendChild(out);
}};</script></body></html>""")
    proc = subprocess.run(
        [_chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--no-first-run",
         f"--user-data-dir={tmp_path / 'chrome'}", "--allow-file-access-from-files",
         "--virtual-time-budget=5000", "--dump-dom", probe.as_uri()],
        capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    dom = proc.stdout
    start = dom.index('<pre id="result">') + len('<pre id="result">')
    result = json.loads(dom[start:dom.index("</pre>", start)].replace("&quot;", '"'))
    assert result["rows"] == 3 and result["cells"][:2] == ["demo", "rl"]
    assert result["images"] == 2 and result["loaded"] == 2


def test_paired_bootstrap_is_deterministic_and_brackets_the_mean():
    from pipelines.report import verdict

    assert paired_bootstrap([1.0] * 10) == (1.0, 1.0, 1.0)
    deltas = [1.0, 0.0, -1.0, 0.0, 1.0, 1.0, 0.0, 0.0]
    mean, low, high = paired_bootstrap(deltas)
    assert mean == pytest.approx(0.25) and low < mean < high
    assert paired_bootstrap(deltas) == (mean, low, high)
    assert verdict(low, high) == "not separable"
    assert verdict(0.01, 0.2) == "ahead" and verdict(-0.3, -0.1) == "behind"
    with pytest.raises(ValueError):
        paired_bootstrap([])


def _fill_per_sample(store: Store, correct: dict[str, set[int]], n: int = 40, run: str = "r",
                     recipe: str = "tiny-cpu") -> None:
    store.upsert_run(run, recipe, config={})
    for model, right in correct.items():
        for i in range(n):
            store.add_eval_record(EvalRecord(
                run_id=run, model=model, benchmark="synth-image", sample_id=f"s{i}",
                benchmark_version="1", prompt_version="image@v1", prompt_hash="h",
                scorer="verify@1", prediction="x", stop_reason="answered", turns=2, tool_calls=1,
                failed_calls=0, visual_tokens=16, total_tokens=100, duration_s=0.1,
                trajectory=None, scores={"accuracy": float(i in right)}))
        store.set_eval_aggregate(run, model, "synth-image", {"accuracy": len(right) / n}, n=n,
                                 benchmark_version="1", prompt_version="image@v1",
                                 scorer="verify@1")


def test_report_compares_models_on_paired_samples(tmp_path):
    store = Store()
    # SFT gains 3 samples over base (too few to call); RL keeps SFT's and gains 20 more.
    _fill_per_sample(store, {"base": {0, 1}, "sft": {0, 1, 2, 3, 4}, "rl": set(range(25))})
    data = collect(store)
    got = {(c["model"], c["baseline"]): c for c in data.comparisons}
    assert set(got) == {("sft", "base"), ("rl", "sft")}
    rl = got[("rl", "sft")]
    assert rl["n"] == 40 and rl["delta"] == pytest.approx(0.5) and rl["ci_low"] > 0.3
    assert rl["verdict"] == "ahead"
    assert got[("sft", "base")]["delta"] == pytest.approx(0.075)
    assert got[("sft", "base")]["verdict"] == "not separable"
    written = write_report(store, None, ["markdown", "json"], tmp_path / "rep")
    md = Path(written["markdown"]).read_text()
    assert "| r | synth-image | rl vs sft | accuracy | 40 | 62.5 vs 12.5 | +50.0 |" in md
    js = json.loads(Path(written["json"]).read_text())
    assert [c["verdict"] for c in js["comparisons"]] == ["not separable", "ahead"]


def test_comparison_uses_only_samples_both_models_answered():
    store = Store()
    _fill_per_sample(store, {"sft": {0, 1}, "rl": {0, 1, 2}}, n=10)
    # A resumed RL evaluation with extra samples must not be compared on those.
    store.add_eval_record(EvalRecord(
        run_id="r", model="rl", benchmark="synth-image", sample_id="extra",
        benchmark_version="1", prompt_version="image@v1", prompt_hash="h", scorer="verify@1",
        prediction="x", stop_reason="answered", turns=1, tool_calls=0, failed_calls=0,
        visual_tokens=0, total_tokens=1, duration_s=0.1, trajectory=None,
        scores={"accuracy": 1.0}))
    (cmp,) = collect(store).comparisons
    assert cmp["n"] == 10 and cmp["value"] == pytest.approx(0.3)


def test_runs_of_one_recipe_are_also_compared_pooled(tmp_path):
    # Three seeds, each with SFT 2 of 10 samples ahead of base: too few to call in any one run,
    # clear pooled. A run of another recipe is never pooled with them.
    store = Store()
    for seed in range(3):
        _fill_per_sample(store, {"base": {0}, "sft": {0, 1 + seed, 4 + seed}}, n=10,
                         run=f"seed{seed}")
    _fill_per_sample(store, {"base": set(), "sft": set(range(10))}, n=10, run="x", recipe="other")
    data = collect(store)
    per_run = [c for c in data.comparisons if "runs" not in c]
    assert {c["run"] for c in per_run} == {"seed0", "seed1", "seed2", "x"}
    assert all(c["verdict"] == "not separable" for c in per_run if c["run"] != "x")
    (pooled,) = [c for c in data.comparisons if "runs" in c]
    assert pooled["run"] == "tiny-cpu: 3 runs pooled"
    assert pooled["runs"] == ["seed0", "seed1", "seed2"]
    assert pooled["n"] == 30 and pooled["delta"] == pytest.approx(0.2)
    assert pooled["ci_low"] > 0 and pooled["verdict"] == "ahead"
    assert collect(store).comparisons == data.comparisons  # deterministic
    md = to_markdown(data)
    assert "| tiny-cpu: 3 runs pooled | synth-image | sft vs base | accuracy | 30 |" in md


def test_stratified_bootstrap_of_one_run_is_the_paired_bootstrap():
    deltas = [1.0, 0.0, 0.0, -1.0, 1.0, 1.0, 0.0]
    assert stratified_bootstrap([deltas]) == paired_bootstrap(deltas)
    mean, low, high = stratified_bootstrap([[1.0] * 5, [0.0] * 15])
    assert mean == pytest.approx(0.25) and low == high == pytest.approx(0.25)  # no within-run spread


def test_vstar_and_vsibench_are_reported_and_compared_on_their_own_headline():
    """V*'s headline is vstar_overall_acc and VSI-Bench's vsibench_overall, not the first of
    their metric names by alphabet (a category, a question type): the results table showed V*'s
    direct-attributes accuracy, and the paired comparisons used only the samples of that one
    category (VSI-Bench: of one question type)."""
    store = Store()
    store.upsert_run("r", "tiny-cpu", config={})
    # V*: 4 direct-attributes samples (no change), 6 relative-position ones (RL fixes all 6).
    # VSI-Bench: each sample scored under its question type only.
    vsi_types = ["obj_appearance_order_accuracy"] * 2 + ["object_counting_mra"] * 8
    for model in ("sft", "rl"):
        for i in range(10):
            cat = "direct_attributes" if i < 4 else "relative_position"
            right = float(i < 4 or model == "rl")
            for bench, scores in (
                    ("vstar", {"vstar_overall_acc": right, f"vstar_{cat}_acc": right}),
                    ("vsibench", {vsi_types[i]: right})):
                store.add_eval_record(EvalRecord(
                    run_id="r", model=model, benchmark=bench, sample_id=str(i),
                    benchmark_version="1", prompt_version="image@v1", prompt_hash="h",
                    scorer="s", prediction="x", stop_reason="answered", turns=1, tool_calls=0,
                    failed_calls=0, visual_tokens=0, total_tokens=1, duration_s=0.1,
                    trajectory=None, scores=scores))
        overall = 1.0 if model == "rl" else 0.4
        store.set_eval_aggregate("r", model, "vstar", {
            "vstar_overall_acc": overall, "vstar_direct_attributes_acc": 1.0,
            "vstar_relative_position_acc": 1.0 if model == "rl" else 0.0},
            n=10, benchmark_version="1", prompt_version="image@v1", scorer="s")
        store.set_eval_aggregate("r", model, "vsibench", {
            "vsibench_overall": overall, "obj_appearance_order_accuracy": 1.0,
            "object_counting_mra": 1.0 if model == "rl" else 0.25},
            n=10, benchmark_version="1", prompt_version="image@v1", scorer="s")
    data = collect(store)
    header, rows = results_table(data)
    assert header == ["run", "model", "vsibench (vsibench_overall)", "vstar (vstar_overall_acc)"]
    assert [r[2:] for r in rows] == [["40.0", "40.0"], ["100.0", "100.0"]]
    got = {c["benchmark"]: c for c in data.comparisons if c["run"] == "r"}
    for bench, metric in (("vstar", "vstar_overall_acc"), ("vsibench", "vsibench_overall")):
        assert got[bench]["metric"] == metric
        assert got[bench]["n"] == 10 and got[bench]["delta"] == pytest.approx(0.6)
