"""`pyvision model`: build models."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

import typer

from pyvision_cli.common import JsonOpt, command, err, make_app, print_json

app = make_app("Build models (a tiny offline Qwen2.5-VL).", group=True)


@command(app)
def tiny(
    out_dir: Annotated[Path, typer.Argument(help="Folder to write the model into.")],
    size: Annotated[Literal["nano", "small"], typer.Option(help="nano (unit tests, ~0.4M params) or small (demo, ~5M).")] = "small",
    seed: Annotated[int, typer.Option(help="Seed for tokenizer corpus and weights.", min=0)] = 0,
    force: Annotated[bool, typer.Option("--force", help="Replace a non-empty OUT_DIR.")] = False,
    json_out: JsonOpt = False,
) -> None:
    """Build a randomly initialised Qwen2.5-VL with a locally trained tokenizer, offline."""
    import time

    from pipelines.inputs import check_writable_dir

    check_writable_dir(out_dir, "output folder")  # before torch is imported: an instant answer
    from pipelines.models.tiny import build_tiny_model, describe_model

    start = time.monotonic()
    with err.status(f"building tiny Qwen2.5-VL ({size}, seed {seed}) ..."):
        path = build_tiny_model(out_dir, size=size, seed=seed, force=force)  # type: ignore[arg-type]
    info = describe_model(path) | {"size": size, "seed": seed,
                                   "seconds": round(time.monotonic() - start, 2)}
    err.print(f"[green]built[/] {path}: {info['parameters']:,} parameters "
              f"(vision {info['vision_parameters']:,}), vocabulary {info['vocab_size']}, "
              f"{info['disk_bytes'] / 1e6:.1f} MB, {info['seconds']} s")
    if json_out:
        print_json(info)
