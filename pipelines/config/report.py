"""What the report shows."""

from __future__ import annotations

from typing import Literal

from pipelines.config.base import Section


class ReportConfig(Section):
    """Report formats produced at the end of a run."""

    formats: list[Literal["table", "markdown", "html", "json"]] = ["markdown", "html", "json"]
    """Formats written into the run's report directory."""
