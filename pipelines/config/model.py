"""Which model a recipe starts from."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from pipelines.config.base import Section


class TinyModelConfig(Section):
    """Build a tiny, randomly initialised Qwen2.5-VL offline instead of downloading one."""

    size: Literal["nano", "small"] = "small"
    """`nano` (a few MB, unit tests) or `small` (a few million parameters, learns the synthetic
    tasks on CPU in minutes)."""

    seed: int = Field(0, ge=0, le=2**31 - 1)
    """Seed for the tokenizer corpus order and the weight initialisation."""


class ModelConfig(Section):
    """The base model: a local path or a Hugging Face hub id, or a tiny model built locally."""

    base: str = "Qwen/Qwen2.5-VL-7B-Instruct"
    """Local directory or hub id of the base Qwen2.5-VL checkpoint (ignored when `tiny` is set)."""

    tiny: TinyModelConfig | None = None
    """When set, `pyvision run` builds a tiny model into the run directory and uses it as base."""

    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Weights dtype for local inference and training; `auto` is float32 on CPU, bfloat16 on GPU."""

    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Device for local inference and the local RL engine; `auto` picks cuda when available."""
