"""Evaluation on benchmarks through the agent loop."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from pipelines.config.base import Section
from pipelines.config.client import ClientConfig


class EvalConfig(Section):
    """Which benchmarks to run and how."""

    benchmarks: list[str] = ["vstar", "hrbench4k", "hrbench8k", "mathverse", "vsibench"]
    """Benchmark names (see `pyvision eval --help`); `synth-image` / `synth-video` are the
    held-out synthetic sets."""

    engine: Literal["hf", "openai", "vllm"] = "hf"
    """`hf`: transformers in-process; `openai`: any OpenAI-compatible server; `vllm`: vLLM
    in-process."""

    base_url: str | None = None
    """Endpoint for `engine: openai`."""

    data_dir: str | None = None
    """Directory holding local copies of the benchmarks in their published layout."""

    limit: int | None = Field(None, ge=1, le=10_000_000)
    """Evaluate only the first N samples of each benchmark."""

    concurrency: int = Field(8, ge=1, le=4096)
    """Trajectories in flight at once for remote engines."""

    batch_size: int = Field(8, ge=1, le=4096)
    """Trajectories advanced together by the in-process engines."""

    commit_interval_s: float = Field(1.0, ge=0.0, le=3600.0)
    """Finished samples are committed to the store together, at most this many seconds after the
    first of them finished: what an interrupted evaluation can lose (0: every sample at once)."""

    client: ClientConfig = ClientConfig()
    """How `engine: openai` talks to its server: server kind, per-request timeout, retries."""
