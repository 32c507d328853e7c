"""Which model a recipe starts from."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from pipelines.config.base import Section


class PretrainConfig(Section):
    """Pretraining of the tiny base on the generated curriculum (`pyvision model pretrain`)."""

    steps: int = Field(2700, ge=1, le=10_000_000)
    """Optimiser steps (the induction phase included)."""

    induction_steps: int = Field(900, ge=0, le=10_000_000)
    """First steps on copies of random token spans only: copying by content (induction heads)
    forms after 400-900 such steps on the small model, not when copying is a fifth of a mixed
    stream from the start."""

    batch_size: int = Field(32, ge=1, le=4096)
    """Examples per step."""

    learning_rate: float = Field(1e-3, gt=0.0, le=1.0)
    """Peak learning rate (AdamW, betas 0.9 / 0.95)."""

    warmup_steps: int = Field(100, ge=1, le=1_000_000)
    """Linear warm-up steps before the cosine decay."""

    min_lr_ratio: float = Field(0.1, ge=0.0, le=1.0)
    """The cosine decays to this fraction of the peak learning rate."""

    weight_decay: float = Field(0.01, ge=0.0, le=1.0)
    """AdamW weight decay."""

    grad_clip: float = Field(1.0, gt=0.0, le=1000.0)
    """Gradient-norm clip."""

    max_tokens: int = Field(160, ge=32, le=65536)
    """Text-only examples are cut to this many tokens."""

    mixture: dict[Literal["copy", "lookup", "readback", "colour_code", "python", "image_text",
                          "table_code"], float] = {
        "copy": 0.2, "lookup": 0.15, "readback": 0.15, "colour_code": 0.15, "python": 0.1,
        "image_text": 0.25}
    """Share of each curriculum family in the stream (`pipelines/models/curriculum.py`)."""

    context_share: float = Field(0.0, ge=0.0, le=1.0)
    """Share of the copy, lookup, colour_code and table_code text examples that start after a
    context (instruction lines, spans, Python), so a look-up works a few hundred tokens into a
    prompt, not only at its start. 0 keeps every example the shipped base was pretrained on."""

    init: str | None = None
    """A model folder to continue pretraining (its weights and tokenizer) instead of random
    weights: continued pretraining. The manifest records its files' sha256 and its own manifest."""

    log_every: int = Field(25, ge=1, le=1_000_000)
    """Steps between metric rows in the store."""

    save_every: int = Field(500, ge=1, le=1_000_000)
    """Checkpoint every N steps (weights, optimizer, RNG state) for `--resume`."""

    threads: int = Field(1, ge=0, le=1024)
    """torch CPU threads (0: torch's default). One thread is as fast on a busy machine and its
    result does not depend on how many cores the machine has."""


class TinyModelConfig(Section):
    """Use a tiny Qwen2.5-VL made offline by the project instead of downloading one."""

    size: Literal["nano", "small"] = "small"
    """`nano` (a few MB, unit tests) or `small` (a few million parameters, learns the synthetic
    tasks on CPU in minutes)."""

    seed: int = Field(0, ge=0, le=2**31 - 1)
    """Seed for the tokenizer corpus, the weight initialisation and the pretraining stream."""

    init: Literal["pretrained", "pretrain", "random"] = "random"
    """`pretrained`: the base shipped in `pipelines/models/weights/` (made by `pyvision model
    pretrain`); `pretrain`: pretrain one in the data stage (`model.pretrain`); `random`: random
    weights with a tokenizer trained on the run's own trajectories (no pretraining)."""


class ModelConfig(Section):
    """The base model: a local path or a Hugging Face hub id, or a tiny model built locally."""

    base: str = "Qwen/Qwen2.5-VL-7B-Instruct"
    """Local directory or hub id of the base Qwen2.5-VL checkpoint (ignored when `tiny` is set)."""

    tiny: TinyModelConfig | None = None
    """When set, `pyvision run` builds a tiny model into the run directory and uses it as base."""

    pretrain: PretrainConfig = PretrainConfig()
    """How `pyvision model pretrain` (and `tiny.init: pretrain`) pretrains the tiny base."""

    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Weights dtype for local inference and training; `auto` is float32 on CPU, bfloat16 on GPU."""

    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Device for local inference and the local RL engine; `auto` picks cuda when available."""
