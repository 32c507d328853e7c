"""Policies behind the agent loop: local transformers, OpenAI-compatible servers, scripted."""

from __future__ import annotations

from typing import Any

from pipelines.agent.policies.base import Generation, Policy, Sampling

__all__ = ["Generation", "Policy", "Sampling", "make_policy"]


def make_policy(model: str, *, engine: str = "auto", served_model: str | None = None,
                agent_cfg: Any = None, device: str = "auto", dtype: str = "auto",
                concurrency: int = 8) -> Policy:
    """A policy for ``model``: an http(s) URL -> OpenAI-compatible client, else transformers."""
    from pipelines.config.agent import AgentConfig

    cfg = agent_cfg or AgentConfig()
    if engine == "openai" or (engine == "auto" and model.startswith(("http://", "https://"))):
        from pipelines.agent.policies.openai import OpenAIPolicy

        return OpenAIPolicy(model, served_model or "default", concurrency=concurrency,
                            image_min_pixels=cfg.image_min_pixels,
                            image_max_pixels=cfg.image_max_pixels)
    if engine == "vllm":
        from pipelines.agent.policies.vllm import VLLMPolicy

        return VLLMPolicy(model, agent_cfg=cfg)
    from pipelines.agent.policies.hf import HFPolicy

    return HFPolicy.from_pretrained(model, device=device, dtype=dtype,
                                    image_min_pixels=cfg.image_min_pixels,
                                    image_max_pixels=cfg.image_max_pixels)
