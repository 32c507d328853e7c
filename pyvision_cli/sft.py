"""`pyvision sft`: supervised fine-tuning on LLaMA-Factory."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.markup import escape

from pyvision_cli.common import (
    COMMAND_HELP,
    RERUN_CONFIG_HINT,
    ConfigOpt,
    JsonOpt,
    ResumeOpt,
    RunIdOpt,
    SetOpt,
    StageForceOpt,
    StoreOpt,
    command,
    err,
    load_recipe,
    make_app,
    print_json,
)

app = make_app(COMMAND_HELP["sft"], no_args_is_help=False)


@command(app)
def sft(
    config: ConfigOpt = None,
    set_: SetOpt = None,
    run_id: RunIdOpt = None,
    store: StoreOpt = None,
    force: StageForceOpt = False,
    resume: ResumeOpt = False,
    model: Annotated[str | None, typer.Option(metavar="PATH", help="Base model folder or hub id [default: from the data stage].")] = None,
    dataset_dir: Annotated[str | None, typer.Option(metavar="DIR", help="LLaMA-Factory dataset folder (holds dataset_info.json) [default: from the data stage].")] = None,
    dataset: Annotated[str | None, typer.Option(metavar="NAME", help="Dataset name in dataset_info.json [default: from the data stage].")] = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Write the LLaMA-Factory YAML and stop.")] = False,
    json_out: JsonOpt = False,
) -> None:
    """Render LLaMA-Factory's training YAML from the recipe and run `llamafactory-cli train`.

    The YAML, the DeepSpeed config (if any) and the full log stay in runs/<run-id>/sft/, so the
    exact run can be repeated by hand. Loss and learning rate stream into the store.
    """
    from pipelines.errors import UserError
    from pipelines.rundir import stage_dir
    from pipelines.sft import llamafactory as lf
    from pipelines.sft.stage import resolve_sft_inputs, run_sft
    from pipelines.store import Store

    recipe = load_recipe(config, set_)
    st = Store(store)
    sd = stage_dir(recipe, "sft", run_id, runs_dir=None, store=st,
                   recipe_path=str(config) if config else None)
    done = None if dry_run else sd.finished(redo=force)
    if done is not None:
        err.print(f"sft of run '{sd.run_id}' already finished ({sd.manifest_path}); "
                  "pass --force to redo it", markup=False)
        if json_out:
            print_json(done.to_json())
        return
    model_path, ds_dir, ds_name = resolve_sft_inputs(recipe, sd, model=model,
                                                     dataset_dir=dataset_dir, dataset=dataset)
    if dry_run:
        if (sd.path / "environment.json").is_file():  # begun: its YAML is the stage's record
            raise UserError(f"sft of run '{sd.run_id}' has begun: a dry run would rewrite its "
                            f"{lf.TRAIN_YAML}", hint=f"read {sd.path / lf.TRAIN_YAML}, or pass "
                            "--run-id NEW for a dry run of its own")
        sd.path.mkdir(parents=True, exist_ok=True)
        path = lf.write_train_files(recipe.sft, sd.path, model_path=model_path,
                                    dataset_dir=ds_dir, dataset=ds_name, resume=resume)
        err.print(f"wrote {path}", markup=False)
        if json_out:
            print_json({"train_yaml": str(path), "run_dir": str(sd.path)})
        return
    with sd.running(force=force, resume=resume, config_hint=RERUN_CONFIG_HINT,
                    refuse_unfinished=True):
        summary = run_sft(recipe, sd, model=model_path, dataset_dir=ds_dir, dataset=ds_name,
                          resume=resume)
    err.print(f"[green]SFT done[/] in {summary['seconds']} s: loss {summary['first_loss']} -> "
              f"{summary['last_loss']} over {summary['steps']} steps; model in {escape(str(sd.path / 'output'))}")
    if json_out:
        print_json(sd.manifest().to_json())
