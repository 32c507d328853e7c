"""GRPO advantages, the PPO-clip loss and KL, computed by verl's own ``core_algos``.

The local engine calls these wrappers so that it computes exactly what verl computes at scale:
the advantage is ``verl.trainer.ppo.core_algos.compute_grpo_outcome_advantage`` (``norm_by_std``
False by default, as in the paper: A = r - mean(group)), the loss is
``compute_policy_loss_vanilla`` (PPO clip with separate low/high ratios and dual clip) aggregated by
``agg_loss`` over model-generated tokens only, and the KL is ``kl_penalty``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pipelines.config.rl import AlgorithmConfig


def grpo_advantages(rewards: Sequence[float], group_index: Sequence[Any], response_mask: Any,
                    norm_by_std: bool = False) -> Any:
    """Token-level advantages ``[B, T]`` (each response's scalar advantage on its tokens)."""
    import numpy as np
    import torch
    from verl.trainer.ppo.core_algos import compute_grpo_outcome_advantage

    mask = response_mask.float()
    scores = torch.zeros_like(mask)
    last = (mask.cumsum(-1) == mask.sum(-1, keepdim=True)) & (mask > 0)
    # One scalar per response, placed on its last token (verl sums over tokens).
    first_last = last & (last.cumsum(-1) == 1)
    scores[first_last] = torch.tensor(list(rewards), dtype=scores.dtype,
                                     device=scores.device)[first_last.any(-1)]
    advantages, _ = compute_grpo_outcome_advantage(
        token_level_rewards=scores, response_mask=mask,
        index=np.array([str(g) for g in group_index], dtype=object),
        norm_adv_by_std_in_grpo=norm_by_std)
    return advantages


def _actor_config(cfg: AlgorithmConfig, batch_num_tokens: int | None, global_batch_size: int | None):
    from omegaconf import OmegaConf

    info = {"dp_size": 1}
    if batch_num_tokens is not None:
        info["batch_num_tokens"] = batch_num_tokens
    if global_batch_size is not None:
        info["global_batch_size"] = global_batch_size
    return OmegaConf.create({"clip_ratio": cfg.clip_ratio_low, "clip_ratio_low": cfg.clip_ratio_low,
                             "clip_ratio_high": cfg.clip_ratio_high, "clip_ratio_c": 3.0,
                             "global_batch_info": info})


def policy_loss(old_logprobs: Any, logprobs: Any, advantages: Any, response_mask: Any,
                cfg: AlgorithmConfig, *, batch_num_tokens: int | None = None,
                global_batch_size: int | None = None) -> tuple[Any, dict[str, float]]:
    """PPO-clip loss over model tokens. ``batch_num_tokens``/``global_batch_size`` normalise
    micro-batches against their whole mini-batch (so gradient accumulation equals one big step)."""
    from verl.trainer.ppo.core_algos import compute_policy_loss_vanilla

    loss, metrics = compute_policy_loss_vanilla(
        old_log_prob=old_logprobs, log_prob=logprobs, advantages=advantages,
        response_mask=response_mask, loss_agg_mode=cfg.loss_agg_mode,
        config=_actor_config(cfg, batch_num_tokens, global_batch_size))
    return loss, {k.replace("actor/", ""): float(v) for k, v in metrics.items()}


def kl_loss(logprobs: Any, ref_logprobs: Any, response_mask: Any, cfg: AlgorithmConfig,
            kind: str = "low_var_kl", *, batch_num_tokens: int | None = None) -> Any:
    """KL to the reference policy, aggregated like the policy loss."""
    from verl.trainer.ppo.core_algos import agg_loss, kl_penalty

    kl = kl_penalty(logprobs, ref_logprobs, kind)
    kw = {"batch_num_tokens": batch_num_tokens} if batch_num_tokens is not None else {}
    return agg_loss(kl, response_mask, cfg.loss_agg_mode, **kw)


def entropy_loss(entropy: Any, response_mask: Any, cfg: AlgorithmConfig, *,
                 batch_num_tokens: int | None = None) -> Any:
    from verl.trainer.ppo.core_algos import agg_loss

    kw = {"batch_num_tokens": batch_num_tokens} if batch_num_tokens is not None else {}
    return agg_loss(entropy, response_mask, cfg.loss_agg_mode, **kw)
