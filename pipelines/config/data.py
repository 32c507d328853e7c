"""What the data stage produces: synthetic tasks, cold-start trajectories, real datasets."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from pipelines.config.base import Section
from pipelines.config.client import ClientConfig


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


class DistillConfig(Section):
    """Cold-start SFT data from a teacher model (`pyvision data distill`): our agent loop with the
    teacher as the policy, K samples per task, kept only when verified, then selected."""

    teacher: str | None = Field(None, max_length=2048)
    """URL of the teacher's OpenAI-compatible server (`vllm serve`, SGLang, `transformers
    serve`, a hosted API). Set, `pyvision run` distills in its data stage (see `sft_sources`)."""

    served_model: str | None = Field(None, max_length=512)
    """Model name sent to the teacher (None: the one model it lists)."""

    tasks: list[str] = Field([], max_length=256)
    """Task folders (tasks.jsonl + media) distilled in `pyvision run` beside the recipe's
    synthetic SFT tasks."""

    k: int = Field(4, ge=1, le=256)
    """Samples drawn per task."""

    max_per_task: int = Field(1, ge=1, le=256)
    """Most verified trajectories kept per task."""

    temperature: float = Field(0.7, ge=0.0, le=2.0)
    """Teacher sampling temperature (K samples at 0 are K copies)."""

    top_p: float = Field(1.0, gt=0.0, le=1.0)
    """Teacher nucleus sampling threshold."""

    max_new_tokens_per_turn: int | None = Field(None, ge=8, le=65536)
    """Most tokens per teacher turn (None: `agent.max_new_tokens_per_turn`)."""

    max_turns: int | None = Field(None, ge=1, le=100)
    """Most assistant turns; longer trajectories are cut and rejected (None:
    `agent.max_turns_train`, so SFT teaches what RL rollouts can do)."""

    max_tokens: int | None = Field(None, ge=256, le=1_048_576)
    """Most tokens in a kept trajectory as the teacher's server counts them (None:
    `sft.cutoff_len`, beyond which SFT would cut it)."""

    allow_fixed_errors: bool = False
    """Keep trajectories with a failed code block when a later block ran (the model fixed its
    code); otherwise every code block must run."""

    balance: Literal["none", "family", "family_and_turns"] = "family_and_turns"
    """Balance the kept set over task families (and turn counts): no group keeps more than
    `balance_ratio` times the median group."""

    balance_ratio: float = Field(2.0, ge=1.0, le=1000.0)
    """How much larger than the median group a group may stay."""

    near_duplicate: float = Field(0.9, ge=0.5, le=1.0)
    """Two trajectories of a task whose code (or, without code, text) is at least this similar
    (difflib ratio) are near duplicates; only the better one is kept. 1.0: exact duplicates only."""

    concurrency: int = Field(8, ge=1, le=4096)
    """Teacher requests (trajectories) in flight at once."""

    client: ClientConfig = ClientConfig()
    """How requests reach the teacher: server kind, per-request timeout, retries."""


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

    distill: DistillConfig = DistillConfig()
    """Distillation from a teacher model (`pyvision data distill`, and `pyvision run` when
    `distill.teacher` is set)."""

    sft_sources: list[str] | None = Field(None, min_length=1, max_length=64)
    """What the SFT data mixes: `scripted` (cold-start trajectories of the solvers), `distill`
    (the teacher's verified trajectories; needs `distill.teacher`), or a folder of conversations
    (e.g. the output of `pyvision data distill`). None: `scripted`, plus `distill` when a teacher
    is set."""

    @model_validator(mode="after")
    def _sources_need_what_they_name(self) -> DataConfig:
        for source in self.sft_sources or []:
            if not source.strip():
                raise ValueError("data.sft_sources has an empty entry")
        if "distill" in (self.sft_sources or []) and not self.distill.teacher:
            raise ValueError("data.sft_sources names 'distill' but data.distill.teacher is not "
                             "set (set it to the teacher's URL)")
        return self

    def resolved_sft_sources(self) -> list[str]:
        """``sft_sources`` with its default spelled out."""
        if self.sft_sources is not None:
            return list(dict.fromkeys(self.sft_sources))
        return ["scripted"] + (["distill"] if self.distill.teacher else [])
