"""How requests reach an OpenAI-compatible server: which server it is, timeouts and retries."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from pipelines.config.base import Section

ServerKind = Literal["auto", "vllm", "sglang", "transformers", "openai"]


class ClientConfig(Section):
    """An OpenAI-compatible chat endpoint as a client sees it (vLLM, SGLang, `transformers
    serve`, hosted APIs)."""

    server: ServerKind = "auto"
    """Which server answers, which decides the fields beyond the OpenAI API a request carries:
    `vllm` (`include_stop_str_in_output`, `skip_special_tokens`), `sglang` (`no_stop_trim`,
    `skip_special_tokens`), `openai` (the standard fields only; hosted APIs reject unknown ones),
    `transformers` (standard fields and no stop strings: `transformers serve` fails on them for
    vision models; turns are cut at `</code>` client-side). `auto` asks the server's
    `/v1/models` (vLLM and SGLang name themselves there) and sends only standard fields to
    anything else; a server that rejects a server-specific field is asked again without it, and
    one that fails twice on stop strings (HTTP 500, a dropped connection) but not without them
    gets none, each once with a warning."""

    timeout_s: float = Field(300.0, gt=0.0, le=3600.0)
    """Per-request timeout in seconds (one assistant turn must fit in it)."""

    max_retries: int = Field(3, ge=0, le=20)
    """Retries (with exponential backoff) after a timeout, a refused connection, HTTP 429 or a
    5xx answer; a request the server rejects (4xx) is never retried."""

    backoff_s: float = Field(1.0, ge=0.0, le=60.0)
    """First backoff delay before a retry; doubles on each retry."""

    stall_s: float = Field(30.0, ge=1.0, le=3600.0)
    """A request waiting longer than this shows as stalled in the progress display (and a
    warning line names the server and the wait)."""

    api_key_env: str = Field("OPENAI_API_KEY", min_length=1, max_length=128)
    """Environment variable holding the API key (never stored in configs or run dirs)."""
