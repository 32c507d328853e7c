"""`pyvision rl`: RL with the PyVision rollout strategy, on the local engine or on verl."""

from __future__ import annotations

from typing import Annotated, Literal

import typer
from rich.markup import escape

from pipelines.errors import UserError
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

app = make_app(COMMAND_HELP["rl"], no_args_is_help=False)


@command(app)
def rl(
    config: ConfigOpt = None,
    set_: SetOpt = None,
    run_id: RunIdOpt = None,
    store: StoreOpt = None,
    force: StageForceOpt = False,
    engine: Annotated[Literal["local", "verl"] | None, typer.Option(help="Training engine [default: rl.engine].")] = None,
    resume: ResumeOpt = False,
    model: Annotated[str | None, typer.Option(metavar="PATH", help="Policy to start from [default: the SFT model].")] = None,
    tasks: Annotated[list[str] | None, typer.Option(metavar="DIR", help="RL prompt folder(s), repeatable [default: the data stage's].")] = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="verl: write the launch files and print the command, start nothing.")] = False,
    sanity: Annotated[bool, typer.Option("--sanity", help="Check the update instead of training: log-probs line up, and 12 local-engine steps on 6 fixed prompts raise their expected reward (16 samples each, before and after). Prints JSON; exit 1 if it fails. Writes nothing.")] = False,
    json_out: JsonOpt = False,
) -> None:
    """Oversample, filter zero-variance and broken groups, rank by reward std; GRPO without std
    normalisation; accumulative tool reward. Metrics stream into the store every step.

    A stage that was started and did not finish is not started again silently: pass --resume to
    continue it or --force to start it over."""
    from pipelines.rl.stage import resolve_rl_inputs, run_rl
    from pipelines.rundir import stage_dir
    from pipelines.store import Store

    if sanity and dry_run:
        raise UserError("--sanity and --dry-run cannot be combined: --sanity runs the local "
                        "engine, --dry-run only writes verl's launch files",
                        hint="pass one of them")
    overrides = list(set_ or []) + ([f"rl.engine={engine}"] if engine else [])
    recipe = load_recipe(config, overrides)
    sd = stage_dir(recipe, "rl", run_id, runs_dir=None, store=Store(store),
                   recipe_path=str(config) if config else None)
    done = None if dry_run or sanity else sd.finished(redo=force)
    if done is not None:
        err.print(f"rl of run '{sd.run_id}' already finished ({sd.manifest_path}); pass --force "
                  "to redo it (with --resume: continue it with a changed config)", markup=False)
        if json_out:
            print_json(done.to_json())
        return
    # Everything is checked before the first write: a bad input leaves no folder or store row.
    start_model, task_dirs = resolve_rl_inputs(recipe, sd, model=model, tasks=tasks)
    if sanity:
        from pipelines.rl.sanity import run_sanity

        report = run_sanity(recipe, start_model, task_dirs, show_progress=not json_out)
        print_json(report)
        if not report["passed"]:
            raise typer.Exit(1)
        return
    if dry_run:  # writes the launch files only: the stage is not begun
        plan = run_rl(recipe, sd, model=start_model, task_dirs=task_dirs, resume=resume,
                      dry_run=True)
        if json_out:
            print_json(plan)
        else:  # what the help and the README promise: the command, and where its files are
            import shlex

            print(shlex.join(plan["command"]))
            err.print(f"wrote the launch files to {plan['run_dir']} (launch.sh runs the command)",
                      soft_wrap=True, markup=False)
        return
    with sd.running(force=force, resume=resume, config_hint=RERUN_CONFIG_HINT,
                    refuse_unfinished=True):
        result = run_rl(recipe, sd, model=start_model, task_dirs=task_dirs, resume=resume)
    if json_out:
        print_json(sd.manifest().to_json())
    else:
        err.print(f"[green]RL done[/]: {escape(str(result))}")
