"""The local RL engine: the whole PyVision-RL method in one process, on CPU or one GPU.

Each step:

1. **Rollouts.** Draw ``ceil(oversample_factor x prompts_per_step)`` prompts and run ``n``
   trajectories each through the one agent loop with the policy being trained (an HF policy that
   shares this model object), sandboxes included.
2. **Rewards** per trajectory (accuracy + accumulative tool reward, guards), kept term by term.
3. **Strategy.** Advantages on whole groups (GRPO, no std normalisation by default), then filter
   and rank (:mod:`pipelines.rl.strategy`); if too few groups survive, generate another round.
4. **Update.** Old log-probs from the current weights, then PPO-clip updates on mini-batches of
   groups (verl's loss functions, token-mean over model tokens only), gradient clipping, AdamW.
   The vision tower stays frozen by default.
5. **Record** every metric of the step in the store and a row of the live table; checkpoint every
   ``save_every`` steps (weights, optimizer, sampler and RNG state) so ``--resume`` continues
   exactly where it stopped.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from pathlib import Path
from typing import Any

from pipelines.config.recipe import Recipe
from pipelines.console import err
from pipelines.data.records import Task, read_tasks
from pipelines.errors import UserError
from pipelines.rl.local_utils import (TaskSampler, TokenSequence, list_checkpoints, load_checkpoint,
                                      save_checkpoint, sequence_logprobs)
from pipelines.rl.rewards import compute_reward
from pipelines.rl.strategy import Group, Rollout, Selector, broken_reason
from pipelines.rundir import StageDir

TABLE_COLUMNS = ("step", "reward", "acc", "tools", "turns", "kept", "dropped", "gen s", "train s")


def load_rl_tasks(dirs: list[str | Path]) -> list[tuple[Task, Path]]:
    items: list[tuple[Task, Path]] = []
    for d in dirs:
        tasks, _ = read_tasks(d)
        root = Path(d) if Path(d).is_dir() else Path(d).parent
        items += [(t, root) for t in tasks]
    if not items:
        raise UserError("no RL tasks found", hint="run the data stage first (RL prompts are the "
                        "train tasks not used for SFT), or pass --tasks DIR")
    return items


def _freeze_vision(model: Any) -> int:
    frozen = 0
    for name, p in model.named_parameters():
        if ".visual." in f".{name}" or name.startswith("visual."):
            p.requires_grad_(False)
            frozen += p.numel()
    return frozen


def _load_weights(model: Any, path: Path) -> None:
    from safetensors.torch import load_file

    state = {}
    for f in sorted(path.glob("*.safetensors")):
        state.update(load_file(str(f)))
    missing, unexpected = model.load_state_dict(state, strict=False)
    real_missing = [k for k in missing if not k.endswith("lm_head.weight")]
    if real_missing or unexpected:
        raise UserError(f"checkpoint {path} does not match the model ({len(real_missing)} missing, "
                        f"{len(unexpected)} unexpected tensors)", hint="resume with the same recipe")


def train_local(recipe: Recipe, sd: StageDir, *, model_path: str, task_dirs: list[str | Path],
                resume: bool = False, show_progress: bool = True) -> dict[str, Any]:
    """Run RL with the local engine; write the final model to ``<stage>/model``."""
    import random

    import numpy as np
    import torch
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from pipelines.agent.loop import run_episodes
    from pipelines.agent.policies.hf import HFPolicy
    from pipelines.rl.algos import entropy_loss, policy_loss

    rl, local = recipe.rl, recipe.rl.local
    if local.threads:
        torch.set_num_threads(local.threads)
    device = recipe.model.device if recipe.model.device != "auto" else (
        "cuda" if torch.cuda.is_available() else "cpu")
    dtype = {"auto": torch.bfloat16 if device == "cuda" else torch.float32,
             "float32": torch.float32, "bfloat16": torch.bfloat16,
             "float16": torch.float16}[recipe.model.dtype]
    random.seed(recipe.seed)
    np.random.seed(recipe.seed)
    torch.manual_seed(recipe.seed)
    processor = AutoProcessor.from_pretrained(model_path)
    model = AutoModelForImageTextToText.from_pretrained(model_path, dtype=dtype).to(device)
    frozen = _freeze_vision(model) if rl.freeze_vision_tower else 0
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=rl.learning_rate, weight_decay=local.weight_decay)
    items = load_rl_tasks(task_dirs)
    sampler = TaskSampler(len(items), recipe.seed)
    ckpt_root = sd.path / "checkpoints"
    start_step = 0
    if resume and list_checkpoints(ckpt_root):
        latest = list_checkpoints(ckpt_root)[-1]
        _load_weights(model, latest)
        state = load_checkpoint(latest, optimizer, sampler)
        start_step = int(state["step"])
        if sd.store is not None:
            sd.store.delete_metrics_after(sd.run_id, "rl", start_step - 1)
        err.print(f"resuming RL from {latest} (step {start_step})")
    policy = HFPolicy(model, processor, image_min_pixels=recipe.agent.image_min_pixels,
                      image_max_pixels=recipe.agent.image_max_pixels)
    n_draw = math.ceil(rl.strategy.oversample_factor * rl.prompts_per_step)
    table = _LiveTable(show_progress, local.steps)
    history: list[dict[str, float]] = []
    for step in range(start_step, local.steps):
        t0 = time.monotonic()
        model.eval()
        selector = Selector(rl.prompts_per_step, rl.strategy, max_rounds=3)
        by_group: dict[int, list[Any]] = {}
        reward_of: dict[int, Any] = {}
        all_trajs = []
        while not selector.ready:
            draws = sampler.draw(n_draw)
            batch = [items[i] for i in draws]
            trajs = list(run_episodes(batch, policy, recipe.agent, recipe.sandbox, mode="train",
                                      batch_size=max(1, len(batch) * rl.n), n_per_item=rl.n))
            groups = []
            for j, draw in enumerate(draws):
                members = sorted((t for t in trajs if t.group_index == j),
                                 key=lambda t: t.sample_index)
                key = len(by_group)
                for t in members:
                    reward_of[id(t)] = compute_reward(
                        items[draw][0], t.final_answer, answer_chars=t.answer_chars,
                        successful_tool_calls=t.successful_calls,
                        well_formed=t.stop_reason == "answered", cfg=recipe.reward)
                by_group[key] = members
                groups.append(Group(prompt_index=key, task_id=items[draw][0].id, rollouts=[
                    Rollout(reward_of[id(t)].total, broken_reason(t.stop_reason, t.final_answer),
                            t.produced_image) for t in members]))
                all_trajs += members
            selector.add(groups)
        selection = selector.select()
        gen_s = time.monotonic() - t0
        tool_s = sum(t.tool_s for t in all_trajs)

        t1 = time.monotonic()
        seqs, advs, group_of = [], [], []
        for g, keep in selection.kept:
            adv = g.advantages(rl.algorithm.norm_adv_by_std)
            for i in keep:
                tr = by_group[g.prompt_index][i].trace
                seqs.append(TokenSequence(tr.input_ids, tr.response_mask, tr.prompt_len, tr.images))
                advs.append(adv[i])
                group_of.append(g.prompt_index)
        train_metrics = _update(model, processor, optimizer, params, seqs, advs, group_of, recipe,
                                policy_loss, entropy_loss) if seqs else {}
        train_s = time.monotonic() - t1

        metrics = _step_metrics(all_trajs, [reward_of[id(t)] for t in all_trajs], selection,
                                train_metrics, gen_s, tool_s, train_s)
        history.append(metrics)
        if sd.store is not None:
            sd.store.log_metrics(sd.run_id, "rl", step, metrics)
        table.add(step, metrics)
        if (step + 1) % local.save_every == 0 or step + 1 == local.steps:
            save_checkpoint(ckpt_root, step + 1, model, processor, optimizer, sampler,
                            keep=2)
    table.close()
    final = sd.path / "model"
    from pipelines.fsutil import atomic_dir

    with atomic_dir(final, overwrite=True) as tmp:
        model.save_pretrained(tmp)
        processor.save_pretrained(tmp)
    first, last = (history[0], history[-1]) if history else ({}, {})
    summary = {"steps": local.steps, "resumed_from": start_step, "frozen_vision_params": frozen,
               "first_reward": first.get("reward/mean"), "last_reward": last.get("reward/mean"),
               "first_accuracy": first.get("accuracy"), "last_accuracy": last.get("accuracy"),
               "first_tool_calls": first.get("tool_calls/mean"),
               "last_tool_calls": last.get("tool_calls/mean")}
    sd.finish({"model": str(final), "checkpoints": str(ckpt_root), "base_model": model_path},
              summary)
    return summary


def _update(model, processor, optimizer, params, seqs, advs, group_of, recipe, policy_loss,
            entropy_loss) -> dict[str, float]:
    import torch

    rl = recipe.rl
    micro = 4
    # Old log-probs (and entropy) from the weights that generated the rollouts.
    old, ent_sum, ent_tokens = [], 0.0, 0.0
    with torch.no_grad():
        for i in range(0, len(seqs), micro):
            lp, ent, mask = sequence_logprobs(model, processor, seqs[i: i + micro], with_entropy=True)
            old.append(lp)
            ent_sum += float((ent * mask).sum())
            ent_tokens += float(mask.sum())
    model.train()
    groups = sorted(set(group_of))
    per_update = max(1, min(rl.mini_batch_prompts, len(groups)))
    stats: Counter[str] = Counter()
    updates = 0
    norms = []
    for _ in range(rl.local.ppo_epochs):
        for u in range(0, len(groups), per_update):
            chosen = set(groups[u: u + per_update])
            idx = [i for i, g in enumerate(group_of) if g in chosen]
            n_tokens = sum(sum(seqs[i].response_mask) for i in idx)
            optimizer.zero_grad(set_to_none=True)
            for k in range(0, len(idx), micro):
                part = idx[k: k + micro]
                lp, ent, mask = sequence_logprobs(model, processor, [seqs[i] for i in part],
                                                  with_entropy=rl.algorithm.entropy_coef > 0)
                width = lp.shape[1]
                old_lp = torch.zeros_like(lp)
                for row, i in enumerate(part):
                    src = old[i // micro][i % micro]
                    n = min(width, src.shape[0])
                    old_lp[row, :n] = src[:n]
                adv = torch.tensor([advs[i] for i in part], dtype=lp.dtype)[:, None] * mask
                loss, m = policy_loss(old_lp, lp, adv, mask, rl.algorithm,
                                      batch_num_tokens=n_tokens, global_batch_size=len(idx))
                if rl.algorithm.entropy_coef > 0:
                    loss = loss - rl.algorithm.entropy_coef * entropy_loss(
                        ent, mask, rl.algorithm, batch_num_tokens=n_tokens)
                loss.backward()
                stats["loss"] += loss.item()
                for key, value in m.items():
                    stats[key] += value * len(part) / len(idx)
            norm = torch.nn.utils.clip_grad_norm_(params, rl.local.grad_clip)
            norms.append(float(norm))
            optimizer.step()
            updates += 1
    model.eval()
    out = {f"train/{k}": v / max(1, updates) for k, v in stats.items()}
    out["grad_norm"] = sum(norms) / len(norms) if norms else 0.0
    out["entropy"] = ent_sum / max(1.0, ent_tokens)
    out["train/updates"] = float(updates)
    return out


def _step_metrics(trajs, rewards, selection, train_metrics, gen_s, tool_s, train_s) -> dict[str, float]:
    n = max(1, len(trajs))
    stops = Counter(t.stop_reason for t in trajs)
    m = {
        "reward/mean": sum(r.total for r in rewards) / n,
        "reward/accuracy": sum(r.accuracy for r in rewards) / n,
        "reward/tool": sum(r.tool for r in rewards) / n,
        "reward/format": sum(r.format for r in rewards) / n,
        "accuracy": sum(r.correct for r in rewards) / n,
        "tool_calls/mean": sum(t.tool_calls for t in trajs) / n,
        "successful_calls/mean": sum(t.successful_calls for t in trajs) / n,
        "turns/mean": sum(t.num_turns for t in trajs) / n,
        "response_length/mean": sum(t.generated_tokens for t in trajs) / n,
        "trajectories": float(len(trajs)),
        "time/generation_s": gen_s, "time/tools_s": tool_s, "time/train_s": train_s,
    }
    for reason, count in stops.items():
        m[f"stop/{reason}"] = count / n
    m.update(selection.metrics())
    m.update(train_metrics)
    return m


class _LiveTable:
    """One row per step, printed as it completes (readable in logs and terminals alike)."""

    def __init__(self, enabled: bool, total: int) -> None:
        self.enabled = enabled
        self.total = total
        if enabled:
            err.print(" ".join(f"{c:>7}" for c in TABLE_COLUMNS))

    def add(self, step: int, m: dict[str, float]) -> None:
        if not self.enabled:
            return
        dropped = sum(v for k, v in m.items() if k.startswith("strategy/dropped_"))
        row = (f"{step + 1}/{self.total}", f"{m['reward/mean']:.3f}", f"{m['accuracy']:.3f}",
               f"{m['tool_calls/mean']:.2f}", f"{m['turns/mean']:.2f}",
               f"{m['strategy/kept_groups']:.0f}", f"{dropped:.0f}",
               f"{m['time/generation_s']:.0f}", f"{m['time/train_s']:.0f}")
        err.print(" ".join(f"{c:>7}" for c in row))

    def close(self) -> None:
        return None
