"""Supervised fine-tuning on LLaMA-Factory."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from pipelines.config.base import Section


class LoraConfig(Section):
    """LoRA adapter settings (used when `finetuning_type: lora`)."""

    rank: int = Field(8, ge=1, le=1024)
    """LoRA rank (width of the low-rank update)."""

    alpha: int = Field(16, ge=1, le=4096)
    """LoRA alpha (scaling = alpha / rank)."""

    dropout: float = Field(0.0, ge=0.0, lt=1.0)
    """Dropout on the LoRA branch."""

    target: str = "all"
    """Modules to adapt (`all` or a comma-separated list of module names)."""


class SFTConfig(Section):
    """Settings rendered into LLaMA-Factory's training YAML."""

    python: str = "python"
    """Interpreter that runs LLaMA-Factory (`python` = the one running pyvision); on a cluster
    point it at LLaMA-Factory's own environment."""

    finetuning_type: Literal["full", "lora", "freeze"] = "full"
    """Full fine-tuning, LoRA, or LLaMA-Factory's `freeze` (train the last layers only)."""

    lora: LoraConfig = LoraConfig()
    """LoRA settings, used with `finetuning_type: lora`."""

    freeze_vision_tower: bool = True
    """Keep the ViT frozen (paper default)."""

    freeze_multi_modal_projector: bool = False
    """Keep the vision-language merger frozen."""

    template: str = "qwen2_vl"
    """LLaMA-Factory chat template (qwen2_vl covers Qwen2.5-VL)."""

    cutoff_len: int = Field(32768, ge=64, le=1_048_576)
    """Truncate training sequences to this many tokens."""

    image_max_pixels: int = Field(2_000_000, ge=784, le=100_000_000)
    """Largest image size in pixels seen in training."""

    image_min_pixels: int = Field(3136, ge=784, le=100_000_000)
    """Smallest image size in pixels seen in training."""

    video_max_pixels: int = Field(65536, ge=784, le=100_000_000)
    """Largest video frame size in pixels seen in training."""

    video_fps: float = Field(2.0, gt=0.0, le=120.0)
    """Frames per second sampled from training videos."""

    video_maxlen: int = Field(64, ge=1, le=4096)
    """Most frames sampled from one training video."""

    per_device_train_batch_size: int = Field(1, ge=1, le=4096)
    """Micro-batch size per device."""

    gradient_accumulation_steps: int = Field(8, ge=1, le=4096)
    """Micro-batches accumulated per optimiser step."""

    learning_rate: float = Field(1e-5, gt=0.0, le=1.0)
    """Peak learning rate."""

    lr_scheduler_type: Literal["cosine", "linear", "constant", "constant_with_warmup"] = "cosine"
    """Learning-rate schedule."""

    warmup_ratio: float = Field(0.05, ge=0.0, le=1.0)
    """Fraction of steps used for linear warm-up."""

    num_train_epochs: float = Field(1.0, gt=0.0, le=1000.0)
    """Epochs over the SFT data."""

    max_steps: int = Field(-1, ge=-1, le=10_000_000)
    """Stop after this many optimiser steps (-1: run all epochs)."""

    precision: Literal["bf16", "fp16", "fp32"] = "bf16"
    """Training precision; `fp32` on CPU."""

    use_cpu: bool = False
    """Train on CPU (the embedded default)."""

    gradient_checkpointing: bool = True
    """Recompute activations in the backward pass to save memory (LLaMA-Factory's default); a
    tiny model on CPU trains about 1.3x faster without it."""

    deepspeed: Literal["none", "z2", "z3", "z3_offload"] = "none"
    """DeepSpeed ZeRO config for several GPUs (LLaMA-Factory's bundled configs)."""

    logging_steps: int = Field(1, ge=1, le=100_000)
    """Log loss every N steps (each log line is stored as a metric)."""

    save_steps: int = Field(500, ge=1, le=10_000_000)
    """Save a checkpoint every N steps (what `--resume` continues from)."""

    seed: int = Field(0, ge=0, le=2**31 - 1)
    """Trainer seed; in a recipe it defaults to the recipe's global `seed`."""

    extra: dict[str, str | int | float | bool] = {}
    """Extra LLaMA-Factory keys passed through verbatim (for options not modelled here)."""
