"""The PPO-clip loss, the KL and the entropy term, computed by verl's own ``core_algos``.

The local engine calls these wrappers so that it computes exactly what verl computes at scale:
the loss is ``compute_policy_loss_vanilla`` (PPO clip with separate low/high ratios and dual
clip) aggregated by ``agg_loss`` over model-generated tokens only, and the KL is ``kl_penalty``.
The GRPO advantage lives with the rollout strategy (:meth:`pipelines.rl.strategy.Group.advantages`,
on whole groups before filtering); a test checks it against verl's
``compute_grpo_outcome_advantage``.
"""

from __future__ import annotations

from typing import Any

from pipelines.config.rl import AlgorithmConfig, RLConfig
from pipelines.errors import ConfigError


def build_optimizer(params: list[Any], rl: RLConfig) -> Any:
    """``rl.optimizer`` over ``params``, built by verl's own ``build_optimizer`` (what its FSDP
    actor does with ``actor.optim``); a class that cannot be built is a config error."""
    from verl.workers.config.optimizer import FSDPOptimizerConfig
    from verl.workers.config.optimizer import build_optimizer as verl_build

    opt = rl.optimizer
    cfg = FSDPOptimizerConfig(lr=rl.learning_rate, weight_decay=opt.weight_decay, optimizer=opt.name,
                              optimizer_impl=opt.impl,
                              override_optimizer_config=dict(opt.args) or None)
    try:
        return verl_build(params, cfg)
    except (ImportError, AttributeError, TypeError, ValueError) as e:
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ConfigError(f"rl.optimizer: cannot build {opt.impl}.{opt.name} with args "
                          f"{dict(opt.args)}: {first}",
                          hint="name a class of that module and only arguments it takes "
                               "(e.g. rl.optimizer.name=SGD, rl.optimizer.args={momentum: 0.9})"
                          ) from e


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
