"""`pyvision run RECIPE`: data -> sft -> rl -> merge -> eval -> report under one run id."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

import typer

from pyvision_cli.common import (
    COMMAND_HELP,
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

# pipelines.rundir.STAGES, spelled out so that --help imports nothing (checked by
# tests/pyvision_cli/test_cli.py).
Stage = Literal["data", "sft", "rl", "merge", "eval", "report"]
app = make_app(COMMAND_HELP["run"])


@command(app)
def run(
    recipe: Annotated[Path, typer.Argument(help="Recipe YAML, or the name of a shipped recipe (tiny-cpu, pyvision-image-7b, ...).")],
    set_: SetOpt = None,
    run_id: RunIdOpt = None,
    store: StoreOpt = None,
    from_stage: Annotated[Stage | None, typer.Option("--from", help="First stage to run [default: data].")] = None,
    until_stage: Annotated[Stage | None, typer.Option("--until", help="Last stage to run [default: report].")] = None,
    force: ForceOpt = False,
    json_out: JsonOpt = False,
) -> None:
    """Finished stages are skipped; an interrupted run continues where it stopped."""
    import time

    from pipelines.config.recipe import recipe_path
    from pipelines.report.terminal import print_headline, print_table
    from pipelines.run import run_pipeline
    from pipelines.store import Store
    from pyvision_cli.report import print_results

    recipe = recipe_path(recipe)  # a shipped recipe's name, resolved once
    cfg = load_recipe(recipe, set_)
    st = Store(store)
    start = time.monotonic()
    summary = run_pipeline(cfg, store=st, run_id=run_id, recipe_path=str(recipe),
                           from_stage=from_stage, until_stage=until_stage, force=force)
    rid = run_id or cfg.name
    if "eval" in summary:
        # The end of the run opens with what a person wants to know first.
        from pipelines.report import collect, headline

        print_headline(headline(collect(st, [rid])))
    rows = []
    for stage, info in summary.items():
        highlights = ", ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}"
                               for k, v in info.items() if k not in ("status", "seconds"))
        rows.append([stage, info["status"], str(info.get("seconds", "-")), highlights])
    print_table(f"run '{rid}' ({time.monotonic() - start:.0f} s)",
                ["stage", "status", "seconds", "highlights"], rows)
    if "eval" in summary:
        print_results(st, [rid], headline=False)
    report = Path(cfg.runs_dir) / rid / "report" / "report.html"
    if report.exists():
        err.print(f"report: {report}", markup=False)
    if json_out:
        print_json({"run_id": rid, "stages": summary})
