"""Checks that the local engine's update is right, on the model and settings a run uses.

- :func:`logprob_alignment`: the log-probs the trainer recomputes for a rollout's model tokens
  equal the ones the policy sampled them with (same temperature), across turns, interpreter turns
  and images. A shifted mask, a misplaced image or a wrong temperature shows here first.
- :func:`fixed_batch_check`: repeated engine steps (rollouts + PPO update, exactly as training runs
  them) on one fixed batch of prompts must raise that batch's expected reward, estimated before and
  after from many fresh samples per prompt. If it does not rise, the advantage sign, the masks, the
  log-prob alignment, clipping or the learning rate is wrong for this model.

``pyvision rl --sanity`` runs both (:func:`run_sanity`) on a run's policy and prompts and prints
JSON.
"""

from __future__ import annotations

import random
import statistics
import time
from pathlib import Path
from typing import Any

from pipelines.config.recipe import Recipe
from pipelines.core.records import Task


def expected_rewards(engine: Any, items: list[tuple[Task, Path]], samples: int) -> list[float]:
    """Mean reward per prompt over ``samples`` fresh rollouts (the engine's own reward)."""
    from pipelines.agent.loop import run_episodes

    with engine.sampling():
        trajs = list(run_episodes(items, engine.policy, engine.recipe.agent, engine.recipe.sandbox,
                                  mode="train", batch_size=min(len(items) * samples, 64),
                                  n_per_item=samples))
    by_item: dict[int, list[Any]] = {}
    for t in trajs:
        by_item.setdefault(t.group_index, []).append(t)
    means = []
    for i in range(len(items)):
        group = sorted(by_item[i], key=lambda t: t.sample_index)
        rewards = engine.rewards([(items[i][0], t) for t in group])
        means.append(sum(r.total for r in rewards) / len(rewards))
    return means


def paired_interval(deltas: list[float], resamples: int = 2000, seed: int = 0) -> list[float]:
    """95% bootstrap interval of the mean of per-prompt differences."""
    rng = random.Random(seed)
    n = len(deltas)
    means = sorted(sum(rng.choice(deltas) for _ in range(n)) / n for _ in range(resamples))
    return [means[int(0.025 * resamples)], means[int(0.975 * resamples) - 1]]


def logprob_alignment(engine: Any, items: list[tuple[Task, Path]], samples: int = 2) -> dict:
    """Largest gap between sampled and recomputed log-probs of the rollouts' model tokens."""
    import torch

    from pipelines.agent.loop import run_episodes
    from pipelines.rl.logprobs import TokenSequence, sequence_logprobs

    with engine.sampling():
        trajs = list(run_episodes(items, engine.policy, engine.recipe.agent, engine.recipe.sandbox,
                                  mode="train", batch_size=len(items) * samples,
                                  n_per_item=samples))
    worst = 0.0
    tokens = turns = images = 0
    with torch.no_grad():
        for t in trajs:
            tr = t.trace
            seq = TokenSequence(tr.input_ids, tr.response_mask, tr.prompt_len, tr.images)
            lp, _, mask = sequence_logprobs(engine.model, engine.processor, [seq],
                                            temperature=engine.recipe.agent.temperature)
            recomputed = lp[0][mask[0] > 0]
            sampled = torch.tensor(tr.logprobs, dtype=recomputed.dtype)
            if len(sampled) != len(recomputed):
                raise AssertionError(f"{t.task_id}: {len(sampled)} sampled log-probs, "
                                     f"{len(recomputed)} model tokens")
            if len(sampled):
                worst = max(worst, float((sampled - recomputed).abs().max()))
            tokens += len(sampled)
            turns += t.num_turns
            images += len(tr.images)
    return {"max_abs_diff": worst, "trajectories": len(trajs), "model_tokens": tokens,
            "turns": turns, "images": images}


def fixed_batch_check(recipe: Recipe, model: Any, processor: Any,
                      items: list[tuple[Task, Path]], *, steps: int = 8, samples: int = 16,
                      show_progress: bool = False) -> dict[str, Any]:
    """Train ``steps`` engine steps on ``items`` only; expected reward before and after.

    Every step draws every prompt of the fixed batch once and trains on what the strategy keeps.
    Sampling is seeded from ``recipe.seed``, so a check repeats on the same machine."""
    import torch

    from pipelines.config.loader import apply_overrides
    from pipelines.console import err
    from pipelines.rl.local import LocalEngine
    from pipelines.rl.sampler import TaskSampler

    recipe = type(recipe).model_validate(apply_overrides(
        recipe.model_dump(mode="json"),
        [f"rl.prompts_per_step={len(items)}", "rl.strategy.oversample_factor=1.0"]))
    engine = LocalEngine(recipe, model, processor, items, TaskSampler(len(items), recipe.seed))
    torch.manual_seed(recipe.seed)
    start = time.monotonic()
    before = expected_rewards(engine, items, samples)
    curve = []
    for step in range(steps):
        batch = engine.rollout()
        metrics = engine.update(*engine.training_batch(batch))
        mean = sum(r.total for r in batch.rewards) / max(1, len(batch.rewards))
        curve.append({"reward": round(mean, 4), "kept_groups": len(batch.selection.kept),
                      "grad_norm": round(metrics.get("grad_norm", 0.0), 4),
                      "clipfrac": round(metrics.get("train/pg_clipfrac", 0.0), 4)})
        if show_progress:
            err.print(f"sanity step {step + 1}/{steps}: rollout reward {mean:.3f}, "
                      f"kept {len(batch.selection.kept)} groups")
    after = expected_rewards(engine, items, samples)
    deltas = [a - b for a, b in zip(after, before)]
    return {"prompts": len(items), "samples_per_prompt": samples, "steps": steps,
            "before": round(statistics.mean(before), 4), "after": round(statistics.mean(after), 4),
            "delta": round(statistics.mean(deltas), 4),
            "delta_ci95": [round(x, 4) for x in paired_interval(deltas)],
            "per_prompt_before": [round(x, 3) for x in before],
            "per_prompt_after": [round(x, 3) for x in after],
            "curve": curve, "seconds": round(time.monotonic() - start, 1)}


# A log-prob gap above this means the trainer scores other tokens, positions or images than the
# sampler did (float32 on CPU stays near 1e-5; bf16 on a GPU is looser).
ALIGNMENT_TOLERANCE = {"float32": 1e-3, "bfloat16": 5e-2, "float16": 5e-2}


def run_sanity(recipe: Recipe, model_path: str, task_dirs: list[str], *, prompts: int = 6,
               steps: int = 12, samples: int = 16, show_progress: bool = True) -> dict[str, Any]:
    """Both checks on ``model_path`` and the first ``prompts`` tasks of ``task_dirs``, with
    ``recipe``'s RL settings. ``passed``: the log-probs line up and the fixed batch's expected
    reward rose (the lower end of its paired 95% interval above zero)."""
    from pipelines.core.records import read_tasks
    from pipelines.rl.local import LocalEngine, load_policy_model
    from pipelines.rl.sampler import TaskSampler

    items: list[tuple[Task, Path]] = []
    for d in task_dirs:
        tasks, _ = read_tasks(d, strict=True)
        items += [(t, Path(d)) for t in tasks]
    items = items[:prompts]
    model, processor = load_policy_model(recipe, model_path)
    engine = LocalEngine(recipe, model, processor, items, TaskSampler(len(items), recipe.seed))
    alignment = logprob_alignment(engine, items[:2])
    batch = fixed_batch_check(recipe, model, processor, items, steps=steps, samples=samples,
                              show_progress=show_progress)
    tolerance = ALIGNMENT_TOLERANCE.get(recipe.model.dtype, 1e-3)
    aligned = alignment["max_abs_diff"] <= tolerance
    rose = batch["delta_ci95"][0] > 0
    return {"model": model_path, "passed": aligned and rose,
            "logprob_alignment": {**alignment, "tolerance": tolerance, "passed": aligned},
            "fixed_batch": {**batch, "passed": rose}}
