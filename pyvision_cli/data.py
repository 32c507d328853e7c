"""`pyvision data`: synthesise, validate, write trajectories, export, download, import, prepare."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

import typer
from rich.markup import escape

from pyvision_cli.common import (
    COMMAND_HELP,
    ConfigOpt,
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

app = make_app(COMMAND_HELP["data"], group=True)


@command(app)
def synth(
    kind: Annotated[Literal["image-search", "video"], typer.Option(help="Task kind.")],
    n: Annotated[int, typer.Option(help="Number of tasks (the free disk space is checked first).", min=1, max=10_000_000)],
    out: Annotated[Path, typer.Option(help="Output folder (tasks.jsonl + media/).")],
    seed: Annotated[int, typer.Option(help="Seed (tasks are a function of seed, split, index).", min=0)] = 0,
    split: Annotated[Literal["train", "heldout"], typer.Option(help="Split (disjoint seed streams).")] = "train",
    families: Annotated[str | None, typer.Option(help="Comma-separated families [default: all but text].")] = None,
    force: Annotated[bool, typer.Option("--force", help="Replace a finished set in --out.")] = False,
    json_out: JsonOpt = False,
) -> None:
    """Verifiable synthetic tasks: visual search on large canvases, or short videos."""
    from pipelines.data.synth import synthesize

    fams = [f.strip() for f in families.split(",")] if families else None
    manifest = synthesize(kind, n, seed, out, split=split, families=fams, force=force)
    err.print(f"[green]{manifest['n']} {kind} tasks[/] in {escape(str(out))} "
              f"({manifest['tasks_per_s']} tasks/s): {escape(str(manifest['counts']))}")
    if json_out:
        print_json(manifest)


@command(app)
def validate(
    path: Annotated[Path, typer.Argument(help="A tasks.jsonl / conversations.jsonl file or its folder.")],
    strict: Annotated[bool, typer.Option("--strict", help="Fail on the first bad row (exit 2).")] = False,
    json_out: JsonOpt = False,
) -> None:
    """Check every row (schema, answer, media present and decodable, placeholders); summarise.
    Exit 2 when no row is usable."""
    from pipelines.data.validate import validate_path

    report = validate_path(path, strict=strict)
    if json_out:
        print_json(report)
    else:
        _validate_table(report)
    if report["kept"] == 0:  # after the findings: they say what to fix
        from pipelines.errors import DataError

        raise DataError(f"{report['path']}: no usable rows ({report['read']} read)",
                        hint="fix the rows reported, or synthesise or import the data again")


def _validate_table(report: dict) -> None:
    from rich.table import Table

    table = Table(title=f"validate {escape(str(report['path']))}")
    table.add_column("")
    table.add_column("count", justify="right")
    table.add_row("rows read", str(report["read"]))
    table.add_row("rows kept", str(report["kept"]))
    for reason, count in sorted(report["skipped"].items()):
        table.add_row(f"skipped: {escape(str(reason))}", str(count))
    for key, count in sorted(report.get("by", {}).items()):
        table.add_row(escape(str(key)), str(count))
    err.print(table)
    for problem in report["problems"][:20]:
        err.print(f"  [yellow]{escape(str(problem))}[/]", markup=True)


@command(app)
def trajectories(
    tasks: Annotated[Path, typer.Option(help="Folder (or tasks.jsonl) of synthetic tasks.")],
    out: Annotated[Path, typer.Option(help="Output folder (conversations.jsonl + media/).")],
    seed: Annotated[int, typer.Option(help="Seed for the solvers' code and wording variants.", min=0)] = 0,
    limit: Annotated[int | None, typer.Option(help="Only the first N tasks.", min=1)] = None,
    config: ConfigOpt = None,
    set_: SetOpt = None,
    force: Annotated[bool, typer.Option("--force", help="Replace finished trajectories in --out.")] = False,
    json_out: JsonOpt = False,
) -> None:
    """Cold-start SFT trajectories: solver code executed in the real sandbox; wrong ones dropped."""
    from pipelines.data.trajectories import make_trajectories
    from pipelines.inputs import check_writable_dir

    check_writable_dir(out, "output folder")
    recipe = load_recipe(config, set_)
    manifest = make_trajectories(tasks, out, seed=seed, agent_cfg=recipe.agent,
                                 sandbox_cfg=recipe.sandbox, limit=limit, force=force)
    err.print(f"[green]kept {manifest['kept']} of {manifest['tasks']}[/] trajectories "
              f"({manifest['trajectories_per_s']}/s); dropped: {escape(str(manifest['dropped'] or 'none'))}")
    if json_out:
        print_json(manifest)


@command(app)
def distill(
    teacher: Annotated[str | None, typer.Option(help="Teacher's OpenAI-compatible server URL (vLLM, SGLang, `transformers serve`, a hosted API) (default: data.distill.teacher).", show_default=False)] = None,
    tasks: Annotated[list[Path] | None, typer.Option(help="Task folder (tasks.jsonl + media); repeatable.", show_default=False)] = None,
    out: Annotated[Path | None, typer.Option(help="Output folder: samples/, conversations.jsonl, media/, the LLaMA-Factory export, card.json / card.md.", show_default=False)] = None,
    served_model: Annotated[str | None, typer.Option(help="Model name sent to the teacher (default: the one model it lists).", show_default=False)] = None,
    k: Annotated[int | None, typer.Option("--k", help="Samples per task (default: data.distill.k).", min=1, max=256, show_default=False)] = None,
    max_per_task: Annotated[int | None, typer.Option(help="Most kept per task (default: data.distill.max_per_task).", min=1, max=256, show_default=False)] = None,
    concurrency: Annotated[int | None, typer.Option(help="Requests in flight (default: data.distill.concurrency).", min=1, max=4096, show_default=False)] = None,
    limit: Annotated[int | None, typer.Option(help="Only the first N tasks.", min=1, show_default=False)] = None,
    config: ConfigOpt = None,
    set_: SetOpt = None,
    store: StoreOpt = None,
    force: Annotated[bool, typer.Option("--force", help="Discard the samples already drawn in --out and draw again.")] = False,
    json_out: JsonOpt = False,
) -> None:
    """SFT data from a teacher model: our agent loop with the teacher as policy, K samples per
    task, kept only when verified (right answer, code ran, exact format, within limits), then
    selected; resumable."""
    from pipelines.errors import UserError

    if not tasks:
        raise UserError("--tasks is required", hint="e.g. pyvision data distill --teacher "
                        "http://localhost:8000 --tasks data/synth --out data/distill")
    if out is None:
        raise UserError("--out is required", hint="pass the folder to write the distilled data to")
    overrides = list(set_ or [])
    for key, value in (("k", k), ("max_per_task", max_per_task), ("concurrency", concurrency)):
        if value is not None:
            overrides.append(f"data.distill.{key}={value}")
    recipe = load_recipe(config, overrides)
    if not (teacher or recipe.data.distill.teacher):
        raise UserError("no teacher to distill from", hint="pass --teacher URL (e.g. "
                        "http://localhost:8000 for `vllm serve MODEL --port 8000`)")
    for folder in tasks:
        if not folder.exists():
            raise UserError(f"tasks folder not found: {folder}",
                            hint="pass a folder holding tasks.jsonl (`pyvision data synth`)")
    from pipelines.data.distill import distill as run_distill
    from pipelines.store import Store

    card = run_distill(recipe, list(tasks), out, teacher=teacher, served_model=served_model,
                       store=Store(store), force=force, limit=limit)
    s, sel = card["samples"], card["selection"]
    rate = "-" if s["acceptance"] is None else f"{100 * s['acceptance']:.1f}%"
    err.print(f"[green]distilled[/] {card['tasks']['tried']} tasks: {s['drawn']} samples, "
              f"{s['accepted']} verified ({rate}), {sel['kept']} kept; rejected: "
              f"{escape(str(s['rejected'] or 'none'))}; card: {escape(str(out / 'card.md'))}", soft_wrap=True)
    if json_out:
        print_json(card)


@command(app)
def export(
    fmt: Annotated[Literal["llamafactory", "verl"], typer.Option("--format", help="Target trainer's format.")],
    source: Annotated[list[Path], typer.Option(help="Conversations folder(s) (llamafactory) or tasks folder(s) (verl).")],
    out: Annotated[Path, typer.Option(help="Output folder.")],
    name: Annotated[str, typer.Option(help="Dataset name (llamafactory) / file stem (verl).")] = "pyvision_sft",
    copy_drills: Annotated[int, typer.Option(min=0, max=16, help="llamafactory: copy drills per conversation (see data.copy_drills).")] = 0,
    seed: Annotated[int, typer.Option(help="Seed of the copy drills' random values.")] = 0,
    config: ConfigOpt = None,
    set_: SetOpt = None,
    json_out: JsonOpt = False,
) -> None:
    """LLaMA-Factory sharegpt + dataset_info.json, or verl RL parquet."""
    from collections import Counter

    from pipelines.data.validate import skipped_rows
    from pipelines.errors import DataError, UserError
    from pipelines.inputs import check_writable_dir

    check_writable_dir(out, "output folder")

    if fmt == "llamafactory":
        from pipelines.core.records import read_conversations
        from pipelines.data.export_llamafactory import export_llamafactory

        sources, skipped, problems = [], Counter(), []
        for s in source:
            convs, report = read_conversations(s)
            skipped.update(report.skipped)
            problems += report.problems
            root = s if s.is_dir() else s.parent
            sources.append((root, convs))
        if not any(convs for _root, convs in sources):
            raise DataError(f"no usable conversation in {', '.join(str(s) for s in source)}"
                            + (f" ({skipped_rows(skipped, problems)})" if skipped else ""),
                            hint="check the folders with `pyvision data validate DIR`")
        if copy_drills:
            from pipelines.data.drills import copy_drills as make_drills

            sources += [(root, make_drills(convs, copy_drills, seed)) for root, convs in sources]
        info = export_llamafactory(sources, out, name=name,
                                   agent_cfg=load_recipe(config, set_).agent)
    elif fmt == "verl":
        from pipelines.data.export_verl import export_verl

        recipe = load_recipe(config, set_)
        info = export_verl(source, out, name=name, agent_cfg=recipe.agent)
        skipped, problems = info["skipped"], info["problems"]
    else:
        raise UserError(f"unknown --format '{fmt}'", hint="use llamafactory or verl")
    if skipped:
        err.print(f"[yellow]warning:[/] {escape(skipped_rows(skipped, problems))}",
                  soft_wrap=True, highlight=False)
    # The problems are named in the warning (the first) and in --json (all): not again here.
    shown = {k: v for k, v in info.items() if k != "problems"}
    err.print(f"[green]exported[/] {escape(str(shown))}")
    if json_out:
        print_json(info)


@command(app)
def download(
    name: Annotated[str, typer.Argument(help="pyvision-image-sft | pyvision-image-rl | pyvision-video-rl | vstar | hrbench | mathverse | vsibench")],
    out: Annotated[Path | None, typer.Option(help="Output folder [default: data/<name>].")] = None,
    strict: Annotated[bool, typer.Option("--strict", help="Fail on the first bad row.")] = False,
    json_out: JsonOpt = False,
) -> None:
    """Download from the Hugging Face hub (resumable) and convert to canonical records."""
    from pipelines.data.hub import download as _download
    from pipelines.inputs import check_writable_dir

    check_writable_dir(out or Path("data") / name, "output folder")
    manifest = _download(name, out or Path("data") / name, strict=strict)
    err.print(f"[green]{escape(name)}[/]: {escape(str(manifest))}")
    if json_out:
        print_json(manifest)


@command(app, "import")
def import_(
    name: Annotated[str, typer.Argument(help="Dataset name (see `pyvision data download --help`).")],
    from_dir: Annotated[Path, typer.Option("--from-dir", help="A copy made elsewhere, in the published layout.")],
    out: Annotated[Path | None, typer.Option(help="Output folder [default: data/<name>].")] = None,
    strict: Annotated[bool, typer.Option("--strict", help="Fail on the first bad row.")] = False,
    json_out: JsonOpt = False,
) -> None:
    """Convert a copy downloaded elsewhere into canonical records (for offline machines)."""
    from pipelines.data.hub import import_dataset
    from pipelines.inputs import check_writable_dir

    check_writable_dir(out or Path("data") / name, "output folder")
    manifest = import_dataset(name, from_dir, out or Path("data") / name, strict=strict)
    err.print(f"[green]{escape(name)}[/]: kept {manifest.get('kept', '-')} of {manifest.get('read', '-')} rows; "
              f"skipped {escape(str(manifest.get('skipped', {}) or 'none'))}")
    if json_out:
        print_json(manifest)


@command(app)
def prepare(
    config: ConfigOpt = None,
    set_: SetOpt = None,
    run_id: RunIdOpt = None,
    store: StoreOpt = None,
    force: Annotated[bool, typer.Option("--force", help="Redo the data stage although it finished.")] = False,
    json_out: JsonOpt = False,
) -> None:
    """The recipe's data stage: synthetic sets, trajectories, base model, LLaMA-Factory export."""
    from pipelines.data_stage import check_data_inputs, run_data_stage
    from pipelines.rundir import stage_dir
    from pipelines.store import Store

    recipe = load_recipe(config, set_)
    check_data_inputs(recipe)
    sd = stage_dir(recipe, "data", run_id, runs_dir=None, store=Store(store),
                   recipe_path=str(config) if config else None)
    done = sd.finished(redo=force)
    if done is not None:
        err.print(f"data stage of run '{sd.run_id}' already finished; pass --force to redo it")
        if json_out:
            print_json(done.to_json())
        return
    with sd.running(force=force):
        result = run_data_stage(recipe, sd)
    err.print(f"[green]data ready[/] in {escape(str(sd.path))}: {escape(str(result['summary']))}")
    if json_out:
        print_json(sd.manifest().to_json())
