"""How a finished trajectory is rewarded."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from pipelines.config.base import Section


class JudgeConfig(Section):
    """An LLM judge behind any OpenAI-compatible endpoint (the paper served Qwen2.5-72B)."""

    base_url: str | None = None
    """Endpoint such as `http://judge-host:8000/v1`; None disables the judge (rule verifiers)."""

    model: str = "Qwen/Qwen2.5-72B-Instruct"
    """Model name sent to the endpoint."""

    api_key_env: str = "PYVISION_JUDGE_API_KEY"
    """Environment variable holding the API key (never stored in configs or run dirs)."""

    temperature: float = Field(0.3, ge=0.0, le=2.0)
    """Judge sampling temperature (paper: 0.3)."""

    timeout_s: float = Field(30.0, gt=0.0, le=600.0)
    """Per-request timeout."""

    max_retries: int = Field(3, ge=0, le=20)
    """Retries with exponential backoff before falling back to the rule verifier."""

    backoff_s: float = Field(1.0, ge=0.0, le=60.0)
    """First backoff delay; doubles on each retry."""

    concurrency: int = Field(16, ge=1, le=1024)
    """Most judge requests in flight at once."""

    use_for: list[Literal["text", "math", "choice", "number"]] = ["text", "math"]
    """Answer types sent to the judge; the others use rule verifiers only."""


class RewardConfig(Section):
    """Accuracy reward, accumulative tool reward and guards."""

    tool_reward_per_call: float = Field(0.1, ge=0.0, le=10.0)
    """Bonus per successful tool call, added only when the answer is correct (paper: 0.1)."""

    tool_reward_cap: float | None = Field(None, ge=0.0, le=100.0)
    """Cap on the total tool bonus per trajectory (None: no cap)."""

    max_answer_chars: int = Field(1000, ge=1, le=1_000_000)
    """Answers longer than this get reward 0 in total, tool bonus included."""

    mra_threshold: float = Field(0.5, ge=0.0, le=1.0)
    """For MRA-scored numeric answers: the accuracy counts as correct at or above this MRA."""

    number_rel_tol: float = Field(0.01, ge=0.0, le=1.0)
    """Relative tolerance of the `number` verifier."""

    judge: JudgeConfig = JudgeConfig()
    """Optional LLM judge."""

    format_penalty: float = Field(0.0, ge=0.0, le=10.0)
    """Subtracted when the trajectory ends without a well-formed answer (0 in the paper)."""

    accuracy_mode: Literal["binary", "mra"] = "binary"
    """`binary`: 1/0 accuracy (paper); `mra`: MRA-scored numeric tasks give their MRA value."""
