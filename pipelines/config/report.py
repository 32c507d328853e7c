"""What the report shows, what is kept for it, and which trackers receive metrics."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from pipelines.config.base import Section


class ReportConfig(Section):
    """Report formats, the thumbnails and rollouts kept for trajectory pages, and trackers."""

    formats: list[Literal["table", "markdown", "html", "json"]] = ["markdown", "html", "json"]
    """Formats written into the run's report directory (html also writes trajectories.html)."""

    thumbnail_px: int = Field(512, ge=0, le=2048)
    """Longest side in pixels of the thumbnails (WebP, in the store) kept of every image a
    trajectory shows: the task's input images and the interpreter's images. 0 keeps none."""

    rollout_groups: int = Field(2, ge=0, le=64)
    """Per RL step of the local engine: how many kept groups (highest ranked first) and how many
    dropped groups keep their whole trajectories for the report. Every rollout's reward,
    advantage and fate are recorded whatever this is; 0 keeps no trajectories."""

    trackers: list[Literal["tensorboard", "wandb"]] = []
    """Also send metrics (SFT, RL, evaluation) to these trackers, under verl's metric names
    (`critic/score/mean`, `actor/pg_clipfrac`, `response_length/mean`, ...): event files under
    `<runs_dir>/<run-id>/tensorboard/<stage>`, W&B runs under `<runs_dir>/<run-id>/wandb`."""

    wandb_mode: Literal["offline", "online"] = "offline"
    """W&B mode: offline writes local run files (`wandb sync` uploads them later); online needs
    a login and the network."""

    wandb_project: str = Field("pyvision", min_length=1, max_length=128)
    """W&B project (verl's `trainer.project_name` too); each stage of a run is one W&B run
    (`<run-id>/<stage>`), grouped by run id."""
