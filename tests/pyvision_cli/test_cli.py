"""CLI conventions: instant --help, lazy command modules, one-line user errors with exit 2."""

from __future__ import annotations

import errno
import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from pipelines.errors import ConfigError
from pyvision_cli.common import command, make_app
from pyvision_cli.main import COMMANDS, app

HEAVY = ("torch", "transformers", "verl", "vllm", "llamafactory", "lmms_eval", "duckdb", "numpy")
runner = CliRunner()


def test_help_lists_every_command_without_importing_them():
    code = ("import sys; from pyvision_cli.main import main\n"
            "try:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
            f"print(sorted(m for m in {HEAVY!r} if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    # No heavy import is what keeps --help fast (~0.3 s); a wall-clock bound flakes on a busy box.
    assert out.stdout.strip().splitlines()[-1] == "[]"
    listing = " ".join(out.stdout.split())
    for name, (_, line) in COMMANDS.items():
        assert f"{name} {line}" in listing, name


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_each_command_shows_the_root_listings_line(name):
    """Each command module's app is made with the line `pyvision --help` lists for it (a command
    group, such as `pyvision model`, shows it atop its own --help)."""
    app = importlib.import_module(COMMANDS[name][0]).app
    assert app.info.help.split("\n\n")[0] == COMMANDS[name][1]


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_command_modules_import_no_ml_library(name):
    module_name = COMMANDS[name][0]
    try:
        spec = importlib.util.find_spec(module_name)
    except ModuleNotFoundError:
        spec = None
    if spec is None:
        pytest.fail(f"command module {module_name} is registered but missing")
    code = (f"import sys, {module_name}\n"
            f"print(sorted(m for m in {HEAVY!r} if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", f"{module_name} imports {out.stdout.strip()} at import time"


def test_user_error_is_one_line_exit_2_no_traceback():
    demo = make_app("demo")

    @command(demo)
    def boom() -> None:
        raise ConfigError("unknown config key 'x' in r.yaml", hint="remove it")

    result = runner.invoke(demo, [])
    assert result.exit_code == 2
    assert "Traceback" not in result.output
    assert "unknown config key 'x' in r.yaml. Fix: remove it." in result.output


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EDQUOT, errno.EROFS])
def test_a_disk_that_refuses_a_write_is_one_line_exit_2(code):
    # A full disk mid-command (`pyvision report`, a stage writing its folder) used to end in a
    # traceback from deep inside PIL or matplotlib, exit 1.
    demo = make_app("demo")

    @command(demo)
    def write() -> None:
        raise OSError(code, os.strerror(code), "/runs/report/report.html")

    result = runner.invoke(demo, [])
    assert result.exit_code == 2
    (line,) = result.output.strip().splitlines()
    assert line == (f"error: cannot write /runs/report/report.html ({os.strerror(code)}). Fix: "
                    "free space on that disk, or write elsewhere (--out, --store, --set "
                    "runs_dir=DIR).")


def test_other_os_errors_are_not_passed_off_as_a_full_disk():
    demo = make_app("demo")

    @command(demo)
    def fail() -> None:
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    result = runner.invoke(demo, [])
    assert result.exit_code == 1 and isinstance(result.exception, OSError)


def test_user_error_inside_a_group_command_exits_2():
    group = make_app("group")

    @command(group)
    def one() -> None:
        raise ConfigError("bad")

    @command(group)
    def two() -> None:
        typer.echo("fine")

    assert runner.invoke(group, ["one"]).exit_code == 2
    assert runner.invoke(group, ["two"]).output.strip() == "fine"


def test_a_tilde_the_shell_left_is_expanded_before_the_command_runs(tmp_path, monkeypatch):
    # `--out=~/x` and quoted values keep their `~`: checks that expanded it and work that did
    # not saw two folders (a model "not a repo id", output under ./~/).
    monkeypatch.setenv("HOME", str(tmp_path))
    group = make_app("group", group=True)
    seen = {}

    @command(group)
    def paths(out: Path, model: str = "", question: str = "",
              extra: list[Path] | None = None) -> None:
        seen.update(out=out, model=model, question=question, extra=extra)

    result = runner.invoke(group, ["paths", "~/out", "--model=~/base", "--question", "~/x?",
                                   "--extra", "~/a", "--extra", "b"])
    assert result.exit_code == 0, result.output
    assert seen == {"out": tmp_path / "out", "model": str(tmp_path / "base"),
                    "question": "~/x?", "extra": [tmp_path / "a", Path("b")]}
    runner.invoke(group, ["paths", "o", "--model", "Qwen/Qwen2.5-VL-7B-Instruct"])
    assert seen["model"] == "Qwen/Qwen2.5-VL-7B-Instruct"  # a hub id stays as it is


def test_doctor_json_through_root_app(tmp_path):
    result = runner.invoke(app, ["doctor", "--json", "--offline", "--store", str(tmp_path / "s.duckdb")])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    names = {c["name"] for c in data["checks"]}
    assert {"python", "package torch", "package verl", "torch device", "sandbox isolation",
            "sandbox runtime", "store"} <= names
    (runtime,) = [c for c in data["checks"] if c["name"] == "sandbox runtime"]
    assert runtime["status"] == "ok" and "decord" in runtime["found"], runtime
    assert data["ok"] is True
    assert all(c["status"] in ("ok", "warn", "missing") for c in data["checks"])
    assert all(c["fix"] for c in data["checks"] if c["status"] != "ok")


def test_doctor_warns_of_a_store_that_cannot_be_created(tmp_path):
    # It said "ok (not created yet; made on first run)", and the first run then failed.
    (tmp_path / "afile").write_text("x")
    result = runner.invoke(app, ["doctor", "--json", "--offline", "--store",
                                 str(tmp_path / "afile" / "s.duckdb")])
    (store,) = [c for c in json.loads(result.stdout)["checks"] if c["name"] == "store"]
    assert store["status"] == "warn" and "afile" in store["found"] and store["fix"], store


def test_unknown_command_is_usage_error():
    result = runner.invoke(app, ["nope"])
    assert result.exit_code == 2


def _all_commands():
    """(path, command, context) for every command and group of the real CLI."""
    from typer._click.core import Context
    from typer.core import TyperGroup

    root = typer.main.get_command(app)
    out = []

    def walk(cmd, ctx, path):
        out.append((path, cmd, ctx))
        if isinstance(cmd, TyperGroup):
            for name in cmd.list_commands(ctx):
                sub = cmd.get_command(ctx, name)
                walk(sub, Context(sub, parent=ctx, info_name=name), f"{path} {name}")

    walk(root, Context(root, info_name="pyvision"), "pyvision")
    return out


def test_help_shows_defaults_and_choices_not_types():
    import re

    checked = 0
    for path, cmd, ctx in _all_commands():
        text = cmd.get_help(ctx)
        assert "<bool>" not in text and "<str>" not in text, f"{path}:\n{text}"
        assert not re.search(r"\S \.(\s|$)", text), f"stray ' .' in {path}:\n{text}"
        for param in cmd.params:
            if getattr(param, "is_flag", False) or param.name == "help":
                continue
            line = " ".join(text.split())
            choices = getattr(getattr(param, "type_descriptor", None), "choices", None)
            if choices:
                assert "<" + "|".join(str(c) for c in choices) + ">" in line, (path, param.name)
            if param.default is not None and param.show_default is not False \
                    and param.param_type_name == "option":
                default = param.default if not isinstance(param.default, list) else ""
                assert f"[default: {default}" in line or "[default:" in line, (path, param.name)
            checked += 1
    assert checked > 60


def test_argument_errors_come_before_heavy_imports():
    code = ("import sys\nfrom pyvision_cli.main import main\n"
            "for argv in (['model', 'tiny', 'x', '--size', 'huge'], ['eval', '--benchmarks', 'v'],"
            " ['rl', '--engine', 'ray'], ['run', 'r.yaml', '--from', 'nope'],"
            " ['eval', '--model', 'm', '--run-id', '../x']):\n"
            "    try:\n        main(argv)\n    except SystemExit as e:\n"
            "        assert e.code == 2, (argv, e.code)\n"
            f"print(sorted(m for m in {HEAVY!r} if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stderr  # no heavy import: fast, without a timed bound
    assert out.stderr.count("error: ") == 5, out.stderr


def test_usage_errors_are_one_line():
    result = runner.invoke(app, ["model", "tiny", "x", "--size", "huge"], prog_name="pyvision")
    assert result.exit_code == 2
    assert result.output.strip().splitlines() == [
        ("error: Invalid value for '--size': 'huge' is not one of 'nano', 'small'. "
         "Fix: see `pyvision model tiny --help`.")]


@pytest.mark.parametrize(("argv", "named"), [
    (["agent", "run", "--model", "m", "--question", "q", "--image", "a.png", "--out-dir", ""],
     "--out-dir is empty"),
    (["data", "synth", "--kind", "video", "--n", "2", "--out="], "--out is empty"),
    (["eval", "--model", "m", "--store", "   "], "--store is empty"),
    (["data", "validate", ""], "an argument is empty"),
    (["run", " "], "an argument is empty"),
])
def test_blank_values_are_refused_before_anything_runs(tmp_path, monkeypatch, argv, named):
    # A blank path would otherwise be the current folder (written into), a blank name sent on.
    monkeypatch.chdir(tmp_path)
    result = runner.invoke(app, argv, prog_name="pyvision")
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {named}"), lines
    assert list(tmp_path.iterdir()) == []


def test_blank_value_reads_the_raw_arguments():
    from pyvision_cli.common import blank_value

    assert blank_value(["--out", "x", "--n", "2"]) is None
    assert blank_value(["--set", "a.b=", "--n", "2"]) is None  # a value that ends in '=' is text
    assert blank_value(["--out", "x", "--question", "\t"]) == "--question"
    assert blank_value(["--served-model="]) == "--served-model"
    assert blank_value(["--json", ""]) == "--json"


def test_agent_run_shows_model_text_and_output_as_text(tmp_path, monkeypatch):
    # What the model wrote and its code printed is shown as plain text: no escape sequence
    # reaches the terminal, and rich markup in it is neither applied nor an error ([/x] raised).
    from PIL import Image

    import pipelines.agent.loop
    import pipelines.agent.policies
    import pipelines.inputs
    from pipelines.agent.trajectory import ToolResult, Trajectory, Turn

    hostile = "[/oops] [link=file:///etc]x[/link] \x1b]52;c;cHduZWQ=\x07"

    def episodes(*_args, **_kwargs):
        traj = Trajectory(task_id="cli", data_source="cli", variant="v", prompt_version="1",
                          prompt_hash="h", mode="eval")
        traj.turns = [Turn(assistant=hostile, code=f"print({hostile!r})",
                           result=ToolResult("error", hostile, hostile, 0.1, 0, False)),
                      Turn(assistant=hostile)]
        return [traj]

    monkeypatch.setattr(pipelines.inputs, "check_model", lambda model: None)
    monkeypatch.setattr(pipelines.agent.policies, "make_policy", lambda *a, **k: None)
    monkeypatch.setattr(pipelines.agent.loop, "run_episodes", episodes)
    img = tmp_path / "a.png"
    Image.new("RGB", (64, 64)).save(img)
    result = runner.invoke(app, ["agent", "run", "--model", "m", "--question", "q", "--image",
                                 str(img), "--out-dir", str(tmp_path / "out")],
                           prog_name="pyvision")
    assert result.exit_code == 0, result.output
    assert "\x1b" not in result.output and "\x07" not in result.output
    assert "[/oops]" in result.output and "[link=file:///etc]" in result.output


def test_paths_with_brackets_are_printed_as_they_are(tmp_path):
    # A folder name is text, not rich markup: '[/b]' raised a MarkupError after the data was
    # written, and '[v2]' vanished from the message.
    out = tmp_path / "x[/b] data [v2]"
    result = runner.invoke(app, ["data", "synth", "--kind", "image-search", "--n", "2",
                                 "--out", str(out)], prog_name="pyvision")
    assert result.exit_code == 0, result.output
    assert "Traceback" not in result.output
    assert (out / "tasks.jsonl").is_file()
    # (compared without whitespace: the console wraps a long line, even inside a word)
    assert "".join(f"in {out} (".split()) in "".join(result.output.split())


def test_a_boolean_for_a_number_is_a_config_error(tmp_path, monkeypatch):
    # `--set agent.max_turns_eval=true` ran evaluation with one turn.
    import pipelines.run

    def never(*args, **kwargs):
        raise AssertionError("the run started")

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(pipelines.run, "run_pipeline", never)
    result = runner.invoke(app, ["run", "tiny-cpu", "--set", "agent.max_turns_eval=true"],
                           prog_name="pyvision")
    assert result.exit_code == 2, result.output
    (line,) = result.output.strip().splitlines()
    assert line.startswith("error: invalid value for 'agent.max_turns_eval'"), line
    assert "got a boolean" in line and "Fix: " in line
    assert list(tmp_path.iterdir()) == []
