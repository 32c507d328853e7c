"""`pyvision eval`: agentic evaluation with DuckDB tracking; `pyvision eval score` for predictions."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

import typer

from pyvision_cli.common import (
    APP_SETTINGS,
    COMMAND_HELP,
    ConfigOpt,
    JsonOpt,
    PyVisionGroup,
    RunIdOpt,
    SetOpt,
    StoreOpt,
    check_run_id_option,
    command,
    err,
    load_recipe,
    print_json,
)

app = typer.Typer(help=COMMAND_HELP["eval"] + "\n\nAlso the synthetic held-out sets: synth-image, synth-video.",
                  cls=PyVisionGroup, invoke_without_command=True, no_args_is_help=False,
                  **APP_SETTINGS)


@app.callback(invoke_without_command=True)
def evaluate(
    ctx: typer.Context,
    model: Annotated[str | None, typer.Option(metavar="PATH|URL", help="Local model folder, hub id, or OpenAI-compatible server URL.")] = None,
    benchmarks: Annotated[str | None, typer.Option(metavar="NAME[,NAME...]", help="Comma-separated: vstar,hrbench4k,hrbench8k,mathverse,vsibench,synth-image,synth-video [default: eval.benchmarks].")] = None,
    limit: Annotated[int | None, typer.Option(help="First N samples of each benchmark.", min=1)] = None,
    engine: Annotated[Literal["hf", "openai", "vllm"] | None, typer.Option(help="Inference engine [default: eval.engine; openai for a URL].")] = None,
    max_turns: Annotated[int | None, typer.Option(help="Most assistant turns [default: agent.max_turns_eval].", min=1)] = None,
    data_dir: Annotated[Path | None, typer.Option(metavar="DIR", help="Local copy of the benchmark in the published layout, or a folder holding one such copy per benchmark (vstar/, hrbench/, mathverse/, vsibench/ ...).")] = None,
    served_model: Annotated[str | None, typer.Option(help="Model name sent to a server URL.")] = None,
    model_tag: Annotated[str | None, typer.Option(metavar="TAG", help="Name of this model in the store and report [default: a local folder's absolute path, else the hub id or URL].")] = None,
    harness: Annotated[Literal["pyvision", "lmms-eval"], typer.Option(help="pyvision: our loop; lmms-eval: run lmms-eval with our plugin.")] = "pyvision",
    include_path: Annotated[Path | None, typer.Option(metavar="DIR", help="Folder of extra lmms-eval task YAMLs (--harness lmms-eval).")] = None,
    force: Annotated[bool, typer.Option("--force", help="Forget every sample stored under this run id (all model tags) and evaluate again; needed to change agent or sandbox settings of a run.")] = False,
    config: ConfigOpt = None,
    set_: SetOpt = None,
    run_id: RunIdOpt = None,
    store: StoreOpt = None,
    json_out: JsonOpt = False,
) -> None:
    """Run the agent loop on every sample; store trajectories, scores and aggregates.

    Re-running the same run id resumes: samples stored by the same weights are skipped. A re-run
    with other agent or sandbox settings (--max-turns, agent.eval_temperature ...) is refused
    rather than mixed with the stored samples: use a new --run-id, or --force."""
    if ctx.invoked_subcommand is not None:
        return
    from pipelines.errors import UserError
    from pipelines.inputs import check_model

    if model is None:
        raise UserError("--model is required", hint="e.g. pyvision eval --model runs/demo/rl/model "
                        "--benchmarks synth-image --data-dir runs/demo/data/synth/image-search/heldout")
    if harness == "lmms-eval" and data_dir is not None:
        raise UserError("--data-dir is not used by --harness lmms-eval (its tasks load their own "
                        "data)", hint="write a local task YAML (dataset_path: json, data_files) "
                        "and pass its folder with --include-path")
    if harness == "pyvision" and include_path is not None:
        raise UserError("--include-path only applies to --harness lmms-eval",
                        hint="drop it, or add --harness lmms-eval")
    names = None
    if benchmarks is not None:
        names = list(dict.fromkeys(b.strip() for b in benchmarks.split(",") if b.strip()))
        if not names:
            raise UserError(f"--benchmarks '{benchmarks}' names no benchmark",
                            hint="e.g. --benchmarks vstar,hrbench4k")
    overrides = list(set_ or [])
    if max_turns is not None:
        overrides.append(f"agent.max_turns_eval={max_turns}")
    recipe = load_recipe(config, overrides)
    names = names or list(recipe.eval.benchmarks)
    if harness == "pyvision":  # lmms-eval takes its own task names (vstar_bench, ...)
        from benchmarks import check_benchmark_name

        for name in names:
            check_benchmark_name(name)
    if engine != "openai":
        check_model(model)
    if served_model is not None and not model.startswith(("http://", "https://")):
        raise UserError(f"--served-model names a model on a server, but --model {model} is not a "
                        "server URL", hint="drop --served-model, or pass the server's URL as "
                                           "--model")
    if data_dir is not None and not data_dir.exists():
        raise UserError(f"--data-dir {data_dir} not found",
                        hint="pass the folder `pyvision data download` or the data stage wrote")

    def note_default_recipe() -> None:
        if config is None:
            # The embedded recipe is sized for the tiny CPU model; a real model evaluated with it
            # would see downscaled images and few turns without saying so.
            a = recipe.agent
            err.print(f"[yellow]note:[/] no -c given: the tiny-cpu recipe's agent settings apply "
                      f"(max_turns_eval={a.max_turns_eval}, image_max_pixels={a.image_max_pixels}, "
                      f"max_new_tokens_per_turn={a.max_new_tokens_per_turn}); for a 7B model pass "
                      f"-c pipelines/recipes/pyvision-image-7b.yaml (or pyvision-video-7b.yaml)",
                      soft_wrap=True)

    from pipelines.store import Store

    st = Store(store)
    rid = run_id or f"eval-{recipe.name}"
    # A local folder's tag is its absolute path: the same text typed in two folders would name
    # two models under one tag (the second replacing the first's samples), and one folder typed
    # two ways would be two models.
    local = Path(model).expanduser()
    tag = model_tag or (str(local.resolve()) if not model.startswith(("http://", "https://"))
                        and local.exists() else model)
    # The run is registered only once its inputs have been checked: a bad input writes nothing.
    register = {"name": recipe.name, "recipe_path": str(config) if config else None,
                "config": recipe.model_dump(mode="json")}
    if harness == "lmms-eval":
        from pipelines.eval.lmms import run_lmms_eval
        from pipelines.eval.runner import check_same_eval_settings

        if force:
            raise UserError("--force applies to --harness pyvision",
                            hint="pass a new --run-id for a separate lmms-eval run")
        check_same_eval_settings(st, rid, recipe)
        note_default_recipe()
        results = run_lmms_eval(model, names, run_id=rid, model_tag=tag, store=st, limit=limit,
                                recipe=recipe, include_path=include_path, engine=engine,
                                served_model=served_model, register_run=register)
    else:
        from pipelines.eval.runner import resolve_data_dir, run_eval

        dirs = {n: resolve_data_dir(data_dir, n) for n in names} if data_dir else None
        is_url = model.startswith(("http://", "https://"))
        results = run_eval(recipe, model=model, model_tag=tag, benchmarks=names, run_id=rid,
                           store=st, data_dirs=dirs, limit=limit,
                           engine=engine or ("openai" if is_url else recipe.eval.engine),
                           base_url=model if is_url else None, served_model=served_model,
                           register_run=register, force=force, on_checked=note_default_recipe)
    if json_out:
        scored_by = {bench: counts for (_, model, bench), counts in st.eval_scored_by([rid]).items()
                     if model == tag}
        print_json({"run_id": rid, "model": tag, "results": results, "scored_by": scored_by})


@command(app, "score")
def score(
    benchmark: Annotated[str, typer.Option(help="Benchmark name, e.g. vsibench.")],
    predictions: Annotated[Path | None, typer.Option(help="JSONL: the benchmark's own fields plus `prediction`.")] = None,
    run_id: Annotated[str | None, typer.Option("--run-id", metavar="ID", callback=check_run_id_option, help="Instead of --predictions: score this evaluation run's stored predictions again, asking the judge for the samples its rule fallback scored.", show_default=False)] = None,
    model_tag: Annotated[str | None, typer.Option(help="With --run-id: only this model tag (otherwise every model the run evaluated).", show_default=False)] = None,
    config: Annotated[Path | None, typer.Option("--config", "-c", help="With --run-id: recipe whose reward.judge is asked (otherwise the recipe stored with the run).", show_default=False)] = None,
    set_: SetOpt = None,
    store: StoreOpt = None,
    json_out: JsonOpt = False,
) -> None:
    """Official scores for final answers, no model needed; or, with --run-id, a stored run's
    scores again once its judge is back."""
    from pipelines.errors import UserError

    if (predictions is None) == (run_id is None):
        raise UserError("pass exactly one of --predictions and --run-id",
                        hint="--predictions FILE scores a JSONL of answers; --run-id ID scores a "
                             "stored evaluation again")
    if run_id is None:
        # (not --store: PYVISION_STORE sets it for every command)
        extra = [flag for flag, value in (("--model-tag", model_tag), ("--config", config),
                                          ("--set", set_)) if value]
        if extra:
            raise UserError(f"{extra[0]} only applies with --run-id",
                            hint=f"drop {extra[0]}, or score a stored run with --run-id")
        _score_predictions(benchmark, predictions, json_out)
    else:
        _rescore_run(benchmark, run_id, model_tag, config, set_, store, json_out)


def _score_predictions(benchmark: str, predictions: Path, json_out: bool) -> None:
    from rich.table import Table

    from benchmarks import score_predictions

    result = score_predictions(benchmark, predictions)
    if json_out:
        print_json(result)
        return
    table = Table(title=f"{result['benchmark']} (n={result['n']})")
    table.add_column("metric")
    table.add_column("value", justify="right")
    for metric, value in result["aggregate"].items():
        table.add_row(metric, f"{100 * value:.2f}")
    err.print(table)


def _rescore_run(benchmark: str, run_id: str, model_tag: str | None, config: Path | None,
                 sets: list[str] | None, store: Path | None, json_out: bool) -> None:
    from rich.markup import escape
    from rich.table import Table

    from benchmarks import benchmark_class
    from pipelines.config.loader import apply_overrides, validate
    from pipelines.config.recipe import Recipe
    from pipelines.eval.judging import rescore
    from pipelines.store import Store

    primary = benchmark_class(benchmark).primary_metric
    st = Store(store)
    stored = st.run_config(run_id) if config is None else None
    if stored is not None:
        recipe = validate(Recipe, apply_overrides(stored, sets or []),
                          f"the recipe stored with run '{run_id}'")
    else:
        recipe = load_recipe(config, sets)
    results = rescore(st, recipe, run_id, benchmark, model_tag)
    if json_out:
        print_json({"run_id": run_id, "benchmark": benchmark, "models": results})
    else:
        table = Table(title=f"{escape(benchmark)} in run {escape(run_id)}: samples scored again")
        for column in ("model", "rule fallbacks", "now judged", "still fallback", primary):
            table.add_column(column)
        for model, r in results.items():
            value = r["aggregate"].get(primary)
            table.add_row(escape(model), str(r["rescored"]), str(r["judged"]), str(r["still_fallback"]),
                          "-" if value is None else f"{100 * value:.1f}%")
        err.print(table)
    if any(r["still_fallback"] for r in results.values()):
        err.print("[yellow]warning:[/] the judge still did not answer for some samples; they "
                  "keep their rule-fallback scores (run this again when it is back)",
                  soft_wrap=True)
