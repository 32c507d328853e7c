"""What the data stage produces: synthetic tasks, cold-start trajectories, real datasets."""

from __future__ import annotations

from pydantic import Field

from pipelines.config.base import Section


class SynthKindConfig(Section):
    """How many synthetic tasks of one kind to generate."""

    n_train: int = Field(0, ge=0, le=10_000_000)
    """Tasks for training (SFT trajectories and RL prompts are drawn from these)."""

    n_heldout: int = Field(0, ge=0, le=1_000_000)
    """Held-out tasks for evaluation, generated with a different seed stream."""

    families: list[str] | None = None
    """Task families to generate (None: the kind's default set; see `pyvision data synth`)."""


class SynthConfig(Section):
    """Synthetic task generation (offline, deterministic given the seed)."""

    image_search: SynthKindConfig = SynthKindConfig()
    """Visual-search tasks on a large canvas with small targets."""

    video: SynthKindConfig = SynthKindConfig()
    """Short clips with moving objects: counting, measurement, order of appearance."""

    sft_fraction: float = Field(0.5, ge=0.0, le=1.0)
    """Fraction of the training tasks used for cold-start SFT trajectories; RL uses the rest."""


class DataConfig(Section):
    """Inputs of the SFT and RL stages."""

    synth: SynthConfig = SynthConfig()
    """Synthetic tasks (the embedded default's whole training mix)."""

    datasets: list[str] = []
    """Real datasets to download (or import) and mix in, e.g. `pyvision-image-sft`."""

    copy_drills: int = Field(0, ge=0, le=16)
    """Copy drills per cold-start trajectory: short media-free SFT rows that teach a small model to
    answer with the value its code printed (the trajectory's last interpreter turn and answer, with
    that value replaced by a random one of the same kind). 0: none. What they did and did not do
    for the tiny demo: `pipelines/data/drills.py`."""

    strict: bool = False
    """Fail on the first invalid row instead of skipping and counting it."""
