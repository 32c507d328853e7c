"""`pyvision sandbox run`: run a file in a sandbox prepared exactly as for a trajectory."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

import typer

from pyvision_cli.common import COMMAND_HELP, JsonOpt, command, err, make_app, print_json

app = make_app(COMMAND_HELP["sandbox"], group=True)


@command(app, "run")
def run(
    code_file: Annotated[Path, typer.Argument(help="Python file to run.")],
    image: Annotated[list[Path] | None, typer.Option(help="Image(s): image_clue_0, image_clue_1, ...")] = None,
    video: Annotated[Path | None, typer.Option(help="Video: video_clue_0 (decord VideoReader).")] = None,
    timeout: Annotated[float, typer.Option(help="Wall-clock limit in seconds.", min=0.1)] = 30.0,
    memory_mb: Annotated[int, typer.Option(help="Address-space limit in MiB (at least 512: the preloaded libraries map about 400).", min=512)] = 2048,
    isolation: Annotated[Literal["auto", "bwrap", "rlimit"], typer.Option(help="bwrap: namespaces; rlimit: limits only; auto: bwrap when it works.")] = "auto",
    out_dir: Annotated[Path | None, typer.Option(help="Where displayed images are written [default: a new temp dir].")] = None,
    json_out: JsonOpt = False,
) -> None:
    """Exit code 0 whatever the code did (the status says); 2 for bad input."""
    import tempfile

    from pipelines.agent.sandbox import Sandbox
    from pipelines.config.loader import validate
    from pipelines.config.sandbox import SandboxConfig
    from pipelines.console import terminal_safe
    from pipelines.inputs import check_writable_dir, read_text

    code = read_text(code_file, "code file")
    if out_dir is not None:
        check_writable_dir(out_dir, "--out-dir")
    cfg = validate(SandboxConfig, {"timeout_s": timeout, "memory_mb": memory_mb,
                                   "isolation": isolation}, "command-line options")
    images = {f"image_clue_{i}": p for i, p in enumerate(image or [])}
    videos = {"video_clue_0": video} if video else {}
    from pipelines.agent.prompts import check_video

    check_video(video)
    with Sandbox(cfg, images=images, videos=videos) as sbx:
        result = sbx.run(code)
    paths = []
    if result.images:  # a folder only when there is something to put in it
        out = out_dir or Path(tempfile.mkdtemp(prefix="pyvision-sandbox-out-"))
        out.mkdir(parents=True, exist_ok=True)
        for i, png in enumerate(result.images):
            path = out / f"image_{i}.png"
            path.write_bytes(png)
            paths.append(str(path))
    if json_out:
        print_json(result.to_json(image_paths=paths))
        return
    colour = {"ok": "green", "error": "yellow"}.get(result.status, "red")
    err.print(f"[bold {colour}]{result.status}[/] in {result.duration_s:.3f} s"
              + (" (output truncated)" if result.truncated else ""))
    if result.stdout:  # (what the code printed: never raw to the terminal)
        typer.echo(terminal_safe(result.stdout), nl=not result.stdout.endswith("\n"))
    if result.stderr:
        err.print(terminal_safe(result.stderr), markup=False)
    for p in paths:
        err.print(f"image: {p}", markup=False)
