"""`pyvision perf eval`: samples per second of evaluation (agent loop + sandbox + scoring + store).

Everything is built in a temporary folder: a tiny Qwen2.5-VL, synthetic held-out image-search and
video sets, a store. Each family is evaluated through :func:`pipelines.eval.runner.run_eval`
exactly as `pyvision eval` runs it, twice:

- ``model``: the tiny model through the transformers policy (generation dominates);
- ``scripted``: a policy that writes one code block (crop and show for images, sample and show a
  frame for videos) and then answers, so every sample pays a real sandbox call; this is the
  loop's own cost without a model.

The tiny model is untrained (random weights): it rarely writes code, so its numbers measure
generation and scoring, not tool use. Model loading is timed separately and not counted;
the sandbox zygote is started before the first row.

Beside the times, the model rows report the work done (``work``: prefill positions, padding
included, and the real tokens among them; decode steps, row-steps and attended positions):
counts that a busy machine does not move, for comparing two versions of the code.

Every row also reports the CPU time it used (``cpu``): this process's (the policy, the loop, the
store) and its whole process tree's (the sandbox workers too), and from them the most samples a
second this work allows on this machine's cores however well it were spread over them
(``cpu_bound_samples_per_s``): a throughput target above that needs less work, not more overlap.
And the evaluating thread's own (it runs the model): seconds on a core and seconds runnable but
waiting for one (``thread_on_cpu_s``, ``thread_runqueue_s``), so a slow run tells computing more
from waiting for a core the sandboxes hold.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

FAMILIES = {"image": ("image-search", "synth-image"), "video": ("video", "synth-video")}

# Written without spaces: the scripted policy counts words as tokens, and each turn must fit the
# smallest allowed max_new_tokens_per_turn (8).
_IMAGE_TURN = ("<code>\n```python\nplt.imshow(image_clue_0.crop((0,0,image_clue_0.width//2,"
               "image_clue_0.height//2)));plt.show()\n```\n</code>")
_VIDEO_TURN = ("<code>\n```python\nplt.imshow(video_clue_0[len(video_clue_0)//2].asnumpy());"
               "plt.show()\n```\n</code>")
_ANSWER_TURN = "<answer>\n\\boxed{A}\n</answer>"


# What the in-process policy counts (``decode_batch``'s ``stats``, ``HFPolicy.cache_stats``):
# token positions through prefills (padding included) and the real tokens among them, tokens
# whose states a turn reused (its own) or shared (a kept prompt head), decode steps, rows summed
# over the steps, cached positions attended over summed over the rows.
_WORK = ("prefill_slots", "tokens_prefilled", "tokens_reused", "tokens_shared", "decode_steps",
         "decode_rows", "decode_keys", "draft_tokens", "draft_kept")


def _summary(records: list[dict[str, Any]], seconds: float) -> dict[str, Any]:
    n = len(records)
    stops: dict[str, int] = {}
    for r in records:
        stops[r["stop_reason"]] = stops.get(r["stop_reason"], 0) + 1
    return {
        "n": n, "seconds": round(seconds, 3),
        "samples_per_s": round(n / seconds, 3) if seconds > 0 else None,
        "mean_turns": round(statistics.mean(r["turns"] for r in records), 2),
        "mean_tool_calls": round(statistics.mean(r["tool_calls"] for r in records), 2),
        "mean_visual_tokens": round(statistics.mean(r["visual_tokens"] for r in records), 1),
        "mean_total_tokens": round(statistics.mean(r["total_tokens"] for r in records), 1),
        "stop_reasons": dict(sorted(stops.items())),
    }


def _cpu(process_s: float, tree_end: float | None, tree_start: float | None, n: int,
         cpus: int, sched_end: tuple[float, float] | None = None,
         sched_start: tuple[float, float] | None = None) -> dict[str, Any]:
    """The CPU seconds behind one row: ``process_s`` (this process, every thread) and the whole
    process tree's (None off Linux), the samples a second that tree's work would allow spread
    perfectly over ``cpus`` cores, and the evaluating thread's own seconds on a core and
    runnable but waiting for one (``thread_on_cpu_s``, ``thread_runqueue_s``: None where the
    kernel does not count them)."""
    tree_s = None if tree_end is None or tree_start is None else tree_end - tree_start
    bound = round(n * cpus / tree_s, 2) if tree_s else None
    on_cpu = waiting = None
    if sched_end is not None and sched_start is not None:
        on_cpu, waiting = (round(b - a, 2) for a, b in zip(sched_start, sched_end))
    return {"process_s": round(process_s, 2),
            "tree_s": None if tree_s is None else round(tree_s, 2),
            "cpu_bound_samples_per_s": bound,
            "thread_on_cpu_s": on_cpu, "thread_runqueue_s": waiting}


def run_benchmark(n_image: int = 8, n_video: int = 4, size: str = "nano",
                  max_new_tokens: int = 64, max_turns: int = 4, batch_size: int = 8,
                  model_dir: str | Path | None = None, draft_tokens: int | None = None,
                  dtype: str = "float32", workdir: str | Path | None = None,
                  threads: int | None = None, device: str = "cpu",
                  share_prefixes: bool | None = None) -> dict[str, Any]:
    """Measure evaluation throughput on this machine; returns the JSON the CLI prints.

    ``model_dir`` measures that model (e.g. the demo's trained one) instead of a fresh tiny one;
    ``draft_tokens`` overrides ``agent.draft_tokens`` (0: one token a forward pass); ``dtype``
    is the model's precision (``model.dtype``); ``threads`` overrides ``agent.cpu_threads`` (0:
    torch's default, one per core); ``device`` is where the model runs (``model.device``: cpu,
    cuda, or auto); the sandboxes, the loop and the store stay on the CPU either way;
    ``share_prefixes`` overrides ``agent.share_prefixes``.
    """
    import torch

    from pipelines.agent.policies.hf import HFPolicy
    from pipelines.agent.policies.scripted import ScriptedPolicy
    from pipelines.agent.sandbox import Sandbox
    from pipelines.config.recipe import load_recipe
    from pipelines.core.device import resolve_device
    from pipelines.data.synth import synthesize
    from pipelines.eval.runner import run_eval
    from pipelines.models.tiny import build_tiny_model
    from pipelines.perf import process_tree_cpu_s, thread_schedstat_s, usable_cpus
    from pipelines.store import Store

    counts = {"image": n_image, "video": n_video}
    cpus = usable_cpus()
    device = resolve_device(device)  # before anything is built: no GPU is a clear error
    with tempfile.TemporaryDirectory(prefix="pyvision-perf-eval-", dir=workdir) as tmp:
        root = Path(tmp)
        t = time.monotonic()
        if model_dir is None:
            model_path = root / "model"
            build_tiny_model(model_path, size=size, seed=0)  # type: ignore[arg-type]
        else:
            model_path = Path(model_dir)
        build_s = time.monotonic() - t
        data: dict[str, Path] = {}
        for family, (kind, _) in FAMILIES.items():
            if counts[family] > 0:
                synthesize(kind, counts[family], 0, root / family, split="heldout",
                           progress=False)
                data[family] = root / family
        recipe = load_recipe(None, [
            f"agent.max_new_tokens_per_turn={max_new_tokens}", f"agent.max_turns_eval={max_turns}",
            f"eval.batch_size={batch_size}", f"model.device={device}", f"model.dtype={dtype}",
            *([f"agent.draft_tokens={draft_tokens}"] if draft_tokens is not None else []),
            *([f"agent.cpu_threads={threads}"] if threads is not None else []),
            *([f"agent.share_prefixes={str(share_prefixes).lower()}"]
              if share_prefixes is not None else [])])
        store = Store(root / "perf.duckdb")
        t = time.monotonic()
        model = HFPolicy.from_pretrained(str(model_path), device=device, dtype=recipe.model.dtype,
                                         image_min_pixels=recipe.agent.image_min_pixels,
                                         image_max_pixels=recipe.agent.image_max_pixels,
                                         draft_tokens=recipe.agent.draft_tokens,
                                         threads=recipe.agent.cpu_threads,
                                         share_prefixes=recipe.agent.share_prefixes)
        load_s = time.monotonic() - t
        # The sandbox zygote starts once per process (about 0.7 s of CPU): started here, like
        # the model's loading, so that the first row timed does not pay for it.
        Sandbox(recipe.sandbox).close()

        def scripted(code: str) -> ScriptedPolicy:
            return ScriptedPolicy(lambda h: code if h.turn == 0 else _ANSWER_TURN)

        out: dict[str, Any] = {}
        for family, path in data.items():
            bench = FAMILIES[family][1]
            rows: dict[str, Any] = {}
            code = _IMAGE_TURN if family == "image" else _VIDEO_TURN
            for label, policy in (("model", model), ("scripted", scripted(code))):
                run_id = f"perf-{label}-{family}"
                model.cache_stats.clear()
                sched = thread_schedstat_s()
                tree, own, t = process_tree_cpu_s(), time.process_time(), time.monotonic()
                results = run_eval(recipe, model=str(model_path), model_tag=label,
                                   benchmarks=[bench], run_id=run_id, store=store,
                                   data_dirs={bench: path}, policy=policy, show_progress=False)
                seconds = time.monotonic() - t
                cpu = _cpu(time.process_time() - own, process_tree_cpu_s(), tree,
                           counts[family], cpus, thread_schedstat_s(), sched)
                rows[label] = {**_summary(store.eval_records(run_id, label, bench), seconds),
                               "accuracy": results[bench].get("accuracy"), "cpu": cpu}
                if policy is model:  # the work behind the time, the same on a busy machine
                    rows[label]["work"] = {k: model.cache_stats[k] for k in _WORK}
            out[family] = {"benchmark": bench, **rows}
    return {
        "model": {"path": str(model_dir) if model_dir else f"tiny {size} (built here)",
                  "parameters": sum(p.numel() for p in model.model.parameters()),
                  "dtype": str(next(model.model.parameters()).dtype).removeprefix("torch."),
                  "device": str(next(model.model.parameters()).device),
                  "build_s": round(build_s, 3), "load_s": round(load_s, 3)},
        "settings": {"max_new_tokens_per_turn": max_new_tokens, "max_turns": max_turns,
                     "batch_size": batch_size, "draft_tokens": recipe.agent.draft_tokens,
                     "share_prefixes": recipe.agent.share_prefixes,
                     # what generation ran with (agent.cpu_threads, else torch's own)
                     "torch_threads": recipe.agent.cpu_threads or torch.get_num_threads(),
                     "cpus": cpus},
        "families": out,
    }
