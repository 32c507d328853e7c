"""`pyvision model`: build models."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

import typer
from rich.markup import escape

from pyvision_cli.common import (
    COMMAND_HELP,
    ConfigOpt,
    ForceOpt,
    JsonOpt,
    RunIdOpt,
    SetOpt,
    StoreOpt,
    command,
    err,
    load_recipe,
    make_app,
    print_json,
)

app = make_app(COMMAND_HELP["model"], group=True)


@command(app)
def tiny(
    out_dir: Annotated[Path, typer.Argument(help="Folder to write the model into.")],
    size: Annotated[Literal["nano", "small"], typer.Option(help="nano (unit tests, ~0.4M params) or small (demo, ~5M).")] = "small",
    seed: Annotated[int, typer.Option(help="Seed for tokenizer corpus and weights.", min=0)] = 0,
    force: Annotated[bool, typer.Option("--force", help="Replace a non-empty OUT_DIR.")] = False,
    arch: Annotated[str, typer.Option(help="qwen2_5_vl, or qwen3_vl (recipes then need agent.image_factor=32).")] = "qwen2_5_vl",
    json_out: JsonOpt = False,
) -> None:
    """Build a randomly initialised Qwen2.5-VL (or Qwen3-VL) with a locally trained tokenizer,
    offline."""
    import time

    from pipelines.inputs import check_writable_dir

    check_writable_dir(out_dir, "output folder")  # before torch is imported: an instant answer
    from pipelines.models.tiny import build_tiny_model, describe_model

    start = time.monotonic()
    with err.status(f"building tiny {escape(arch)} ({size}, seed {seed}) ..."):
        path = build_tiny_model(out_dir, size=size, seed=seed, force=force,  # type: ignore[arg-type]
                                arch=arch)  # type: ignore[arg-type]
    info = describe_model(path) | {"size": size, "seed": seed, "arch": arch,
                                   "seconds": round(time.monotonic() - start, 2)}
    err.print(f"[green]built[/] {escape(str(path))}: {info['parameters']:,} parameters "
              f"(vision {info['vision_parameters']:,}), vocabulary {info['vocab_size']}, "
              f"{info['disk_bytes'] / 1e6:.1f} MB, {info['seconds']} s")
    if json_out:
        print_json(info)


@command(app)
def pretrain(
    config: ConfigOpt = None,
    set_: SetOpt = None,
    out: Annotated[Path | None, typer.Option(
        help="Folder for the finished model [default: runs/<run-id>/pretrain/model]; "
             "pipelines/models/weights/tiny-small remakes the shipped base.",
        show_default=False)] = None,
    run_id: RunIdOpt = None,
    store: StoreOpt = None,
    resume: Annotated[bool, typer.Option("--resume", help="Continue from the last checkpoint.")] = False,
    force: ForceOpt = False,
    json_out: JsonOpt = False,
) -> None:
    """Pretrain the tiny Qwen2.5-VL on the generated curriculum, from random weights or, with
    `--set model.pretrain.init=FOLDER`, from a model folder (continued pretraining).

    Size and seed come from `model.tiny`, the schedule from `model.pretrain` (`--set
    model.pretrain.steps=500`). Checkpoints and the resolved config live in
    runs/<run-id>/pretrain/; loss per curriculum family streams into the store.
    """
    from pipelines.models.pretrain import MANIFEST, check_init
    from pipelines.models.pretrain import pretrain as run_pretrain
    from pipelines.rundir import stage_dir
    from pipelines.store import Store

    recipe = load_recipe(config, set_)
    tiny = recipe.model.tiny
    if tiny is None:
        from pipelines.errors import UserError

        raise UserError("the recipe has no `model.tiny` section to pretrain",
                        hint="use the default recipe, or --set model.tiny.size=small")
    if out is not None:
        from pipelines.inputs import check_writable_dir

        # Before the store and the run folder: not a traceback after the whole pretraining.
        check_writable_dir(out, "output folder")
        if out.is_dir() and any(out.iterdir()) and not (out / MANIFEST).is_file() and not force:
            from pipelines.errors import UserError

            raise UserError(f"output folder {out} is not empty and holds no pretrained model (no "
                            f"{MANIFEST}): the finished model would replace what is there",
                            hint="pass a new or empty folder, or --force to replace it")
    check_init(recipe.model.pretrain, out)
    st = Store(store)
    sd = stage_dir(recipe, "pretrain", run_id or f"pretrain-{tiny.size}-s{tiny.seed}",
                   runs_dir=None, store=st, recipe_path=str(config) if config else None)
    target = out or sd.path / "model"
    done = sd.finished(redo=force or resume)
    if done is not None:
        err.print(f"pretraining of run '{sd.run_id}' already finished ({sd.manifest_path}); "
                  "pass --force to redo it", markup=False)
        if json_out:
            print_json(done.to_json())
        return
    with sd.running(force=force and not resume):
        manifest = run_pretrain(recipe.model.pretrain, size=tiny.size, seed=tiny.seed,
                                out=target, work=sd.path, store=st, run_id=sd.run_id,
                                resume=resume)
        sd.finish({"model": str(target)}, {"final_loss": manifest["final_loss"],
                                           **{f"probe/{k}": v for k, v in manifest["probe"].items()}})
    probe = ", ".join(f"{k} {v:.2f}" for k, v in manifest["probe"].items())
    err.print(f"[green]pretrained[/] {escape(str(target))}: loss {manifest['final_loss']:.3f}; probe: {probe}")
    if json_out:  # the stage's manifest, as when it had finished before (the model's own
        # pretraining manifest, with every file's sha256, is in its folder)
        finished = sd.finished()
        assert finished is not None  # finished just above
        print_json(finished.to_json())


@command(app)
def probe(
    model: Annotated[Path, typer.Argument(help="Model folder to probe.")],
    n: Annotated[int, typer.Option(help="Held-out items per skill.", min=1, max=10_000)] = 100,
    seed: Annotated[int, typer.Option(help="Seed of the held-out items.", min=0)] = 1,
    json_out: JsonOpt = False,
) -> None:
    """What a base can do before SFT: copy, colour copy into code, read-back, image-text match,
    an option looked up behind the video prompt, an options table copied into code."""
    from pipelines.models.probe import probe_path

    with err.status(f"probing {escape(str(model))} ..."):
        result = probe_path(model, n=n, seed=seed)
    for skill, score in result["scores"].items():
        need = result["thresholds"].get(skill)
        if need is None:
            err.print(f"{skill:12s} {score:.2f}  (no threshold)")
            continue
        mark = "[green]ok[/]" if score >= need else "[red]below[/]"
        err.print(f"{skill:12s} {score:.2f}  (threshold {need:.2f}) {mark}")
    if json_out:
        print_json(result)
