"""Policies behind the agent loop: local transformers, OpenAI-compatible servers, scripted."""

from __future__ import annotations

from typing import Any

from pipelines.agent.policies.base import Generation, Policy, Sampling

__all__ = ["Generation", "Policy", "Sampling", "make_policy"]


def make_policy(model: str, *, engine: str = "auto", served_model: str | None = None,
                agent_cfg: Any = None, device: str = "auto", dtype: str = "auto",
                concurrency: int = 8, client: Any = None, role: str = "model server",
                url_hint: str | None = None, model_hint: str | None = None) -> Policy:
    """A policy for ``model``: an http(s) URL -> OpenAI-compatible client, else transformers.

    ``client`` (a :class:`~pipelines.config.client.ClientConfig`) shapes the server's requests;
    ``role`` / ``url_hint`` / ``model_hint`` word its errors with the calling command's flags."""
    from pipelines.config.agent import AgentConfig

    cfg = agent_cfg or AgentConfig()
    if engine == "openai" or (engine == "auto" and model.startswith(("http://", "https://"))):
        from pipelines.agent.policies.openai import OpenAIPolicy

        return OpenAIPolicy(model, served_model, client=client, concurrency=concurrency,
                            image_min_pixels=cfg.image_min_pixels,
                            image_max_pixels=cfg.image_max_pixels,
                            image_factor=cfg.image_factor, role=role,
                            url_hint=url_hint, model_hint=model_hint)
    if engine == "vllm":
        from pipelines.agent.policies.vllm import VLLMPolicy

        return VLLMPolicy(model, agent_cfg=cfg)
    from pipelines.agent.policies.hf import HFPolicy

    return HFPolicy.from_pretrained(model, device=device, dtype=dtype,
                                    image_min_pixels=cfg.image_min_pixels,
                                    image_max_pixels=cfg.image_max_pixels,
                                    image_factor=cfg.image_factor,
                                    draft_tokens=cfg.draft_tokens, threads=cfg.cpu_threads,
                                    share_prefixes=cfg.share_prefixes)
