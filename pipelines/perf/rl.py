"""`pyvision perf rl`: throughput of the local RL engine on this machine.

Two numbers, measured on the engine's own code paths (:class:`pipelines.rl.local.LocalEngine`):

- **rollout**: trajectories per second (and generated tokens per second) through the agent loop,
  sandboxes included, ``prompts x n`` trajectories per round;
- **update**: training tokens per second of the PPO update (old log-probs, then forward and
  backward over every trajectory of the round; every token of each sequence counts).

The first round warms up (sandbox zygote, kernels) and is not counted. Without ``--model`` a fresh
tiny model is built, whose untrained turns run to ``max_new_tokens`` and end there: that measures
the engine at a fixed, known length. Pass an SFT model to measure realistic multi-turn rollouts.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Any


def run_benchmark(*, model: str | None = None, size: str = "small", tasks: str | None = None,
                  prompts: int = 4, n: int = 4, rounds: int = 2, threads: int = 1,
                  max_new_tokens: int = 128, seed: int = 0) -> dict[str, Any]:
    """Measure rollout and update throughput; returns the JSON the CLI prints."""
    import torch

    from pipelines.config.recipe import load_recipe
    from pipelines.rl.local import LocalEngine, load_policy_model, load_rl_tasks
    from pipelines.rl.sampler import TaskSampler

    with tempfile.TemporaryDirectory(prefix="pyvision-perf-rl-") as tmp:
        build_s = 0.0
        if model is None:
            from pipelines.models.tiny import build_tiny_model

            t = time.monotonic()
            model = str(build_tiny_model(Path(tmp) / "model", size=size, seed=seed))  # type: ignore[arg-type]
            build_s = time.monotonic() - t
        if tasks is None:
            from pipelines.data.synth import synthesize

            tasks = str(Path(tmp) / "tasks")
            synthesize("image-search", prompts * (rounds + 1), seed, tasks,
                       families=["color", "count"], progress=False)
        recipe = load_recipe(None, [
            f"seed={seed}", "model.device=cpu", "model.dtype=float32",
            f"rl.prompts_per_step={prompts}", f"rl.n={n}", f"rl.mini_batch_prompts={prompts}",
            "rl.strategy.oversample_factor=1", "rl.strategy.filter_zero_variance=false",
            "rl.strategy.filter_broken=false", "rl.local.ppo_epochs=1",
            f"rl.local.threads={threads}", f"agent.max_new_tokens_per_turn={max_new_tokens}",
            "agent.image_max_pixels=12544", "reward.judge.base_url=null"])
        torch.set_num_threads(threads)
        torch.manual_seed(seed)
        policy_model, processor = load_policy_model(recipe, model)
        items = load_rl_tasks([tasks])
        engine = LocalEngine(recipe, policy_model, processor, items,
                             TaskSampler(len(items), seed))
        roll = {"trajectories": 0, "generated_tokens": 0, "turns": 0, "seconds": 0.0,
                "generation_s": 0.0}
        upd = {"sequences": 0, "tokens": 0, "model_tokens": 0, "seconds": 0.0}
        for r in range(rounds + 1):
            batch = engine.rollout()
            seqs, advs, group_of = engine.training_batch(batch)
            t = time.monotonic()
            engine.update(seqs, advs, group_of)
            update_s = time.monotonic() - t
            if r == 0:
                continue  # warm-up
            roll["trajectories"] += len(batch.trajectories)
            roll["generated_tokens"] += sum(x.generated_tokens for x in batch.trajectories)
            roll["turns"] += sum(x.num_turns for x in batch.trajectories)
            roll["seconds"] += batch.rollout_s
            roll["generation_s"] += batch.generation_s
            upd["sequences"] += len(seqs)
            upd["tokens"] += sum(len(s.input_ids) for s in seqs)
            upd["model_tokens"] += sum(sum(s.response_mask) for s in seqs)
            upd["seconds"] += update_s
    n_params = sum(p.numel() for p in policy_model.parameters())
    return {
        "model": "tiny-" + size if build_s else model,
        "parameters": n_params,
        "threads": threads,
        "device": str(next(policy_model.parameters()).device),
        "prompts": prompts, "n": n, "rounds": rounds, "max_new_tokens": max_new_tokens,
        "rollout": {**{k: round(v, 3) if isinstance(v, float) else v for k, v in roll.items()},
                    "trajectories_per_s": round(roll["trajectories"] / roll["seconds"], 3),
                    "generated_tokens_per_s": round(roll["generated_tokens"] / roll["seconds"], 1),
                    "turns_per_trajectory": round(roll["turns"] / roll["trajectories"], 2)},
        "update": {**{k: round(v, 3) if isinstance(v, float) else v for k, v in upd.items()},
                   "tokens_per_s": round(upd["tokens"] / upd["seconds"], 1),
                   "model_tokens_per_s": round(upd["model_tokens"] / upd["seconds"], 1)},
        "model_build_s": round(build_s, 1),
    }
