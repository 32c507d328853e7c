"""`pyvision perf`: benchmarks of the project's own speed, printed as JSON."""

from __future__ import annotations

from typing import Annotated, Literal

import typer

from pipelines.errors import UserError
from pyvision_cli.common import COMMAND_HELP, JsonOpt, SetOpt, command, err, make_app, print_json

app = make_app(COMMAND_HELP["perf"], group=True)


@command(app, "sandbox")
def perf_sandbox(
    repeats: Annotated[int, typer.Option(help="Samples per measurement.", min=3)] = 30,
    n_concurrent: Annotated[int, typer.Option(help="Live sandboxes at once.", min=1)] = 64,
    isolation: Annotated[Literal["auto", "bwrap", "rlimit"], typer.Option(help="Sandbox isolation (see `pyvision sandbox run --help`).")] = "auto",
    json_out: JsonOpt = False,
) -> None:
    """Sandbox start time, call overhead, 1024x1024 crop-and-show, an 8K crop, N live sandboxes.

    Targets on a 2-core machine (medians): start <= 200 ms, `x = 1` overhead within 1.5 times
    that of an unisolated forked worker measured in the same run, crop-and-show <= 10 ms, an 8K
    image's crop <= 30 ms, 64 live sandboxes without running out of memory, and beside 8
    sandboxes whose code loops this process at most twice as slow where the kernel shares CPU
    time by session (autogroup; the JSON's `beside_busy`). With more
    than one CPU the call overhead is also measured with both processes on one CPU (the JSON's
    `one_cpu`): on two, where the scheduler wakes each process decides much of a call's time.
    """
    from pipelines.config.sandbox import SandboxConfig
    from pipelines.perf.sandbox import run_benchmark

    with err.status("measuring the sandbox ..."):
        result = run_benchmark(repeats, n_concurrent, SandboxConfig(isolation=isolation))  # type: ignore[arg-type]
    if json_out:
        print_json(result)
    else:
        one = result["one_cpu"]
        one_cpu = (f"; on one CPU {one['overhead_ratio']}x, {one['call_overhead_ms']['median']} "
                   f"against {one['forked_worker_overhead_ms']['median']} ms" if one else "")
        err.print(f"isolation {result['isolation']}: start {result['start_ms']['median']} ms, "
                  f"x=1 {result['call_overhead_ms']['median']} ms ({result['overhead_ratio']}x "
                  f"a forked worker's {result['forked_worker_overhead_ms']['median']} ms"
                  f"{one_cpu}), "
                  f"crop+show {result['crop_show_ms']['median']} ms (the code alone "
                  f"{result['crop_show_code_ms']['median']} ms; a new sandbox's first "
                  f"{result['crop_show_first_ms']['median']} ms), 8K crop "
                  f"{result['crop_8k_ms']['median']} ms (alone {result['crop_8k_code_ms']['median']}"
                  f" ms; an 8K sandbox starts in {result['start_8k_ms']['median']} ms) (medians); "
                  f"{n_concurrent} live "
                  f"sandboxes: {result['concurrent']['peak_rss_mb']} MB RSS, "
                  f"{result['concurrent']['peak_pss_mb']} MB PSS; beside "
                  f"{result['beside_busy']['n']} looping sandboxes this process ran "
                  f"{result['beside_busy']['slowdown']}x slower")


@command(app, "eval")
def perf_eval(
    n_image: Annotated[int, typer.Option(help="Synthetic held-out image-search samples.", min=0)] = 8,
    n_video: Annotated[int, typer.Option(help="Synthetic held-out video samples.", min=0)] = 4,
    size: Annotated[Literal["nano", "small"], typer.Option(help="Tiny model size.")] = "nano",
    model: Annotated[str | None, typer.Option(help="Measure this model folder instead of a fresh tiny one (e.g. runs/demo/rl/model).")] = None,
    max_new_tokens: Annotated[int, typer.Option(help="Tokens per assistant turn.", min=8)] = 64,
    max_turns: Annotated[int, typer.Option(help="Most assistant turns per sample.", min=1)] = 4,
    batch_size: Annotated[int, typer.Option(help="Trajectories advanced together.", min=1)] = 8,
    draft_tokens: Annotated[int | None, typer.Option(help="Drafted tokens checked per forward pass in greedy turns (agent.draft_tokens; 0: one token a pass).", min=0, max=64)] = None,
    dtype: Annotated[Literal["float32", "bfloat16"], typer.Option(help="The model's precision (model.dtype). bfloat16 is only faster on CPUs that compute it natively (AVX512-BF16, AMX); it changes some greedy trajectories.")] = "float32",
    threads: Annotated[int | None, typer.Option(help="torch CPU threads while the model generates (agent.cpu_threads, default 1; 0: torch's default, one per core).", min=0, max=1024)] = None,
    device: Annotated[Literal["auto", "cpu", "cuda"], typer.Option(help="Where the model runs (model.device; auto: cuda when torch sees a GPU). The sandboxes run on the CPU either way.")] = "auto",
    share_prefixes: Annotated[bool | None, typer.Option("--share-prefixes/--no-share-prefixes", help="Run a prompt head that episodes share through the model once (agent.share_prefixes, default on).", show_default=False)] = None,
    json_out: JsonOpt = False,
) -> None:
    """Evaluation samples/s (agent loop + sandbox + scoring + store) per family, image and video.

    Builds a tiny model and synthetic held-out sets in a temporary folder; runs each family with
    the tiny model and with a scripted one-tool-call policy (the loop's cost without a model).
    """
    from pipelines.perf.eval import run_benchmark

    if n_image == n_video == 0:
        raise UserError("nothing to measure: --n-image and --n-video are both 0",
                        hint="pass --n-image N and/or --n-video N (N >= 1)")
    with err.status("measuring evaluation ..."):
        result = run_benchmark(n_image, n_video, size, max_new_tokens, max_turns, batch_size,
                               model_dir=model, draft_tokens=draft_tokens, dtype=dtype,
                               threads=threads, device=device, share_prefixes=share_prefixes)
    if json_out:
        print_json(result)
    else:
        cpus = result["settings"]["cpus"]
        for family, row in result["families"].items():
            parts = []
            for label in ("model", "scripted"):
                bound = row[label]["cpu"]["cpu_bound_samples_per_s"]
                parts.append(f"{label} {row[label]['samples_per_s']} samples/s"
                             + (f" (its CPU time allows at most {bound} on {cpus} cores)"
                                if bound is not None else ""))
            err.print(f"{family} ({row['benchmark']}): " + ", ".join(parts))


@command(app, "rl")
def perf_rl(
    model: Annotated[str | None, typer.Option(help="Policy to measure (default: a fresh tiny model).")] = None,
    size: Annotated[Literal["nano", "small", "qwen2.5-vl-7b"], typer.Option(help="Model when no --model: a fresh tiny model (nano, small), or the released 7B's layer shapes with random weights, made on the device (for memory and time at that scale).")] = "small",
    tasks: Annotated[str | None, typer.Option(help="RL prompt folder (default: synthetic image tasks).")] = None,
    prompts: Annotated[int, typer.Option(help="Prompts per round.", min=1)] = 4,
    n: Annotated[int, typer.Option(help="Rollouts per prompt.", min=2)] = 4,
    rounds: Annotated[int, typer.Option(help="Measured rounds (after one warm-up round).", min=1)] = 2,
    threads: Annotated[int, typer.Option(help="torch CPU threads for the rollouts and the updates (agent.cpu_threads and rl.local.threads; 1 is fastest for tiny models on a busy CPU).", min=1)] = 1,
    max_new_tokens: Annotated[int, typer.Option(help="Tokens per assistant turn.", min=8)] = 128,
    device: Annotated[Literal["auto", "cpu", "cuda"], typer.Option(help="Where the model runs (auto: cuda when torch sees a GPU).")] = "auto",
    dtype: Annotated[Literal["auto", "float32", "bfloat16"], typer.Option(help="Weights' dtype (auto: bf16 on a GPU, fp32 on CPU).")] = "auto",
    lora_rank: Annotated[int, typer.Option(help="Train LoRA adapters of this rank (rl.lora.rank) instead of every weight; 0 trains every weight.", min=0)] = 0,
    image_max_pixels: Annotated[int, typer.Option(help="Pixels per image at most (agent.image_max_pixels).", min=3136)] = 12544,
    set_: SetOpt = None,
    json_out: JsonOpt = False,
) -> None:
    """Local RL engine: trajectories per second (rollout, sandboxes included) and training tokens
    per second (PPO update: old log-probs, forward and backward); on a GPU, its peak memory."""
    from pipelines.perf.rl import run_benchmark

    with err.status("measuring the local RL engine ..."):
        result = run_benchmark(model=model, size=size, tasks=tasks, prompts=prompts, n=n,
                               rounds=rounds, threads=threads, max_new_tokens=max_new_tokens,
                               device=device, dtype=dtype, lora_rank=lora_rank,
                               image_max_pixels=image_max_pixels, overrides=set_ or ())
    if json_out:
        print_json(result)
    else:
        r, u = result["rollout"], result["update"]
        mem = (f", peak {result['peak_allocated_gib']} GiB on {result['gpu']}"
               if "gpu" in result else "")
        err.print(f"{result['model']} ({result['parameters']:,} parameters, "
                  f"{result['trainable_parameters']:,} trained, {result['device']} "
                  f"{result['dtype']}, {result['threads']} thread(s){mem}): rollout {r['trajectories_per_s']} trajectories/s "
                  f"({r['generated_tokens_per_s']} generated tokens/s); update "
                  f"{u['tokens_per_s']} training tokens/s ({u['model_tokens_per_s']} model tokens/s)",
                  markup=False)


@command(app, "report")
def perf_report(
    samples: Annotated[int, typer.Option(help="Evaluated samples in the store (over 3 models, 2 benchmarks).", min=3)] = 2000,
    browser: Annotated[bool, typer.Option(help="Also time headless Chromium loading the page (when installed).")] = True,
    json_out: JsonOpt = False,
) -> None:
    """The report with trajectory pages for thousands of samples: reading the store, rendering
    the page, writing thumbnails, the whole `write_report`, and a browser drawing the page."""
    from pipelines.perf.report import run_benchmark

    with err.status(f"filling a store with {samples} samples and timing the report ..."):
        result = run_benchmark(samples, browser=browser)
    if json_out:
        print_json(result)
    else:
        err.print(f"{result['samples']} samples, {result['thumbnails']} thumbnails: read "
                  f"{result['collect_s']} s, page {result['page_s']} s "
                  f"({result['page_mb']} MB), thumbnails {result['media_s']} s "
                  f"({result['media_mb']} MB), whole report {result['report_s']} s, browser "
                  f"{result['browser_s'] if result['browser_s'] is not None else '-'} s")
