"""Reinforcement learning: the PyVision rollout strategy, GRPO, and the two engines."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from pipelines.config.base import Section


class StrategyConfig(Section):
    """Oversample, filter, rank (the PyVision rollout strategy). Each part can be switched off."""

    oversample_factor: float = Field(2.0, ge=1.0, le=64.0)
    """Groups generated per step = ceil(factor x prompts_per_step)."""

    filter_zero_variance: bool = True
    """Drop groups whose rewards are all equal (they carry no GRPO signal)."""

    zero_variance_basis: Literal["reward", "accuracy"] = "reward"
    """What the zero-variance filter compares: `reward` (the shaped reward GRPO trains on, so
    a group that differs only in tool or format terms is kept) or `accuracy` (whether each
    answer was right, so such a group is dropped). Either way the step also logs how many groups
    each basis would keep (`strategy/groups_varying_reward`, `strategy/groups_varying_accuracy`)."""

    filter_broken: bool = True
    """Drop trajectories that ended in context overflow, the image limit, or malformed output."""

    filter_no_image: bool = False
    """Also drop trajectories that never produced an image in any observation."""

    rank_by_std: bool = True
    """Keep the groups with the highest reward std (ties broken by prompt index); off: keep the
    first groups in generation order."""

    max_rounds: int = Field(3, ge=1, le=100)
    """Generation rounds per step before training on whatever survived the filters: bounds the
    cost of a step whose groups nearly all have zero variance (both engines)."""


class AlgorithmConfig(Section):
    """GRPO advantage and PPO-clip loss."""

    norm_adv_by_std: bool = False
    """Divide advantages by the group std (paper: off, A = r - mean)."""

    clip_ratio_low: float = Field(0.2, ge=0.0, le=10.0)
    """PPO clip epsilon below 1."""

    clip_ratio_high: float = Field(0.2, ge=0.0, le=10.0)
    """PPO clip epsilon above 1 (DAPO clip-higher uses 0.28)."""

    loss_agg_mode: Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean",
                           "seq-mean-token-sum-norm"] = "token-mean"
    """How token losses are aggregated (verl's names; paper: token-mean)."""

    kl_coef: float = Field(0.0, ge=0.0, le=10.0)
    """KL penalty to the reference policy (0: no reference model, as in the paper)."""

    entropy_coef: float = Field(0.0, ge=0.0, le=1.0)
    """Entropy bonus coefficient (paper: 0)."""


class LocalEngineConfig(Section):
    """The single-process engine (CPU or one GPU) used by the embedded default."""

    steps: int = Field(20, ge=1, le=1_000_000)
    """Training steps."""

    ppo_epochs: int = Field(1, ge=1, le=100)
    """Passes over each step's batch."""

    mini_batch_groups: int = Field(4, ge=1, le=100_000)
    """Groups per optimiser update within a step."""

    save_every: int = Field(10, ge=1, le=1_000_000)
    """Checkpoint every N steps (HF weights + optimizer + RNG state)."""

    threads: int = Field(0, ge=0, le=1024)
    """torch CPU threads (0: torch's default)."""

    test_freq: int = Field(-1, ge=-1, le=1_000_000)
    """Validate every N steps, before the first and after the last, as verl's
    `trainer.test_freq` (with `val_before_train`): greedy trajectories on `rl.val_tasks`, scored
    by the reward's verifiers, logged as `val/*` step metrics (per data source too). -1 (the
    default) disables it."""


class VerlEngineConfig(Section):
    """Launch settings of verl (Ray, FSDP, vLLM rollouts)."""

    python: str = "python"
    """Interpreter of the environment that has `verl[vllm]`."""

    ray_address: str | None = None
    """Ray cluster address (`auto`, `ray://head:10001`); None starts a local Ray."""

    nnodes: int = Field(1, ge=1, le=4096)
    """Nodes in the Ray cluster."""

    gpus_per_node: int = Field(8, ge=1, le=64)
    """GPUs per node."""

    rollout_name: Literal["vllm", "sglang"] = "vllm"
    """verl rollout backend."""

    gpu_memory_utilization: float = Field(0.6, gt=0.0, le=1.0)
    """Fraction of GPU memory the rollout engine may use."""

    tensor_model_parallel_size: int = Field(1, ge=1, le=64)
    """Rollout tensor parallelism."""

    total_epochs: int = Field(5, ge=1, le=10_000)
    """Epochs over the RL data (paper: 5)."""

    save_freq: int = Field(10, ge=1, le=1_000_000)
    """Checkpoint every N steps (paper: 10)."""

    test_freq: int = Field(20, ge=-1, le=1_000_000)
    """Validate every N steps (paper: 20; -1 disables)."""

    extra_overrides: list[str] = []
    """Hydra overrides appended verbatim (`key=value`), for settings not modelled here."""


class LoraRLConfig(Section):
    """LoRA adapters for RL on one GPU (`rank: 0` trains every weight)."""

    rank: int = Field(0, ge=0, le=1024)
    """Adapter rank; 0 switches LoRA off."""

    alpha: int = Field(16, ge=1, le=4096)
    """LoRA scaling numerator (the update is scaled by alpha / rank)."""

    dropout: float = Field(0.0, ge=0.0, le=0.9)
    """Dropout on the adapter's input (local engine; verl's FSDP LoRA has none)."""

    target_modules: list[str] = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                 "down_proj"]
    """Linear layers of the language model that get adapters (module name suffixes); the vision
    tower never does."""

    merge_for_rollout: bool = True
    """Local engine: fold the adapters into their base weights while rolling out, so each decode
    step runs one matrix product per projection instead of three (at Qwen2.5-VL-7B's shapes on
    an H200, generation ran 2.3x slower with the adapters unmerged: docs/gpu-check.md). The base
    weights are restored bit for bit afterwards, from a copy kept in host memory (one copy of
    the adapted weights). verl: `actor_rollout_ref.model.lora.merge`, so vLLM gets the merged
    weights at each sync instead of applying the adapter with its own LoRA kernels (verl's
    default); verl's note: faster inference, longer weight syncs."""

    @property
    def enabled(self) -> bool:
        return self.rank > 0


class OptimizerConfig(Section):
    """The actor's optimizer, built the way verl builds it in both engines: the class ``name``
    from the module ``impl``, with the stage's learning rate and ``weight_decay`` (and the betas
    of an Adam-like class), then ``args`` on top (verl's ``actor.optim.optimizer``,
    ``optimizer_impl``, ``weight_decay`` and ``override_optimizer_config``); gradients are
    clipped to ``grad_clip`` first (``actor.optim.clip_grad``)."""

    name: str = Field("AdamW", pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")
    """Optimizer class (paper: AdamW; e.g. `SGD`, or `AdamW8bit` with `bitsandbytes.optim`)."""

    impl: str = Field("torch.optim", pattern=r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")
    """Module the class is imported from (`torch.optim`, `torchao.optim`, `bitsandbytes.optim`)."""

    args: dict[str, bool | int | float | str] = {}
    """Keyword arguments passed to the class over the defaults (e.g. `{momentum: 0.9}`)."""

    weight_decay: float = Field(0.01, ge=0.0, le=1.0)
    """Weight decay (paper: 0.01)."""

    grad_clip: float = Field(1.0, gt=0.0, le=1000.0)
    """Gradient-norm clip before each optimizer step (paper: 1.0)."""

    @field_validator("args")
    @classmethod
    def _argument_names(cls, args: dict[str, Any]) -> dict[str, Any]:
        bad = [k for k in args if not k.isidentifier()]
        if bad:
            raise ValueError(f"optimizer argument names must be Python identifiers, got {bad}")
        return args


class RLConfig(Section):
    """RL stage settings shared by both engines."""

    engine: Literal["local", "verl"] = "local"
    """`local`: one process (CPU or one GPU); `verl`: Ray + FSDP + vLLM."""

    prompts_per_step: int = Field(64, ge=1, le=1_000_000)
    """Prompts (groups) in one training batch (paper: 64)."""

    n: int = Field(8, ge=2, le=1024)
    """Rollouts per prompt, the GRPO group size (paper: 8)."""

    learning_rate: float = Field(1e-6, gt=0.0, le=1.0)
    """Constant learning rate (paper: 1e-6)."""

    lr_warmup_steps_ratio: float = Field(0.0, ge=0.0, le=1.0)
    """verl's linear warm-up: the rate rises from 0 over the first ``int(ratio x steps)`` RL
    steps (step k at ``k / warm-up steps`` of it), then stays (paper: 0, no warm-up)."""

    optimizer: OptimizerConfig = OptimizerConfig()
    """The optimizer (paper: AdamW)."""

    mini_batch_prompts: int = Field(16, ge=1, le=1_000_000)
    """Prompts per PPO mini-batch (paper: 16, i.e. 4 updates per step)."""

    max_prompt_tokens: int = Field(16384, ge=64, le=1_048_576)
    """Longest prompt (question + initial images) in tokens."""

    max_response_tokens: int = Field(16384, ge=64, le=1_048_576)
    """Longest response (all turns, observations included) in tokens."""

    freeze_vision_tower: bool = True
    """Keep the ViT frozen (paper default)."""

    val_tasks: list[str] = []
    """Task folders both engines validate on (every `rl.local.test_freq` or `rl.verl.test_freq`
    steps); empty: the data stage's held-out synthetic sets, and without any, validation is
    off."""

    mask_truncated: bool = False
    """Over-turn masking (Mini-o3): trajectories stopped by the turn limit or the context /
    response limit contribute no loss (their tokens are masked), so the policy is not pushed to
    answer early just because long explorations were cut; they still count in their group's
    mean reward."""

    lora: LoraRLConfig = LoraRLConfig()
    """LoRA RL: the local engine trains peft adapters (merged into the final model by the merge
    stage, or `pyvision merge --lora`); verl gets its FSDP LoRA settings."""

    strategy: StrategyConfig = StrategyConfig()
    """Oversample, filter, rank."""

    algorithm: AlgorithmConfig = AlgorithmConfig()
    """Advantage and loss."""

    local: LocalEngineConfig = LocalEngineConfig()
    """Settings of the local engine."""

    verl: VerlEngineConfig = VerlEngineConfig()
    """Settings of the verl engine."""

    @model_validator(mode="after")
    def _mini_batch_fits(self) -> RLConfig:
        if self.mini_batch_prompts > self.prompts_per_step:
            raise ValueError(
                f"mini_batch_prompts ({self.mini_batch_prompts}) must be <= prompts_per_step "
                f"({self.prompts_per_step})")
        return self
