"""`pyvision perf rl`: throughput of the local RL engine on this machine.

Two numbers, measured on the engine's own code paths (:class:`pipelines.rl.local.LocalEngine`):

- **rollout**: trajectories per second (and generated tokens per second) through the agent loop,
  sandboxes included, ``prompts x n`` trajectories per round;
- **update**: training tokens per second of the PPO update (old log-probs, then forward and
  backward over every trajectory of the round; every token of each sequence counts).

The first round warms up (sandbox zygote, kernels) and is not counted. Without ``--model`` a fresh
tiny model is built, whose untrained turns run to ``max_new_tokens`` and end there: that measures
the engine at a fixed, known length. Pass an SFT model to measure realistic multi-turn rollouts.

On a GPU (``--device cuda``, bf16 by default there), ``--size qwen2.5-vl-7b`` builds a model with
the released 7B's layer shapes and random weights on the GPU (:data:`pipelines.models.tiny.SHAPES`),
and ``--lora-rank R`` trains LoRA adapters instead of every weight (``rl.lora``): the peak GPU
memory and the step times then say whether, and how fast, RL at that scale fits one GPU, before
any weights are downloaded.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Any

from pipelines.errors import UserError


def run_benchmark(*, model: str | None = None, size: str = "small", tasks: str | None = None,
                  prompts: int = 4, n: int = 4, rounds: int = 2, threads: int = 1,
                  max_new_tokens: int = 128, seed: int = 0, device: str = "cpu",
                  dtype: str = "auto", lora_rank: int = 0, image_max_pixels: int = 12544,
                  overrides: list[str] | tuple[str, ...] = ()) -> dict[str, Any]:
    """Measure rollout and update throughput; returns the JSON the CLI prints."""
    import torch

    from pipelines.config.recipe import load_recipe
    from pipelines.core.device import resolve_device, synchronize, torch_dtype
    from pipelines.models.tiny import SHAPES
    from pipelines.rl.local import LocalEngine, attach_lora, load_policy_model, load_rl_tasks
    from pipelines.rl.sampler import TaskSampler

    # First, so that a bad --set fails before any model is built, and names only what the user
    # passed (then again under the benchmark's own settings).
    load_recipe(None, list(overrides))
    device = resolve_device(device)
    recipe = load_recipe(None, [
        f"seed={seed}", f"model.device={device}", f"model.dtype={dtype}",
        f"rl.lora.rank={lora_rank}",
        f"rl.prompts_per_step={prompts}", f"rl.n={n}", f"rl.mini_batch_prompts={prompts}",
        "rl.strategy.oversample_factor=1", "rl.strategy.filter_zero_variance=false",
        "rl.strategy.filter_broken=false", "rl.local.ppo_epochs=1",
        f"rl.local.threads={threads}", f"agent.cpu_threads={threads}",
        f"agent.max_new_tokens_per_turn={max_new_tokens}",
        f"agent.image_max_pixels={image_max_pixels}", "reward.judge.base_url=null",
        *overrides])
    # Given prompts are read (and refused) before minutes of model building.
    items = load_rl_tasks([tasks]) if tasks is not None else None
    with tempfile.TemporaryDirectory(prefix="pyvision-perf-rl-") as tmp:
        build_s = 0.0
        shaped = size if model is None and size in SHAPES else None
        label = (f"{size} shape, random weights" if shaped else
                 model if model is not None else f"tiny-{size}")
        t = time.monotonic()
        if model is None and shaped is None:
            from pipelines.models.tiny import build_tiny_model

            model = str(build_tiny_model(Path(tmp) / "model", size=size, seed=seed))  # type: ignore[arg-type]
            build_s = time.monotonic() - t
        if tasks is None:
            from pipelines.data.synth import synthesize

            tasks = str(Path(tmp) / "tasks")
            synthesize("image-search", prompts * (rounds + 1), seed, tasks,
                       families=["color", "count"], progress=False)
        torch.set_num_threads(threads)
        torch.manual_seed(seed)
        if shaped is not None:
            from pipelines.models.tiny import build_shape_model
            from pipelines.rl.local import _freeze_vision

            _check_shape_fits(shaped, device, torch_dtype(recipe.model.dtype, device))
            policy_model, processor = build_shape_model(
                shaped, device=device, dtype=torch_dtype(recipe.model.dtype, device), seed=seed)
            if recipe.rl.freeze_vision_tower:  # as load_policy_model does
                _freeze_vision(policy_model)
            build_s = time.monotonic() - t
        else:
            policy_model, processor = load_policy_model(recipe, model)
        if recipe.rl.lora.enabled:  # --lora-rank, or --set rl.lora.rank=R
            attach_lora(policy_model, recipe.rl.lora)
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        if items is None:
            items = load_rl_tasks([tasks])
        engine = LocalEngine(recipe, policy_model, processor, items,
                             TaskSampler(len(items), seed))
        roll = {"trajectories": 0, "generated_tokens": 0, "turns": 0, "seconds": 0.0,
                "generation_s": 0.0, "merge_s": 0.0}
        upd = {"sequences": 0, "tokens": 0, "model_tokens": 0, "seconds": 0.0}
        for r in range(rounds + 1):
            batch = engine.rollout()
            seqs, advs, group_of = engine.training_batch(batch)
            t = time.monotonic()
            engine.update(seqs, advs, group_of)
            synchronize(policy_model)  # the step's kernels, not just their launches
            update_s = time.monotonic() - t
            if r == 0:
                continue  # warm-up
            roll["trajectories"] += len(batch.trajectories)
            roll["generated_tokens"] += sum(x.generated_tokens for x in batch.trajectories)
            roll["turns"] += sum(x.num_turns for x in batch.trajectories)
            roll["seconds"] += batch.rollout_s
            roll["generation_s"] += batch.generation_s
            roll["merge_s"] += batch.merge_s
            upd["sequences"] += len(seqs)
            upd["tokens"] += sum(len(s.input_ids) for s in seqs)
            upd["model_tokens"] += sum(sum(s.response_mask) for s in seqs)
            upd["seconds"] += update_s
    n_params = sum(p.numel() for p in policy_model.parameters())
    memory = {}
    if device == "cuda":
        gib = 2 ** 30
        memory = {"gpu": torch.cuda.get_device_name(0),
                  "peak_allocated_gib": round(torch.cuda.max_memory_allocated() / gib, 2),
                  "peak_reserved_gib": round(torch.cuda.max_memory_reserved() / gib, 2)}
    return {
        "model": label,
        "parameters": n_params,
        "trainable_parameters": sum(p.numel() for p in policy_model.parameters()
                                    if p.requires_grad),
        "lora_rank": recipe.rl.lora.rank,
        "threads": threads,
        "device": str(next(policy_model.parameters()).device),
        "dtype": str(next(policy_model.parameters()).dtype).removeprefix("torch."),
        **memory,
        "prompts": prompts, "n": n, "rounds": rounds, "max_new_tokens": max_new_tokens,
        "image_max_pixels": image_max_pixels, "overrides": list(overrides),
        "rollout": {**{k: round(v, 3) if isinstance(v, float) else v for k, v in roll.items()},
                    "trajectories_per_s": round(roll["trajectories"] / roll["seconds"], 3),
                    "generated_tokens_per_s": round(roll["generated_tokens"] / roll["seconds"], 1),
                    "turns_per_trajectory": round(roll["turns"] / roll["trajectories"], 2)},
        "update": {**{k: round(v, 3) if isinstance(v, float) else v for k, v in upd.items()},
                   "tokens_per_s": round(upd["tokens"] / upd["seconds"], 1),
                   "model_tokens_per_s": round(upd["model_tokens"] / upd["seconds"], 1)},
        "model_build_s": round(build_s, 1),
    }


def _check_shape_fits(name: str, device: str, dtype: Any) -> None:
    """Refuse, before building it, a shape model whose weights alone do not fit in the device's
    free memory (the 7B shape in fp32 on a 24 GB host would be killed by the kernel instead)."""
    from pipelines.core.device import free_memory_bytes
    from pipelines.models.tiny import build_shape_model

    meta, _ = build_shape_model(name, device="meta", dtype=dtype)
    need = sum(p.numel() * p.element_size() for p in meta.parameters())
    free = free_memory_bytes(device)
    if free is not None and need > free:
        gib = 2 ** 30
        where = "GPU" if device == "cuda" else "host"
        raise UserError(f"the {name} shape's weights alone need {need / gib:.1f} GiB in "
                        f"{str(dtype).removeprefix('torch.')}, and the {where} has "
                        f"{free / gib:.1f} GiB free",
                        hint="run it on a GPU with room for it (--device cuda), or measure a tiny "
                             "model (--size small)")
