"""A recipe as the complete Hydra override list of ``python -m verl.trainer.main_ppo`` (verl 0.9.1).

Every setting the method depends on is written out, even where verl's default already agrees, so
the launch script in the run directory says what ran. Which settings and why:
docs/verl-integration.md ("overrides.py").
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipelines.config.recipe import Recipe
from pipelines.errors import UserError
from pipelines.trackers import verl_tracker_env

REPO_ROOT = Path(__file__).resolve().parents[3]
AGENT_LOOP_NAME = "pyvision_agent"
AGENT_LOOP_CLASS = "pipelines.rl.verl.agent_loop.PyVisionAgentLoop"
REWARD_PATH = "pkg://pipelines.rl.verl.reward"
SAMPLER_PATH = "pkg://pipelines.rl.verl.ranking"
SAMPLER_NAME = "PyVisionReplayBuffer"
_SAFE = re.compile(r"^[A-Za-z0-9_./@+:-]+$")
_NOT_STRINGS = re.compile(r"^([-+]?[0-9._]+([eE][-+]?[0-9]+)?|true|false|null|none|nan|inf)$",
                          re.IGNORECASE)


@dataclass(frozen=True)
class VerlPaths:
    """Where the launcher writes each file of the stage directory ``stage``."""

    stage: Path

    @property
    def data_dir(self) -> Path:
        return self.stage / "data"

    @property
    def train(self) -> Path:
        return self.data_dir / "train.parquet"

    @property
    def val(self) -> Path:
        return self.data_dir / "train_val.parquet"

    @property
    def recipe(self) -> Path:
        return self.stage / "config.yaml"

    @property
    def agent_loop(self) -> Path:
        return self.stage / "agent_loop.yaml"

    @property
    def checkpoints(self) -> Path:
        return self.stage / "checkpoints"

    @property
    def metrics(self) -> Path:
        return self.stage / "verl_metrics.jsonl"

    @property
    def log(self) -> Path:
        return self.stage / "verl.log"

    @property
    def script(self) -> Path:
        return self.stage / "launch.sh"


@dataclass(frozen=True)
class Override:
    key: str
    value: Any
    add: bool = False

    def __str__(self) -> str:
        return f"{'+' if self.add else ''}{self.key}={hydra_value(self.value)}"


def hydra_value(value: Any) -> str:
    """``value`` in Hydra's override grammar (strings quoted only when they need it)."""
    if isinstance(value, bool):
        return "True" if value else "False"
    if value is None:
        return "null"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(hydra_value(v) for v in value) + "]"
    if isinstance(value, dict):  # keys are identifiers (rl.optimizer.args checks them)
        return "{" + ",".join(f"{k}:{hydra_value(v)}" for k, v in value.items()) + "}"
    text = str(value)
    if _SAFE.match(text) and not _NOT_STRINGS.match(text):
        return text
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'").replace("${", "\\${") + "'"


def gen_batch_size(prompts_per_step: int, oversample_factor: float) -> int:
    """The dataloader fetch size: divides the batch and the oversampled extra prompts."""
    extra = math.ceil(oversample_factor * prompts_per_step) - prompts_per_step
    return math.gcd(prompts_per_step, extra) if extra > 0 else prompts_per_step


# verl's code-temperature refusal, worded once (the agent loop raises it too); kept here so that
# composing the overrides needs no verl import.
CODE_TEMPERATURE_UNSUPPORTED = (
    "agent.code_temperature is not supported by the verl engine: vLLM/SGLang sample a request at "
    "one temperature and verl's actor rescales every logit of a batch by "
    "actor_rollout_ref.rollout.temperature, so tokens inside <code> could be sampled at another "
    "temperature but not trained under it")
# peft regex (full match) of the modules LoRA must leave alone: the vision tower.
LORA_EXCLUDE = ".*visual.*"


def lora_overrides(recipe: Recipe) -> list[Override]:
    """verl's FSDP LoRA settings for ``rl.lora`` (none when it is off)."""
    lora = recipe.rl.lora
    if not lora.enabled:
        return []
    return [
        Override("actor_rollout_ref.model.lora_rank", lora.rank),
        Override("actor_rollout_ref.model.lora_alpha", lora.alpha),
        Override("actor_rollout_ref.model.target_modules", list(lora.target_modules)),
        Override("actor_rollout_ref.model.exclude_modules", LORA_EXCLUDE),
        Override("actor_rollout_ref.rollout.load_format", "safetensors"),
        Override("actor_rollout_ref.rollout.layered_summon", True),
        # rl.lora.merge_for_rollout: vLLM samples from weights with the adapter merged in
        # (verl merges at each weight sync) instead of applying it with its LoRA kernels.
        Override("actor_rollout_ref.model.lora.merge", lora.merge_for_rollout),
    ]


def render(recipe: Recipe, *, model: str, paths: VerlPaths, has_val: bool,
           resume: bool) -> list[Override]:
    """The overrides as (key, value) pairs; what and why: docs/verl-integration.md."""
    rl, agent, verl, algo = recipe.rl, recipe.agent, recipe.rl.verl, recipe.rl.algorithm
    if agent.code_temperature is not None:
        raise UserError(CODE_TEMPERATURE_UNSUPPORTED,
                        hint="unset agent.code_temperature (--set agent.code_temperature=null), "
                             "or train with --engine local, which samples and trains each token "
                             "at its own temperature")
    test_freq = verl.test_freq if has_val else -1
    tokens = rl.max_prompt_tokens + rl.max_response_tokens
    strategy = rl.strategy.model_dump()
    env = {"PYTHONPATH": str(REPO_ROOT), "VERL_FILE_LOGGER_PATH": str(paths.metrics),
           "PYVISION_VERL_RECIPE": str(paths.recipe),
           **verl_tracker_env(recipe, paths.stage.parent.name, paths.stage.parent.parent)}
    out = [
        # algorithm: GRPO without std normalisation, no in-reward KL, no DAPO filter (ours ranks)
        Override("algorithm.adv_estimator", "grpo"),
        Override("algorithm.norm_adv_by_std_in_grpo", algo.norm_adv_by_std),
        Override("algorithm.use_kl_in_reward", False),
        Override("algorithm.kl_ctrl.kl_coef", algo.kl_coef),
        Override("algorithm.filter_groups.enable", False),
        # data
        Override("data.train_files", str(paths.train)),
        Override("data.val_files", str(paths.val if has_val else paths.train)),
        Override("data.train_batch_size", rl.prompts_per_step),
        Override("data.gen_batch_size", gen_batch_size(rl.prompts_per_step,
                                                       rl.strategy.oversample_factor)),
        Override("data.max_prompt_length", rl.max_prompt_tokens),
        Override("data.max_response_length", rl.max_response_tokens),
        Override("data.filter_overlong_prompts", True),
        Override("data.truncation", "error"),
        Override("data.return_raw_chat", True),
        Override("data.shuffle", True),
        Override("data.seed", recipe.seed),
        # model and actor
        Override("actor_rollout_ref.model.path", model),
        Override("actor_rollout_ref.model.use_remove_padding", True),
        Override("actor_rollout_ref.model.enable_gradient_checkpointing", True),
        Override("actor_rollout_ref.actor.optim.optimizer", rl.optimizer.name),
        Override("actor_rollout_ref.actor.optim.optimizer_impl", rl.optimizer.impl),
        Override("actor_rollout_ref.actor.optim.override_optimizer_config",
                 dict(rl.optimizer.args) or None),
        Override("actor_rollout_ref.actor.optim.lr", rl.learning_rate),
        Override("actor_rollout_ref.actor.optim.lr_scheduler_type", "constant"),
        Override("actor_rollout_ref.actor.optim.lr_warmup_steps_ratio", rl.lr_warmup_steps_ratio),
        Override("actor_rollout_ref.actor.optim.weight_decay", rl.optimizer.weight_decay),
        Override("actor_rollout_ref.actor.optim.clip_grad", rl.optimizer.grad_clip),
        Override("actor_rollout_ref.actor.ppo_mini_batch_size", rl.mini_batch_prompts),
        Override("actor_rollout_ref.actor.ppo_epochs", 1),
        Override("actor_rollout_ref.actor.use_dynamic_bsz", True),
        Override("actor_rollout_ref.actor.ppo_max_token_len_per_gpu", tokens),
        Override("actor_rollout_ref.actor.clip_ratio_low", algo.clip_ratio_low),
        Override("actor_rollout_ref.actor.clip_ratio_high", algo.clip_ratio_high),
        Override("actor_rollout_ref.actor.loss_agg_mode", algo.loss_agg_mode),
        Override("actor_rollout_ref.actor.use_kl_loss", algo.kl_coef > 0),
        Override("actor_rollout_ref.actor.kl_loss_coef", algo.kl_coef),
        Override("actor_rollout_ref.actor.entropy_coeff", algo.entropy_coef),
        Override("actor_rollout_ref.actor.freeze_vision_tower", rl.freeze_vision_tower),
        *lora_overrides(recipe),
        # rollout: multi-turn agent loop on vLLM/SGLang servers
        Override("actor_rollout_ref.rollout.name", verl.rollout_name),
        Override("actor_rollout_ref.rollout.mode", "async"),
        Override("actor_rollout_ref.rollout.n", rl.n),
        Override("actor_rollout_ref.rollout.temperature", agent.temperature),
        Override("actor_rollout_ref.rollout.top_p", agent.top_p),
        Override("actor_rollout_ref.rollout.seed", recipe.seed),
        Override("actor_rollout_ref.rollout.tensor_model_parallel_size",
                 verl.tensor_model_parallel_size),
        Override("actor_rollout_ref.rollout.gpu_memory_utilization", verl.gpu_memory_utilization),
        Override("actor_rollout_ref.rollout.max_model_len", agent.max_context_tokens),
        Override("actor_rollout_ref.rollout.limit_images", agent.max_images, add=True),
        Override("actor_rollout_ref.rollout.val_kwargs.temperature", agent.eval_temperature),
        Override("actor_rollout_ref.rollout.val_kwargs.do_sample", agent.eval_temperature > 0),
        Override("actor_rollout_ref.rollout.val_kwargs.n", 1),
        Override("actor_rollout_ref.rollout.multi_turn.enable", True),
        Override("actor_rollout_ref.rollout.multi_turn.max_assistant_turns", agent.max_turns_train),
        Override("actor_rollout_ref.rollout.agent.default_agent_loop", AGENT_LOOP_NAME),
        Override("actor_rollout_ref.rollout.agent.agent_loop_config_path", str(paths.agent_loop)),
        # reward
        Override("reward.reward_manager.name", "naive"),
        Override("reward.custom_reward_function.path", REWARD_PATH),
        Override("reward.custom_reward_function.name", "compute_score"),
        Override("reward.custom_reward_function.reward_kwargs.recipe", str(paths.recipe), add=True),
        # trainer: v1, sync, our sampler
        Override("trainer.use_v1", True),
        Override("trainer.v1.trainer_mode", "sync"),
        Override("trainer.v1.sampler.custom_sampler.path", SAMPLER_PATH),
        Override("trainer.v1.sampler.custom_sampler.name", SAMPLER_NAME),
        *[Override(f"trainer.v1.sampler.sampler_kwargs.{k}", v, add=True)
          for k, v in strategy.items()],
        Override("trainer.v1.sampler.sampler_kwargs.gen_batch_size",
                 gen_batch_size(rl.prompts_per_step, rl.strategy.oversample_factor), add=True),
        Override("trainer.nnodes", verl.nnodes),
        Override("trainer.n_gpus_per_node", verl.gpus_per_node),
        Override("trainer.total_epochs", verl.total_epochs),
        Override("trainer.save_freq", verl.save_freq),
        Override("trainer.test_freq", test_freq),
        Override("trainer.val_before_train", test_freq > 0),
        Override("trainer.project_name", recipe.report.wandb_project),
        Override("trainer.experiment_name", paths.stage.parent.name),
        # verl's own trackers, in the folders the local engine's write to (pipelines/trackers.py)
        Override("trainer.logger", ["console", "file", *recipe.report.trackers]),
        Override("trainer.default_local_dir", str(paths.checkpoints)),
        Override("trainer.resume_mode", "auto" if resume else "disable"),
        *[Override(f"ray_kwargs.ray_init.runtime_env.env_vars.{k}", v, add=True)
          for k, v in env.items()],
    ]
    return out


def render_overrides(recipe: Recipe, *, model: str, paths: VerlPaths, has_val: bool,
                     resume: bool) -> list[str]:
    """The command-line overrides, ``rl.verl.extra_overrides`` last."""
    return [str(o) for o in render(recipe, model=model, paths=paths, has_val=has_val,
                                   resume=resume)] + list(recipe.rl.verl.extra_overrides)
