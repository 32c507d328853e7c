"""Limits of the sandbox that runs model-written code."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from pipelines.config.base import Section


class SandboxConfig(Section):
    """Resource limits and isolation mode for one sandbox (one per trajectory)."""

    isolation: Literal["auto", "bwrap", "rlimit"] = "auto"
    """`bwrap`: namespaces via bubblewrap (required, error if missing); `rlimit`: process limits
    only, no security boundary; `auto`: bwrap when installed, else rlimit with a loud warning."""

    timeout_s: float = Field(30.0, gt=0.0, le=3600.0)
    """Wall-clock limit of one code call; on expiry the sandbox's whole process tree is killed."""

    cpu_seconds: int = Field(60, ge=1, le=86_400)
    """CPU-time limit (RLIMIT_CPU) of the sandbox process, over its whole life."""

    memory_mb: int = Field(2048, ge=512, le=1_048_576)
    """Address-space limit (RLIMIT_AS) of the sandbox process in MiB; exceeding it is `oom`. At
    least 512: the runtime's preloaded libraries already map about 400 MiB, and below that a
    sandbox could not start."""

    max_processes: int = Field(16, ge=1, le=4096)
    """Process/thread limit inside the sandbox (RLIMIT_NPROC under bwrap's private uid)."""

    max_file_mb: int = Field(64, ge=1, le=65_536)
    """Largest file the code may write (RLIMIT_FSIZE), in MiB."""

    max_open_files: int = Field(256, ge=16, le=65_536)
    """Open file descriptors limit (RLIMIT_NOFILE)."""

    max_output_chars: int = Field(8192, ge=256, le=10_000_000)
    """Printed output beyond this many characters is truncated, keeping head and tail with a
    marker in between."""

    max_images_per_call: int = Field(16, ge=0, le=1024)
    """Most images one code call may return; the call's output says once how many more were
    dropped. With ``max_output_chars`` it bounds the bytes the host receives for one call's reply
    (``sandbox.client.reply_limit``: about 18.75 MiB an image, 300 MiB with the defaults); a
    forged reply that would take more is refused (a crashed call)."""
