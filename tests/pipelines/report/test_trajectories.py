"""Trajectories for people: thumbnails in the store, the trajectory page (checked in headless
Chromium), `pyvision show`, verdict changes, the headline, tables that are never cut.

One store is filled once per module by real evaluations (the agent loop, the sandbox, the
scorers) of three scripted "models" on tasks whose images have known colours: a magenta canvas
with a cyan square. ``sft`` crops the square and answers wrongly, ``rl`` crops it and answers
right, ``base`` answers without looking. So the page must show a magenta input image, a code
block and a cyan interpreter image, and ``rl`` fixes every image sample ``sft`` got wrong.
"""

from __future__ import annotations

import io
import json
import shutil
import subprocess
from pathlib import Path

import pytest
from rich.console import Console
from typer.testing import CliRunner

from pipelines.agent.policies.scripted import ScriptedPolicy
from pipelines.config.recipe import load_recipe
from pipelines.core.media import thumbnail_file, trajectory_media
from pipelines.core.records import Task, write_tasks
from pipelines.eval.runner import run_eval
from pipelines.report import collect, headline, write_report
from pipelines.report.terminal import Images, print_table, render_sample, select
from pipelines.report.trajectories import collect_trajectories, sample_verdict, verdict_changes
from pipelines.store import Store

RUN = "t"
MAGENTA, CYAN = (255, 0, 255), (0, 255, 255)
CROP = ("I zoom into the square.\n<code>\n```python\nimport matplotlib.pyplot as plt\n"
        "crop = image_clue_0.crop((300, 200, 380, 280))  # the square\n"
        "plt.imshow(crop); plt.axis('off'); plt.show()\nprint('crop size', crop.size)\n```\n</code>")
FRAME = ("I look at one frame.\n<code>\n```python\nframe = video_clue_0[0].asnumpy()\n"
         "plt.imshow(frame); plt.show()\n```\n</code>")


def _answer(text: str) -> str:
    return f"So the answer is {text}.\n<answer>\n\\boxed{{{text}}}\n</answer>"


def _policy(model: str) -> ScriptedPolicy:
    def turn(h) -> str:
        video = any("Frame Count" in (p.get("text") or "") for p in h.messages[0]["content"])
        if video:
            if model == "sft" and h.turn == 0:
                return FRAME
            return _answer("3")
        if model in ("sft", "rl") and h.turn == 0:
            return CROP
        return _answer("B" if model == "rl" else "A")
    return ScriptedPolicy(turn)


def _image_tasks(root: Path, n: int = 3) -> Path:
    from PIL import Image, ImageDraw

    media = root / "media"
    media.mkdir(parents=True)
    tasks = []
    for i in range(n):
        img = Image.new("RGB", (400, 300), MAGENTA)
        ImageDraw.Draw(img).rectangle((300 + i, 200, 380 + i, 280), fill=CYAN)
        img.save(media / f"sq{i}.png")
        tasks.append(Task(id=f"sq{i}", data_source="synth/image-search/color",
                          question="What colour is the small square?",
                          images=[f"media/sq{i}.png"], answer="B", answer_type="choice",
                          options=["magenta", "cyan"], metadata={"family": "color"},
                          split="heldout"))
    write_tasks(root / "tasks.jsonl", tasks)
    return root


@pytest.fixture(scope="module")
def evaluated(tmp_path_factory) -> dict:
    from pipelines.data.synth import synthesize

    root = tmp_path_factory.mktemp("traj")
    images = _image_tasks(root / "images")
    synthesize("video", 2, 0, root / "videos", split="heldout", progress=False)
    store = Store(root / "store.duckdb")
    recipe = load_recipe(None, ["agent.max_turns_eval=3", "eval.batch_size=4",
                                f"runs_dir={root / 'runs'}"])
    for model in ("base", "sft", "rl"):
        run_eval(recipe, model="scripted", model_tag=model,
                 benchmarks=["synth-image", "synth-video"], run_id=RUN, store=store,
                 data_dirs={"synth-image": images, "synth-video": root / "videos"},
                 policy=_policy(model), show_progress=False,
                 register_run={"name": "tiny-cpu", "recipe_path": None,
                               "config": recipe.model_dump(mode="json")})
    return {"root": root, "store": store, "recipe": recipe}


# -- what is stored ----------------------------------------------------------------------------


def test_thumbnails_are_stored_once_and_indexed_like_the_turns(evaluated):
    store = evaluated["store"]
    recs = {(r["model"], r["sample_id"]): r for r in store.eval_records(
        RUN, benchmark="synth-image", with_trajectory=True, with_media=True)}
    sft, rl, base = recs[("sft", "sq0")], recs[("rl", "sq0")], recs[("base", "sq0")]
    # The input image is one thumbnail whichever model looked at it.
    assert sft["media"]["inputs"] == rl["media"]["inputs"] == base["media"]["inputs"]
    (shown,) = sft["trajectory"]["turns"][0]["image_indices"]
    crop = sft["media"]["images"][shown]
    assert crop not in sft["media"]["inputs"]
    blobs = store.media([sft["media"]["inputs"][0], crop])
    assert set(blobs) == {sft["media"]["inputs"][0], crop}
    from PIL import Image

    source = Image.open(io.BytesIO(blobs[sft["media"]["inputs"][0]].data)).convert("RGB")
    interp = Image.open(io.BytesIO(blobs[crop].data)).convert("RGB")
    assert source.size == (400, 300) and blobs[crop].mime == "image/webp"
    assert _share(source, MAGENTA) > 0.7 and _share(interp, CYAN) > 0.3
    # Same image, same bytes, same name: a report built from them is repeatable.
    again = thumbnail_file(evaluated["root"] / "images/media/sq0.png", 512)
    assert again.sha256 == sft["media"]["inputs"][0]


def test_thumbnails_can_be_switched_off():
    from types import SimpleNamespace

    task = SimpleNamespace(video=None, image_paths=lambda root: [])
    assert trajectory_media(task, Path("/"), SimpleNamespace(prompt=[], images=[], variant="image"),
                            0) == (None, [])


def _share(img, rgb, tol: int = 60) -> float:
    px = list(img.getdata())
    return sum(all(abs(a - b) <= tol for a, b in zip(p, rgb)) for p in px) / len(px)


# -- verdicts and changes ----------------------------------------------------------------------


def test_verdict_changes_between_two_models(evaluated):
    ts = collect_trajectories(evaluated["store"], [RUN])
    assert [m["key"] for m in ts.models] == ["t/base", "t/sft", "t/rl"]
    changes = verdict_changes(ts, "t/sft", "t/rl", "synth-image")
    assert [(c["sample_id"], c["change"]) for c in changes] == [(f"sq{i}", "fixed") for i in range(3)]
    assert verdict_changes(ts, "t/rl", "t/sft", "synth-image")[0]["change"] == "broken"
    assert sample_verdict(0.5) == "partial" and sample_verdict(None) == "unscored"
    data = collect(evaluated["store"], [RUN])
    row = next(c for c in data.verdict_changes if c["benchmark"] == "synth-image"
               and c["model"] == "rl")
    assert (row["n"], row["fixed"], row["broken"]) == (3, 3, 0)


def _cmp(run, bench, model, baseline, delta, low, high, verdict, **extra):
    return {"run": run, "benchmark": bench, "model": model, "baseline": baseline,
            "delta": delta, "ci_low": low, "ci_high": high, "verdict": verdict, **extra}


def test_headline_says_one_sentence_per_comparison(evaluated):
    from pipelines.report import ReportData

    data = ReportData(runs=[], results=[], comparisons=[
        _cmp("demo", "video", "rl", "sft", 0.125, 0.038, 0.212, "ahead"),
        _cmp("demo", "images", "rl", "sft", 0.05, -0.008, 0.108, "not separable"),
        _cmp("demo", "maths", "rl", "sft", -0.1, -0.2, -0.01, "behind"),
        _cmp("demo", "images", "sft", "base", 0.0, -0.05, 0.05, "not separable"),
        _cmp("tiny-cpu: 5 runs pooled", "video", "rl", "sft", 0.125, 0.038, 0.212, "ahead",
             runs=["a", "b", "c", "d", "e"])])
    assert headline(data) == [
        ("In run demo, RL is ahead of SFT on video by 12.5 points [3.8, 21.2], behind it on maths "
        "by 10.0 points [-20.0, -1.0]; on images (+5.0 [-0.8, +10.8]) it is not separable."),
        "In run demo, SFT and the base model are not separable on images (+0.0 [-5.0, +5.0]).",
        ("Pooled over the 5 runs of tiny-cpu, RL is ahead of SFT on video by 12.5 points "
        "[3.8, 21.2].")]
    sentences = headline(collect(evaluated["store"], [RUN]))
    assert sentences == [
        ("SFT and the base model are not separable on synth-image (+0.0 [+0.0, +0.0]) and "
        "synth-video (+0.0 [+0.0, +0.0])."),
        ("RL is ahead of SFT on synth-image by 100.0 points [100.0, 100.0]; on synth-video "
        "(+0.0 [+0.0, +0.0]) it is not separable.")]


# -- the page ----------------------------------------------------------------------------------


def test_report_writes_the_trajectory_page_repeatably(evaluated, tmp_path):
    store = evaluated["store"]
    first = write_report(store, [RUN], ["html", "markdown"], tmp_path / "a")
    second = write_report(store, [RUN], ["html", "markdown"], tmp_path / "b")
    for kind in ("trajectories", "html", "markdown"):
        assert Path(first[kind]).read_bytes() == Path(second[kind]).read_bytes(), kind
    page = Path(first["trajectories"]).read_text()
    ts = collect_trajectories(store, [RUN])
    media = sorted(p.name for p in (tmp_path / "a" / "media").iterdir())
    assert media == sorted(f"{sha}.webp" for sha in ts.media) and len(media) >= 3
    assert "http://" not in page and "https://" not in page  # nothing from the network
    assert "</script><script>" in page and "\\u003canswer>" in page  # model text cannot end it
    report = Path(first["html"]).read_text()
    assert "trajectories.html#a=t%2Fsft&amp;b=t%2Frl&amp;bench=synth-image" in report
    assert "<p class='headline'>RL is ahead of SFT" in report
    md = Path(first["markdown"]).read_text()
    assert md.startswith("# PyVision report\n\nSFT and the base model")
    assert "| t | synth-image | rl vs sft | 3 | 3 | 0 | 0 |" in md


def _chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


def _run_chromium(tmp_path: Path, url: str, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [_chromium(), "--headless", "--no-sandbox", "--disable-gpu",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--no-first-run", f"--user-data-dir={tmp_path / 'chrome'}",
         "--allow-file-access-from-files", "--force-device-scale-factor=1", "--hide-scrollbars",
         "--window-size=1400,1800", "--virtual-time-budget=8000", *extra, url],
        capture_output=True, text=True, timeout=120, check=False)


@pytest.mark.skipif(_chromium() is None, reason="chromium missing: CI installs it")
def test_page_in_headless_chromium_shows_images_code_and_narrows_to_changes(evaluated, tmp_path):
    from PIL import Image

    written = write_report(evaluated["store"], [RUN], ["html"], tmp_path / "rep")
    page = Path(written["trajectories"]).as_uri()
    # iframe #v: one sample opened (what the screenshot shows, at the top left); iframe #f, out of
    # view: the list, then the "verdict changed from sft to rl" filter chosen in its selects.
    probe = tmp_path / "probe.html"
    probe.write_text(f"""<!doctype html><html><body style="margin:0">
<iframe id="v" style="position:fixed;left:0;top:0;width:1400px;height:1800px;border:0"
  src="{page}#open=t%2Frl%7Csynth-image%7Csq0"></iframe>
<iframe id="f" style="position:absolute;left:0;top:3000px;width:1400px;height:900px;border:0"
  src="{page}"></iframe>
<script>
let loaded = 0;
const rect = (d, sel) => {{ const n = d.querySelector(sel); if (!n) return null;
  const r = n.getBoundingClientRect();
  return {{x: r.x, y: r.y, w: r.width, h: r.height,
           ok: n.tagName !== 'IMG' || (n.complete && n.naturalWidth > 0)}}; }};
function done() {{
  const v = document.getElementById('v').contentDocument;
  const f = document.getElementById('f').contentDocument;
  const before = f.querySelectorAll('#list .row').length;
  const pick = (key, value) => {{ const s = f.querySelector(`select[data-key="${{key}}"]`);
    s.value = value; s.dispatchEvent(new Event('change')); }};
  pick('a', 't/sft'); pick('b', 't/rl');
  const rows = [...f.querySelectorAll('#list .row')];
  const out = document.createElement('pre'); out.id = 'result';
  out.textContent = JSON.stringify({{
    input: rect(v, '.sample .thumbs img'), code: rect(v, '.col pre.code'),
    interp: rect(v, '.col .interp img'), columns: v.querySelectorAll('.col').length,
    keyword: v.querySelector('.col pre.code .tok-kw') !== null,
    before, after: rows.length, badges: rows.map(r => r.querySelector('.chg')?.textContent),
    count: f.getElementById('count').textContent}});
  document.body.appendChild(out);
}}
for (const id of ['v', 'f'])
  document.getElementById(id).onload = () => {{ if (++loaded === 2) setTimeout(done, 300); }};
</script></body></html>""")
    dom = _run_chromium(tmp_path, probe.as_uri(), "--dump-dom")
    assert dom.returncode == 0, dom.stderr[-2000:]
    start = dom.stdout.index('<pre id="result">') + len('<pre id="result">')
    got = json.loads(dom.stdout[start:dom.stdout.index("</pre>", start)]
                     .replace("&quot;", '"').replace("&gt;", ">").replace("&amp;", "&"))
    ts = collect_trajectories(evaluated["store"], [RUN])
    expected = verdict_changes(ts, "t/sft", "t/rl")
    assert got["before"] == len(ts.entries) == 15
    assert 0 < got["after"] == len(expected) < got["before"]
    assert all(b and b.startswith(("fixed", "broken", "changed")) for b in got["badges"])
    assert got["columns"] == 1 and got["keyword"]
    for name in ("input", "code", "interp"):
        r = got[name]
        assert r and r["ok"] and r["w"] > 20 and r["y"] + r["h"] < 1800, (name, r)
    shot = tmp_path / "shot.png"
    proc = _run_chromium(tmp_path, probe.as_uri(), f"--screenshot={shot}")
    assert proc.returncode == 0 and shot.is_file(), proc.stderr[-2000:]
    img = Image.open(shot).convert("RGB")

    def region(r):
        return img.crop((int(r["x"]) + 2, int(r["y"]) + 2, int(r["x"] + r["w"]) - 2,
                         int(r["y"] + r["h"]) - 2))

    assert _share(region(got["input"]), MAGENTA) > 0.5      # the input image is drawn
    code = region(got["code"])
    assert _share(code, (15, 23, 42), tol=12) > 0.5         # the code block's background
    assert _share(code, (192, 132, 252), tol=50) > 0.001    # highlighted keywords
    assert _share(region(got["interp"]), CYAN) > 0.2         # the interpreter's crop


# -- the terminal ------------------------------------------------------------------------------


def _console(width: int = 100, terminal: bool = False) -> Console:
    return Console(file=io.StringIO(), width=width, force_terminal=terminal, color_system=None)


def test_terminal_view_of_one_sample(evaluated, tmp_path):
    store = evaluated["store"]
    ts = collect_trajectories(store, [RUN], with_rollouts=False)
    console = _console()
    images = Images(store, console, "paths", tmp_path / "media")
    render_sample(console, ts, select(ts, sample="sq1", benchmark="synth-image"), images)
    out = console.file.getvalue()
    assert "What colour is the small square?" in out and "gold: B (cyan)" in out
    assert out.index("t/base · wrong") < out.index("t/sft · wrong") < out.index("t/rl · right")
    assert "crop = image_clue_0.crop((300, 200, 380, 280))" in out and "crop size (80, 80)" in out
    assert "scored by rules" in out and "stop: answered" in out
    paths = [line.split(": ", 1)[1].strip() for line in out.splitlines()
             if "interpreter image 1:" in line or "input image 1:" in line]
    assert len(paths) == 3 and all(Path(p).is_file() and p.endswith(".webp") for p in paths)
    video = _console()
    render_sample(video, ts, select(ts, models=["t/rl"], benchmark="synth-video",
                                    sample=ts.samples[-1]["id"]), images)
    assert "the code sampled no frames (0 visual tokens)" in video.file.getvalue()


def test_show_cli(evaluated, monkeypatch):
    from pyvision_cli.show import app

    store = str(evaluated["store"].path)
    runner = CliRunner()
    listed = runner.invoke(app, [RUN, "--store", store, "--changed", "sft", "rl",
                                 "--benchmark", "synth-image", "--json"])
    assert listed.exit_code == 0, listed.output
    data = json.loads(listed.stdout)
    assert [c["change"] for c in data["changes"]] == ["fixed"] * 3
    one = runner.invoke(app, [RUN, "--store", store, "--sample", "sq2", "--model", "rl",
                              "--json", "--images", "paths"])
    assert one.exit_code == 0, one.output
    (entry,) = json.loads(one.stdout)
    assert entry["verdict"] == "right" and Path(entry["steps"][0]["imgs"][0]).is_file()
    bad = runner.invoke(app, [RUN, "--store", store, "--changed", "sft", "rll"])
    assert bad.exit_code == 2 and "did you mean 't/rl'" in bad.output
    both = runner.invoke(app, [RUN, "--store", store, "--sample", "sq0", "--changed", "a", "b"])
    assert both.exit_code == 2 and "cannot be combined" in both.output
    for extra in (["--verdict", "right"], ["--verdict", "bogus"], ["--model", "rl"]):
        # ignored before: the full list of changes, exit 0, even for an unknown verdict
        ignored = runner.invoke(app, [RUN, "--store", store, "--changed", "sft", "rl", *extra])
        assert ignored.exit_code == 2 and f"{extra[0]} does not apply to --changed" \
            in ignored.output
    missing = runner.invoke(app, ["nope", "--store", store])
    assert missing.exit_code == 2 and "run 'nope' is not in the store" in missing.output


@pytest.mark.parametrize(("media_dir", "extra"), [("a-file", []), ("a-file/media", ["--json"])])
def test_show_media_dir_under_or_at_a_file_is_one_line(evaluated, tmp_path, media_dir, extra):
    from pyvision_cli.show import app

    (tmp_path / "a-file").write_text("not a folder\n")
    result = CliRunner().invoke(app, [RUN, "--store", str(evaluated["store"].path), "--sample",
                                      "sq0", "--images", "paths", "--media-dir",
                                      str(tmp_path / media_dir), *extra])
    assert result.exit_code == 2, result.output
    (line,) = result.output.splitlines()
    assert line.startswith("error: ") and "a-file" in line and "is a file" in line, line
    assert (tmp_path / "a-file").read_text() == "not a folder\n"


HOSTILE = "\x1b[2J\x1b]0;title\x07\x1b]8;;http://x\x1b\\link\x1b]8;;\x1b\\ \x9b31m \u202eevil"


def test_show_escapes_control_characters_from_model_text(tmp_path):
    """Model text, interpreter output and stored rows reach `pyvision show` with their ESC, BEL
    and bidi characters escaped: raw, they cleared the screen, set the title, planted links."""
    from pipelines.report.terminal import render_changes, render_list

    root = _image_tasks(tmp_path / "images", n=1)
    code = f"{HOSTILE}\n<code>\n```python\nprint({HOSTILE!r})\n```\n</code>"
    policy = ScriptedPolicy(lambda h: code if h.turn == 0 else _answer("B" + HOSTILE))
    store = Store(tmp_path / "store.duckdb")
    recipe = load_recipe(None, ["agent.max_turns_eval=2", f"runs_dir={tmp_path / 'runs'}"])
    run_eval(recipe, model="scripted", model_tag="sft", benchmarks=["synth-image"], run_id=RUN,
             store=store, data_dirs={"synth-image": root}, policy=policy, show_progress=False)
    ts = collect_trajectories(store, [RUN], with_rollouts=False)
    console = _console(width=400, terminal=True)
    render_list(console, ts, select(ts), 10)
    render_sample(console, ts, select(ts, sample="sq0"), Images(store, console, "none", tmp_path))
    e = select(ts)[0]
    render_changes(console, [{"benchmark": "synth-image", "sample_id": "sq0\x1b[5m",
                              "change": "fixed", "a": e, "b": e, "sample": ts.samples[0]}],
                   "a", "b", 10)
    out = console.file.getvalue()
    for raw in ("\x1b", "\x07", "\x9b", "\u202e"):
        assert raw not in out
    assert out.count("\\x1b[2J") >= 5 and "\\u202eevil" in out and "sq0\\x1b[5m" in out
    from pipelines.console import terminal_safe

    assert terminal_safe("line\r\nnext\rover\tx") == "line\nnext\\rover\tx"


def test_inline_images_where_the_terminal_draws_them():
    from pipelines.report.terminal import inline_image, inline_protocol

    assert inline_protocol({"TERM_PROGRAM": "iTerm.app"}) == "iterm"
    assert inline_protocol({"TERM": "xterm-kitty"}) == "kitty"
    assert inline_protocol({"TERM": "xterm-256color"}) is None
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (4, 4), CYAN).save(buf, format="WEBP")
    assert inline_image(buf.getvalue(), "iterm").startswith("\033]1337;File=inline=1;")
    assert inline_image(buf.getvalue(), "kitty").startswith("\033_Ga=T,f=100,m=0;")


def test_tables_are_never_cut():
    header = ["run", "benchmark", "comparison", "95% interval", "verdict"]
    rows = [["seed0", "synth-image", "rl vs sft", "[+6.2, +31.2]", "not separable"]]
    log = _console(width=40)
    print_table("paired comparisons", header, rows, log)
    text = log.file.getvalue()
    assert "…" not in text and "benchmark" in text and "not separable" in text
    assert max(len(line) for line in text.splitlines()) > 40  # a log line is as wide as needed
    narrow = _console(width=40, terminal=True)
    print_table("paired comparisons", header, rows, narrow)
    text = narrow.file.getvalue()
    assert "…" not in text and "benchmark synth-image" in text and "[+6.2, +31.2]" in text
    wide = _console(width=120, terminal=True)
    print_table("paired comparisons", header, rows, wide)
    assert "┃ benchmark " in wide.file.getvalue()


def test_table_titles_and_headers_are_text_not_markup():
    # Model keys (a folder's path by default) reach titles and headers: '[/b]' raised a
    # MarkupError and '[v2]' vanished.
    log = _console(width=200)
    print_table("changed from /m/x[/b] to /m/y [v2]", ["/m/x[/b] answer", "[v2] answer"],
                [["a", "b"]], log)
    text = " ".join(log.file.getvalue().split())  # the title wraps to the table's width
    assert "changed from /m/x[/b] to /m/y [v2]" in text
    assert "/m/x[/b] answer" in text and "[v2] answer" in text


def test_perf_report_measures_a_filled_store():
    from pipelines.perf.report import run_benchmark

    result = run_benchmark(12, browser=False)
    assert result["samples"] == 12 and result["models"] == 3
    assert result["thumbnails"] >= 12  # inputs shared by the models, one crop or two each
    for key in ("collect_s", "report_s", "page_mb", "media_mb"):
        assert result[key] > 0, key
    assert result["page_s"] >= 0 and result["media_s"] >= 0  # can round to 0 for 12 samples
    assert result["browser_s"] is None and result["page_ready_ms"] is None


def test_a_store_from_before_thumbnails_still_reports(evaluated, tmp_path):
    """A store written before migration 005, opened read-only (not migrated): no thumbnails
    or rollouts, and the page says so instead of failing."""
    import duckdb

    old = tmp_path / "old.duckdb"
    shutil.copy(evaluated["store"].path, old)
    with duckdb.connect(str(old)) as con:
        con.execute("DROP TABLE media")
        con.execute("DROP TABLE rl_rollouts")
        con.execute("ALTER TABLE eval_trajectories DROP COLUMN media")
        con.execute("DELETE FROM schema_version WHERE version = 5")
    store = Store(old, read_only=True)
    ts = collect_trajectories(store, [RUN])
    assert len(ts.entries) == 15 and ts.steps == []
    assert not any(e["images_stored"] for e in ts.entries)
    # The input images are still where the tasks say: thumbnails are made for the page.
    assert all(s["inputs"] and s["inputs"][0] for s in ts.samples if not s["video"])
    written = write_report(store, [RUN], ["html"], tmp_path / "rep")
    assert len(list((tmp_path / "rep" / "media").iterdir())) == 3  # one per input image
    assert Path(written["trajectories"]).is_file()
    sft = next(e for e in ts.entries if ts.models[e["m"]]["model"] == "sft"
               and ts.samples[e["s"]]["benchmark"] == "synth-image")
    assert sft["steps"][0]["imgs"] == [None]  # the page says "(interpreter image 1 not stored)"


def test_the_terminal_view_shows_model_text_and_output_without_escape_sequences():
    # What the model wrote and its code printed would otherwise drive the terminal (OSC 52
    # writes its clipboard); markup in it is shown, not applied.
    from types import SimpleNamespace

    from pipelines.report.terminal import render_entry

    hostile = "[/oops] A\x1b]52;c;cHduZWQ=\x07B"
    ts = SimpleNamespace(samples=[{"gold": "B", "video": None}], models=[{"key": "t/rl"}])
    step = {"text": hostile, "code": f"print({hostile!r})", "status": "error", "tool_s": 0.1,
            "truncated": False, "out": hostile, "err": hostile, "after": hostile}
    entry = {"s": 0, "m": 0, "verdict": "wrong", "prediction": hostile, "score": 0.0,
             "metric": "acc", "scored_by": "rules", "scorer": "exact", "turns": 2, "tools": 1,
             "failed": 1, "visual": 0, "stop": "answered", "seconds": 1.0, "steps": [step]}
    console = _console(width=200, terminal=True)
    render_entry(console, ts, entry, SimpleNamespace(show=lambda *a: None))
    out = console.file.getvalue()
    assert "\x1b" not in out and "\x07" not in out, repr(out)
    assert out.count("[/oops] A\\x1b]52;c;cHduZWQ=\\x07B") >= 5
