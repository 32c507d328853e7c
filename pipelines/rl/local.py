"""The local RL engine: the whole PyVision-RL method in one process, on CPU or one GPU.

Each step:

1. **Rollouts.** Draw ``ceil(oversample_factor x prompts_per_step)`` prompts and run ``n``
   trajectories each through the one agent loop with the policy being trained (an HF policy that
   shares this model object), sandboxes included.
2. **Rewards** per trajectory (accuracy + accumulative tool reward, guards), kept term by term.
   With ``reward.judge.base_url`` set, the LLM judge (cached in the store) decides the answer
   types it is configured for; its calls run concurrently, and fallbacks are counted per step.
3. **Strategy.** Advantages on whole groups (GRPO, no std normalisation by default), then filter
   and rank (:mod:`pipelines.rl.strategy`); if too few groups survive, generate another round
   (at most ``rl.strategy.max_rounds`` rounds per step).
4. **Update.** Old log-probs from the current weights, then PPO-clip updates on mini-batches of
   ``rl.mini_batch_prompts`` groups (verl's loss functions, token-mean over model tokens only),
   an optional KL to the starting policy, gradient clipping, AdamW. The vision tower stays frozen
   by default.
5. **Record** every metric of the step in the store and a row of the live table; checkpoint every
   ``save_every`` steps (weights, optimizer, sampler and RNG state) so ``--resume`` continues
   exactly where it stopped: a run of k steps and a run of k1 steps resumed to k log the same
   metrics and end with the same weights.

Step metrics (names as stored): ``reward/mean|std|accuracy|tool|format``, ``reward/judged``,
``reward/judge_fallbacks``, ``accuracy``, ``tool_calls/mean``, ``successful_calls/mean``,
``turns/mean``, ``response_length/mean`` (model tokens per trajectory), ``stop/<reason>`` (every
stop reason, 0 when none stopped so), ``strategy/*`` (kept and dropped groups by reason, groups
varying in reward and in accuracy), ``entropy``, ``grad_norm``, ``train/*`` (loss, clip fraction,
KL, trajectories masked by ``rl.mask_truncated``, the learning rate ``train/lr``, ...),
``time/rollout_s`` =
``time/generation_s`` + ``time/tools_s`` + ``time/reward_s`` + ``time/merge_s`` (LoRA adapters
merged for the rollout and the base weights restored, ``rl.lora.merge_for_rollout``), and
``time/train_s``.

Validation (``rl.local.test_freq``, off by default; verl's ``trainer.test_freq`` with
``val_before_train``): greedy trajectories on ``rl.val_tasks`` (else the data stage's held-out
sets) before the first step, every N steps and after the last, scored by the reward:
``val/accuracy``, ``val/reward``, ``val/<data source>/accuracy`` and ``time/val_s``, logged at the
step whose rollouts those weights generate (the last one at step ``steps``). It does not change
what the run learns (``test_rl_local.py``).
"""

from __future__ import annotations

import contextlib
import copy
import math
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipelines.agent.trajectory import TRUNCATED_STOPS
from pipelines.config.recipe import Recipe
from pipelines.console import err
from pipelines.core.checkpoints import list_checkpoints, load_checkpoint, save_checkpoint
from pipelines.core.modeldir import LORA_MARKER
from pipelines.core.records import Task, read_tasks
from pipelines.errors import UserError
from pipelines.rl.algos import build_optimizer
from pipelines.rl.logprobs import TokenSequence, sequence_logprobs
from pipelines.rl.rollouts import RLObserver
from pipelines.rl.sampler import TaskSampler
from pipelines.rl.strategy import Group, Rollout, Selection, Selector, broken_reason, stop_rates
from pipelines.rundir import StageDir
from pipelines.scoring.reward import RewardBreakdown, compute_reward

# Sequences per forward/backward pass; gradients accumulate over a mini-batch, so this changes
# memory, not the result.
MICRO_BATCH = 4


def task_items(dirs: list[str | Path], *, strict: bool = False) -> list[tuple[Task, Path]]:
    """(task, media root) for every task in ``dirs`` (folders or tasks.jsonl files)."""
    items: list[tuple[Task, Path]] = []
    for d in dirs:
        tasks, _ = read_tasks(d, strict=strict)
        root = Path(d) if Path(d).is_dir() else Path(d).parent
        items += [(t, root) for t in tasks]
    return items


def load_rl_tasks(dirs: list[str | Path]) -> list[tuple[Task, Path]]:
    items = task_items(dirs)
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


def load_policy_model(recipe: Recipe, model_path: str) -> tuple[Any, Any]:
    """(model, processor) on the recipe's device and dtype, vision tower frozen if asked."""
    from pipelines.core.device import resolve_device, torch_dtype
    from pipelines.core.modeldir import load_vlm
    from pipelines.inputs import check_model

    check_model(model_path, "policy model")  # a missing folder is "not found", not a bad hub id
    device = resolve_device(recipe.model.device)
    model, processor = load_vlm(model_path, dtype=torch_dtype(recipe.model.dtype, device),
                                what="the policy", hint="pass a local Hugging Face model folder "
                                                        "(--model), or run the sft stage first")
    model.to(device)
    if recipe.rl.freeze_vision_tower:
        _freeze_vision(model)
    return model, processor


def lora_target_regex(targets: list[str]) -> str:
    """peft's ``target_modules`` as a regex: the named linear layers of the language model,
    never the vision tower's (whose MLPs use the same names)."""
    names = "|".join(sorted({t.strip(".") for t in targets}))
    return rf"^(?!.*\bvisual\b).*\.(?:{names})$"


def attach_lora(model: Any, cfg: Any, adapter: str | Path | None = None) -> Any:
    """Wrap ``model`` with trainable LoRA adapters (fresh, or loaded from ``adapter``); the
    adapters are injected into ``model``'s own modules, so ``model`` itself runs with them.
    Returns the peft model (what saves and loads adapters)."""
    try:
        from peft import LoraConfig, PeftModel, get_peft_model
    except ImportError:
        raise UserError("rl.lora needs the peft package, which is not installed",
                        hint="pip install peft (it comes with the project's constraints)") from None
    if adapter is not None:
        return PeftModel.from_pretrained(model, str(adapter), is_trainable=True)
    config = LoraConfig(r=cfg.rank, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout,
                        target_modules=lora_target_regex(cfg.target_modules), bias="none")
    peft_model = get_peft_model(model, config)
    if not any(p.requires_grad for p in peft_model.parameters()):
        raise UserError(f"rl.lora.target_modules {cfg.target_modules} matched no linear layer "
                        "of the language model", hint="use names such as q_proj, v_proj")
    return peft_model


class MergedAdapters:
    """For the duration of a ``with`` block (rollouts): each LoRA layer's adapter folded into its
    base weight and the layer itself swapped out of the model for that base layer, so the model
    runs as a plain merged model (as vLLM gets it at scale), not through peft's wrappers, whose
    per-call Python costs more than their matrix products while decoding one token at a time.
    Afterwards the wrappers go back and every base weight is restored exactly.

    Unmerging alone would not restore them: ``(W + dW) - dW`` rounds (in bf16, at every step, and
    the error would accumulate in weights that are meant to stay frozen). So each adapted base
    weight is copied once to host memory, and after peft's own unmerge (which keeps its
    bookkeeping) the copy is written back. Training never sees merged weights: old log-probs
    are recomputed after the rollout with the adapters unmerged."""

    def __init__(self, model: Any) -> None:
        from peft.tuners.lora import LoraLayer

        parents = dict(model.named_modules())
        self.layers: list[tuple[Any, Any, str]] = []  # (LoRA layer, its parent, attribute)
        for name, module in parents.items():
            if isinstance(module, LoraLayer):
                parent, _, attr = name.rpartition(".")
                self.layers.append((module, parents[parent], attr))
        self.saved = [layer.get_base_layer().weight.detach().to("cpu", copy=True)
                      for layer, _, _ in self.layers]

    @contextlib.contextmanager
    def __call__(self) -> Iterator[None]:
        import torch

        with torch.no_grad():
            for layer, parent, attr in self.layers:
                layer.merge()
                setattr(parent, attr, layer.get_base_layer())
        try:
            yield
        finally:
            with torch.no_grad():
                for (layer, parent, attr), saved in zip(self.layers, self.saved):
                    setattr(parent, attr, layer)
                    layer.unmerge()
                    layer.get_base_layer().weight.copy_(saved)
                if self.layers and self.layers[0][0].get_base_layer().weight.is_cuda:
                    # The rollout's blocks (KV caches, the merge's temporaries) left cached
                    # slow the update that follows: measured on an H100 with the 7B's shapes,
                    # LoRA r=64, 16 x 1024 tokens, 7.1-7.2 s an update after merged rollouts
                    # against 4.1 s after unmerged ones, and 4.6 s with the cache emptied here.
                    torch.cuda.empty_cache()


def save_adapter(peft_model: Any, processor: Any, out: Path, base_model: str, cfg: Any) -> None:
    """The adapter, the processor and a marker saying what to merge it into
    (``pipelines.sft.lora.merge_lora`` merges such folders with peft)."""
    import json

    from pipelines.fsutil import atomic_dir

    with atomic_dir(out, overwrite=True) as tmp:
        peft_model.save_pretrained(tmp)
        processor.save_pretrained(tmp)
        (tmp / LORA_MARKER).write_text(json.dumps(
            {"engine": "local", "base_model": base_model, "rank": cfg.rank, "alpha": cfg.alpha,
             "target_modules": list(cfg.target_modules)}, indent=2) + "\n")


@dataclass
class RolloutBatch:
    """One step's rollouts: every generated trajectory, its reward, and what the strategy kept."""

    trajectories: list[Any]
    rewards: list[RewardBreakdown]
    groups: dict[int, list[Any]]  # group key -> its trajectories, in sample order
    selection: Selection
    rollout_s: float     # wall time of the whole phase
    generation_s: float  # wall time inside the model's generate calls
    reward_s: float      # wall time computing rewards (judge requests included)
    merge_s: float = 0.0  # wall time merging LoRA adapters in and restoring the base weights
    masked: int = 0      # kept trajectories left out of the loss by rl.mask_truncated


class LocalEngine:
    """Rollouts and PPO updates on one in-process model (used by training and `pyvision perf rl`)."""

    def __init__(self, recipe: Recipe, model: Any, processor: Any,
                 items: list[tuple[Task, Path]], sampler: TaskSampler, *, judge: Any = None,
                 ref_model: Any = None) -> None:
        self.recipe, self.model, self.processor = recipe, model, processor
        self.items, self.sampler, self.judge, self.ref_model = items, sampler, judge, ref_model
        rl = recipe.rl
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = build_optimizer(self.params, rl)
        self.policy = self._new_policy()
        self.n_draw = math.ceil(rl.strategy.oversample_factor * rl.prompts_per_step)
        # LoRA: rollouts run on merged weights (rl.lora.merge_for_rollout).
        merged = MergedAdapters(model) if rl.lora.enabled and rl.lora.merge_for_rollout else None
        self.merged = merged if merged and merged.layers else None  # None: no adapters attached
        tok = processor.tokenizer
        self._vision_pads = sorted({tok.convert_tokens_to_ids(t)
                                    for t in ("<|image_pad|>", "<|video_pad|>")})

    def set_lr_for(self, step: int, steps: int) -> float:
        """The rate of RL step ``step`` (0-based) of ``steps``: verl's constant schedule with
        linear warm-up (``rl.lr_warmup_steps_ratio``), from the step index alone, so a resumed
        run continues on the same schedule."""
        warmup = int(self.recipe.rl.lr_warmup_steps_ratio * steps)
        lr = self.recipe.rl.learning_rate * (step / max(1, warmup) if step < warmup else 1.0)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        return lr

    def _new_policy(self) -> Any:
        from pipelines.agent.policies.hf import HFPolicy

        agent = self.recipe.agent
        return HFPolicy(self.model, self.processor, image_min_pixels=agent.image_min_pixels,
                        image_max_pixels=agent.image_max_pixels, image_factor=agent.image_factor,
                        draft_tokens=agent.draft_tokens, threads=agent.cpu_threads,
                        share_prefixes=agent.share_prefixes)

    # -- rollouts ------------------------------------------------------------------------------

    def rewards(self, pairs: list[tuple[Task, Any]]) -> list[RewardBreakdown]:
        """Rewards of (task, trajectory) pairs, in order; judge requests run concurrently."""
        cfg = self.recipe.reward

        def one(pair: tuple[Task, Any]) -> RewardBreakdown:
            task, t = pair
            return compute_reward(task, t.final_answer, answer_chars=t.answer_chars,
                                  successful_tool_calls=t.successful_calls,
                                  well_formed=t.stop_reason == "answered", cfg=cfg,
                                  judge=self.judge)

        if self.judge is None or len(pairs) < 2:
            return [one(p) for p in pairs]
        with ThreadPoolExecutor(max_workers=min(len(pairs), self.judge.cfg.concurrency),
                                thread_name_prefix="judge") as pool:
            return list(pool.map(one, pairs))

    @contextlib.contextmanager
    def sampling(self) -> Iterator[None]:
        """While rolling out: eval mode, and no sampled vision pads. A weak policy sampling at
        T=1 sometimes emits <|image_pad|> itself; the next forward then has one more image token
        than image features and raises. Suppressed while rolling out only, so the saved models'
        generation configs stay as they were."""
        self.model.eval()
        gen_cfg = self.model.generation_config
        saved = gen_cfg.suppress_tokens
        gen_cfg.suppress_tokens = sorted(set(saved or []) | set(self._vision_pads))
        try:
            yield
        finally:
            gen_cfg.suppress_tokens = saved

    def rollout(self) -> RolloutBatch:
        """Generate rounds of groups until enough survive the strategy's filters."""
        from pipelines.core.device import synchronize

        start = time.monotonic()
        with self.sampling(), (self.merged() if self.merged else contextlib.nullcontext()):
            synchronize(self.model)
            merged_at = time.monotonic()
            batch = self._rollout()
            restore_at = time.monotonic()
        # The phase's time includes merging and restoring the adapters
        # (rl.lora.merge_for_rollout) and, on a GPU, every kernel and copy queued, not only
        # their launches.
        synchronize(self.model)
        end = time.monotonic()
        batch.rollout_s = end - start
        batch.merge_s = (merged_at - start) + (end - restore_at) if self.merged else 0.0
        return batch

    def _rollout(self) -> RolloutBatch:
        from pipelines.agent.loop import run_episodes

        rl = self.recipe.rl
        selector = Selector(rl.prompts_per_step, rl.strategy)
        groups: dict[int, list[Any]] = {}
        trajectories: list[Any] = []
        rewards: list[RewardBreakdown] = []
        reward_s = 0.0
        while not selector.ready:
            draws = self.sampler.draw(self.n_draw)
            batch = [self.items[i] for i in draws]
            trajs = list(run_episodes(batch, self.policy, self.recipe.agent, self.recipe.sandbox,
                                      mode="train", batch_size=max(1, len(batch) * rl.n),
                                      n_per_item=rl.n, max_prompt_tokens=rl.max_prompt_tokens))
            members = [sorted((t for t in trajs if t.group_index == j), key=lambda t: t.sample_index)
                       for j in range(len(draws))]
            t0 = time.monotonic()
            flat = [(self.items[draw][0], t) for draw, ms in zip(draws, members) for t in ms]
            scored = iter(self.rewards(flat))
            reward_s += time.monotonic() - t0
            round_groups = []
            for draw, ms in zip(draws, members):
                key = len(groups)
                rs = [next(scored) for _ in ms]
                groups[key] = ms
                trajectories += ms
                rewards += rs
                round_groups.append(Group(prompt_index=key, task_id=self.items[draw][0].id,
                                          rollouts=[Rollout(r.total, broken_reason(t.stop_reason,
                                                                                   t.final_answer),
                                                            t.produced_image, float(r.correct))
                                                    for t, r in zip(ms, rs)]))
            selector.add(round_groups)
        return RolloutBatch(trajectories, rewards, groups, selector.select(),
                            rollout_s=0.0,  # set by rollout()
                            generation_s=sum(t.generation_s for t in trajectories),
                            reward_s=reward_s)

    def validate(self, items: list[tuple[Task, Path]]) -> dict[str, float]:
        """verl's validation: one greedy trajectory per task (the evaluation's sampling and turn
        limit), scored by the reward. ``val/accuracy``, ``val/reward`` (the mean reward), and
        ``val/<data source>/accuracy`` for each data source. It leaves training as it was: the
        random states are restored and the trajectories run on a policy of their own (the
        rollouts' drafts stay the rollouts'), so a run validates without changing what it
        learns."""
        import random

        import numpy as np
        import torch

        from pipelines.agent.loop import run_episodes

        states = random.getstate(), np.random.get_state()
        with torch.random.fork_rng(devices=[]), self.sampling(), \
                (self.merged() if self.merged else contextlib.nullcontext()):
            trajs = list(run_episodes(items, self._new_policy(), self.recipe.agent,
                                      self.recipe.sandbox, mode="eval",
                                      batch_size=self.recipe.eval.batch_size))
        random.setstate(states[0])
        np.random.set_state(states[1])
        trajs.sort(key=lambda t: t.group_index)
        rewards = self.rewards([(items[t.group_index][0], t) for t in trajs])
        by_source: dict[str, list[float]] = {}
        for t, r in zip(trajs, rewards):
            by_source.setdefault(t.data_source, []).append(float(r.correct))
        n = max(1, len(rewards))
        out = {"val/accuracy": sum(r.correct for r in rewards) / n,
               "val/reward": sum(r.total for r in rewards) / n}
        out.update({f"val/{source}/accuracy": sum(v) / len(v)
                    for source, v in sorted(by_source.items())})
        return out

    def training_batch(self, batch: RolloutBatch) -> tuple[list[TokenSequence], list[float], list[int]]:
        """The kept trajectories as token sequences, with their group advantages and group keys.

        With ``rl.mask_truncated``, trajectories stopped by the turn or context limit are left
        out (all their tokens masked: no loss); their rewards still set their group's mean."""
        seqs, advs, group_of = [], [], []
        batch.masked = 0
        for g, keep in batch.selection.kept:
            adv = g.advantages(self.recipe.rl.algorithm.norm_adv_by_std)
            for i in keep:
                traj = batch.groups[g.prompt_index][i]
                if self.recipe.rl.mask_truncated and traj.stop_reason in TRUNCATED_STOPS:
                    batch.masked += 1
                    continue
                tr = traj.trace
                seqs.append(TokenSequence(tr.input_ids, tr.response_mask, tr.prompt_len, tr.images,
                                          tr.temperatures))
                advs.append(adv[i])
                group_of.append(g.prompt_index)
        return seqs, advs, group_of

    # -- update --------------------------------------------------------------------------------

    def _logprobs(self, model: Any, seqs: list[TokenSequence], with_entropy: bool):
        return sequence_logprobs(model, self.processor, seqs, with_entropy=with_entropy,
                                 temperature=self.recipe.agent.temperature)

    def update(self, seqs: list[TokenSequence], advs: list[float],
               group_of: list[int]) -> dict[str, float]:
        """PPO-clip updates over mini-batches of whole groups; returns the training metrics."""
        import torch

        from pipelines.rl.algos import entropy_loss, kl_loss, policy_loss

        rl = self.recipe.rl
        alg = rl.algorithm
        if not seqs:
            return {"train/updates": 0.0}
        # Old (and reference) log-probs from the weights that generated the rollouts.
        old: list[Any] = []
        ref: list[Any] = []
        ent_sum = ent_tokens = 0.0
        with torch.no_grad():
            for i in range(0, len(seqs), MICRO_BATCH):
                part = seqs[i: i + MICRO_BATCH]
                lp, ent, mask = self._logprobs(self.model, part, with_entropy=True)
                old += list(lp)
                ent_sum += float((ent * mask).sum())
                ent_tokens += float(mask.sum())
                if self.ref_model is not None:
                    ref += list(self._logprobs(self.ref_model, part, with_entropy=False)[0])

        def aligned(rows: list[Any], idx: list[int], like: Any) -> Any:
            out = torch.zeros_like(like)
            for r, i in enumerate(idx):
                n = min(like.shape[1], rows[i].shape[0])
                out[r, :n] = rows[i][:n]
            return out

        self.model.train()
        groups = sorted(set(group_of))
        per_update = max(1, min(rl.mini_batch_prompts, len(groups)))
        stats: Counter[str] = Counter()
        updates = 0
        norms = []
        tokens = 0
        for _ in range(rl.local.ppo_epochs):
            for u in range(0, len(groups), per_update):
                chosen = set(groups[u: u + per_update])
                idx = [i for i, g in enumerate(group_of) if g in chosen]
                n_tokens = sum(sum(seqs[i].response_mask) for i in idx)
                self.optimizer.zero_grad(set_to_none=True)
                for k in range(0, len(idx), MICRO_BATCH):
                    part = idx[k: k + MICRO_BATCH]
                    lp, ent, mask = self._logprobs(self.model, [seqs[i] for i in part],
                                                   with_entropy=alg.entropy_coef > 0)
                    adv = torch.tensor([advs[i] for i in part], dtype=lp.dtype,
                                       device=lp.device)[:, None] * mask
                    loss, m = policy_loss(aligned(old, part, lp), lp, adv, mask, alg,
                                          batch_num_tokens=n_tokens, global_batch_size=len(idx))
                    if alg.entropy_coef > 0:
                        loss = loss - alg.entropy_coef * entropy_loss(
                            ent, mask, alg, batch_num_tokens=n_tokens)
                    if self.ref_model is not None:
                        kl = kl_loss(lp, aligned(ref, part, lp), mask, alg,
                                     batch_num_tokens=n_tokens)
                        loss = loss + alg.kl_coef * kl
                        stats["kl"] += kl.item()
                    loss.backward()
                    stats["loss"] += loss.item()
                    for key, value in m.items():
                        stats[key] += value * len(part) / len(idx)
                    tokens += sum(len(seqs[i].input_ids) for i in part)
                norm = torch.nn.utils.clip_grad_norm_(self.params, rl.optimizer.grad_clip)
                norms.append(float(norm))
                self.optimizer.step()
                updates += 1
        self.model.eval()
        out = {f"train/{k}": v / updates for k, v in stats.items()}
        out["grad_norm"] = sum(norms) / len(norms)
        out["entropy"] = ent_sum / max(1.0, ent_tokens)
        out["train/updates"] = float(updates)
        out["train/sequences"] = float(len(seqs))
        out["train/tokens"] = float(tokens)
        return out


def train_local(recipe: Recipe, sd: StageDir, *, model_path: str, task_dirs: list[str | Path],
                resume: bool = False, show_progress: bool = True) -> dict[str, Any]:
    """Run RL with the local engine; write the final model to ``<stage>/model``."""
    import random

    import numpy as np
    import torch

    rl, local = recipe.rl, recipe.rl.local
    if local.threads:
        torch.set_num_threads(local.threads)
    random.seed(recipe.seed)
    np.random.seed(recipe.seed)
    torch.manual_seed(recipe.seed)
    ckpt_root = sd.path / "checkpoints"
    latest = list_checkpoints(ckpt_root)[-1] if resume and list_checkpoints(ckpt_root) else None
    if resume and latest is None:
        err.print("[yellow]--resume: no checkpoint found; starting from step 0[/]")
    # A checkpoint is a complete Hugging Face model: load it through transformers, which maps the
    # saved tensor names onto the module (they differ from state_dict() names in transformers 5).
    # With LoRA a checkpoint holds the adapter: the weights always come from the base.
    model, processor = load_policy_model(recipe, str(model_path if rl.lora.enabled
                                                     else latest or model_path))
    ref_model = None
    if rl.algorithm.kl_coef > 0:
        # The KL reference is the starting policy, not the checkpoint being resumed.
        ref_model = (load_policy_model(recipe, model_path)[0] if latest is not None
                     and not rl.lora.enabled else copy.deepcopy(model)).eval().requires_grad_(False)
    frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    peft_model = attach_lora(model, rl.lora, latest) if rl.lora.enabled else None
    judge = None
    if recipe.reward.judge.base_url:
        from pipelines.scoring.judge import Judge

        judge = Judge(recipe.reward.judge, store=sd.store)
    items = load_rl_tasks(task_dirs)
    val_items = _validation_items(recipe, sd) if local.test_freq > 0 else []
    engine = LocalEngine(recipe, model, processor, items, TaskSampler(len(items), recipe.seed),
                         judge=judge, ref_model=ref_model)
    start_step = 0
    history: list[dict[str, float]] = []
    if latest is not None:
        state = load_checkpoint(latest, engine.optimizer, engine.sampler)
        start_step = int(state["step"])
        history = list(state.get("extra", {}).get("history", []))
        err.print(f"resuming RL from {latest} (step {start_step})", markup=False)
    if sd.store is not None:
        # Steps from start_step on are logged again (all of them when starting from step 0).
        sd.store.delete_metrics_after(sd.run_id, "rl", start_step - 1)
    # Rollouts for the report and metrics for trackers (pipelines/rl/rollouts.py).
    observer = RLObserver(recipe, sd, items)
    table = LiveTable(show_progress, local.steps)
    validations: dict[int, dict[str, float]] = {}

    def validate(done: int) -> dict[str, float]:
        """Validation of the weights after ``done`` steps, when one is due (verl's schedule)."""
        if not val_items or (done % local.test_freq and done != local.steps):
            return {}
        t = time.monotonic()
        out = {**engine.validate(val_items), "time/val_s": time.monotonic() - t}
        validations[done] = out
        return out

    try:
        for step in range(start_step, local.steps):
            # Logged at the step whose rollouts these weights generate (after ``step`` updates).
            val = validate(step)
            lr = engine.set_lr_for(step, local.steps)
            batch = engine.rollout()
            t1 = time.monotonic()
            train_metrics = engine.update(*engine.training_batch(batch))
            train_s = time.monotonic() - t1
            metrics = {**step_metrics(batch, train_metrics, train_s), "train/lr": lr, **val}
            history.append(metrics)
            if sd.store is not None:
                sd.store.log_metrics(sd.run_id, "rl", step, metrics)
            table.add(step, metrics)
            observer.step(step, batch, metrics)
            if (step + 1) % local.save_every == 0 or step + 1 == local.steps:
                save_checkpoint(ckpt_root, step + 1, peft_model or model, processor,
                                engine.optimizer, engine.sampler, extra={"history": history},
                                keep=2)
        final_val = validate(local.steps)
        if final_val:
            if sd.store is not None:
                sd.store.log_metrics(sd.run_id, "rl", local.steps, final_val)
            table.validation(local.steps, final_val)
    finally:
        table.close()
        observer.close()
    if peft_model is not None:
        # The merge stage (or `pyvision merge --lora`) merges it into the base.
        save_adapter(peft_model, processor, sd.path / "adapter", model_path, rl.lora)
        outputs = {"adapter": str(sd.path / "adapter")}
    else:
        final = sd.path / "model"
        from pipelines.fsutil import atomic_dir

        with atomic_dir(final, overwrite=True) as tmp:
            model.save_pretrained(tmp)
            processor.save_pretrained(tmp)
        outputs = {"model": str(final)}
    first, last = (history[0], history[-1]) if history else ({}, {})
    summary = {"steps": local.steps, "resumed_from": start_step, "frozen_vision_params": frozen,
               "first_reward": first.get("reward/mean"), "last_reward": last.get("reward/mean"),
               "first_accuracy": first.get("accuracy"), "last_accuracy": last.get("accuracy"),
               "first_tool_calls": first.get("tool_calls/mean"),
               "last_tool_calls": last.get("tool_calls/mean")}
    if validations:
        first_v, last_v = min(validations), max(validations)
        summary.update({"first_val_step": first_v,
                        "first_val_accuracy": validations[first_v]["val/accuracy"],
                        "last_val_step": last_v,
                        "last_val_accuracy": validations[last_v]["val/accuracy"]})
    if judge is not None:
        summary.update({f"judge_{k}": v for k, v in judge.stats().items()})
    if peft_model is not None:
        summary["lora_trainable_params"] = sum(p.numel() for p in peft_model.parameters()
                                               if p.requires_grad)
    sd.finish({**outputs, "checkpoints": str(ckpt_root), "base_model": model_path}, summary)
    return summary


def _validation_items(recipe: Recipe, sd: StageDir) -> list[tuple[Task, Path]]:
    """The tasks ``rl.local.test_freq`` validates on (``rl.val_tasks``, else the data stage's
    held-out sets); none: a warning, and validation is off, as verl turns it off."""
    from pipelines.rl.validation import validation_sources

    items = task_items(validation_sources(recipe, sd), strict=recipe.data.strict)
    if not items:
        err.print("[yellow]rl.local.test_freq is set, but there are no validation tasks "
                  "(rl.val_tasks, or the data stage's held-out sets): validation is off[/]")
    return items


def step_metrics(batch: RolloutBatch, train_metrics: dict[str, float],
                 train_s: float) -> dict[str, float]:
    trajs, rewards = batch.trajectories, batch.rewards
    n = max(1, len(trajs))
    mean = sum(r.total for r in rewards) / n
    m = {
        "reward/mean": mean,
        "reward/std": math.sqrt(sum((r.total - mean) ** 2 for r in rewards) / n),
        "reward/accuracy": sum(r.accuracy for r in rewards) / n,
        "reward/tool": sum(r.tool for r in rewards) / n,
        "reward/format": sum(r.format for r in rewards) / n,
        "reward/judged": float(sum(r.judged for r in rewards)),
        "reward/judge_fallbacks": float(sum(r.judge_fallback for r in rewards)),
        "accuracy": sum(r.correct for r in rewards) / n,
        "tool_calls/mean": sum(t.tool_calls for t in trajs) / n,
        "successful_calls/mean": sum(t.successful_calls for t in trajs) / n,
        "turns/mean": sum(t.num_turns for t in trajs) / n,
        "response_length/mean": sum(t.generated_tokens for t in trajs) / n,
        "trajectories": float(len(trajs)),
        "time/rollout_s": batch.rollout_s,
        "time/generation_s": batch.generation_s,
        "time/tools_s": max(0.0, batch.rollout_s - batch.generation_s - batch.reward_s
                            - batch.merge_s),
        "time/reward_s": batch.reward_s,
        "time/merge_s": batch.merge_s,
        "time/train_s": train_s,
    }
    m.update(stop_rates([t.stop_reason for t in trajs]))
    m["train/masked_truncated"] = float(batch.masked)
    m.update(batch.selection.metrics())
    m.update(train_metrics)
    return m


class LiveTable:
    """The per-step table: a rich Live table on a terminal, one aligned line per step in a log."""

    COLUMNS = (("step", "{}"), ("reward", "{:.3f}"), ("acc", "{:.3f}"), ("tools", "{:.2f}"),
               ("turns", "{:.2f}"), ("len", "{:.0f}"), ("kept", "{:.0f}"), ("dropped", "{:.0f}"),
               ("entropy", "{:.3f}"), ("gnorm", "{:.3f}"), ("gen s", "{:.1f}"),
               ("tools s", "{:.1f}"), ("train s", "{:.1f}"), ("val acc", "{:.3f}"))
    WIDTH = 8

    def __init__(self, enabled: bool, total: int) -> None:
        self.enabled, self.total = enabled, total
        self.rows: list[list[str]] = []
        self.live = None
        if enabled and err.is_terminal:
            from rich.live import Live

            self.live = Live(self._table(), console=err, refresh_per_second=4)
            self.live.start()
        elif enabled:
            err.print(" ".join(f"{c:>{self.WIDTH}}" for c, _ in self.COLUMNS), markup=False,
                      soft_wrap=True)

    def _table(self) -> Any:
        from rich.table import Table

        table = Table(title="RL (local engine)", title_justify="left")
        for name, _ in self.COLUMNS:
            table.add_column(name, justify="right")
        for row in self.rows[-40:]:  # the newest steps; the store keeps them all
            table.add_row(*row)
        return table

    def add(self, step: int, m: dict[str, float]) -> None:
        if not self.enabled:
            return
        dropped = sum(v for k, v in m.items() if k.startswith("strategy/dropped_"))
        values = (f"{step + 1}/{self.total}", m["reward/mean"], m["accuracy"], m["tool_calls/mean"],
                  m["turns/mean"], m["response_length/mean"], m["strategy/kept_groups"], dropped,
                  m.get("entropy"), m.get("grad_norm"), m["time/generation_s"], m["time/tools_s"],
                  m["time/train_s"], m.get("val/accuracy"))
        self._show([fmt.format(v) if v is not None else "-"
                    for (_, fmt), v in zip(self.COLUMNS, values)])

    def validation(self, done: int, m: dict[str, float]) -> None:
        """The validation after the last step (it has no training row of its own)."""
        if self.enabled:
            self._show([f"val {done}/{self.total}", *["-"] * (len(self.COLUMNS) - 2),
                        f"{m['val/accuracy']:.3f}"])

    def _show(self, row: list[str]) -> None:
        self.rows.append(row)
        if self.live is not None:
            self.live.update(self._table())
        else:
            err.print(" ".join(f"{c:>{self.WIDTH}}" for c in row), markup=False, soft_wrap=True)

    def close(self) -> None:
        if self.live is not None:
            self.live.stop()
            self.live = None
