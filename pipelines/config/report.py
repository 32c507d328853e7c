"""What the report shows and what is kept for it."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from pipelines.config.base import Section


class ReportConfig(Section):
    """Report formats and the thumbnails kept for trajectory pages."""

    formats: list[Literal["table", "markdown", "html", "json"]] = ["markdown", "html", "json"]
    """Formats written into the run's report directory (html also writes trajectories.html)."""

    thumbnail_px: int = Field(512, ge=0, le=2048)
    """Longest side in pixels of the thumbnails (WebP, in the store) kept of every image a
    trajectory shows: the task's input images and the interpreter's images. 0 keeps none."""
