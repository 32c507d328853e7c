"""A finished stage's ``manifest.json``: what it made (``outputs``, typed per stage) and its key
numbers (``summary``).

Later stages read their inputs from earlier stages' outputs (the SFT stage's base model and dataset
from the data stage, the RL stage's policy from the SFT stage, ...). Each stage's outputs have a
model here: :meth:`pipelines.rundir.StageDir.finish` validates what a stage writes against it, and
:func:`read_manifest` validates what it reads back, so a manifest of the wrong shape ends in one
line naming the file instead of a ``KeyError`` in a later stage. The JSON keeps the keys a stage
wrote, in its order (unset optional outputs are left out, as before these models existed), so run
folders written earlier resume unchanged.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar, Generic, TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError

from pipelines.errors import ManifestError
from pipelines.inputs import read_json


class StageOutputs(BaseModel):
    """What one stage made: paths (as strings) that later stages and the user read."""

    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)

    stage: ClassVar[str]
    """The stage (folder name) whose manifest holds these outputs."""

    def to_json(self) -> dict[str, Any]:
        """The outputs as the manifest stores them: only the keys the stage set."""
        return self.model_dump(mode="json", exclude_unset=True)


class DataOutputs(StageOutputs):
    stage: ClassVar[str] = "data"

    rl_tasks: list[str]
    """Folders of RL prompts (the synthetic train split after the SFT share, RL datasets)."""

    heldout: dict[str, str]
    """Benchmark name (``synth-image``, ``synth-video``) -> held-out synthetic set."""

    datasets: dict[str, str] | None = None
    """Hub dataset name -> its converted folder (only when the recipe names datasets)."""

    base_model: str
    """The base model: the tiny model built in the stage, or the recipe's ``model.base``."""

    sft_dataset_dir: str | None = None
    """The LLaMA-Factory export (holds dataset_info.json), when there are SFT conversations."""

    sft_dataset_name: str | None = None
    """The dataset's name in dataset_info.json."""


class SFTOutputs(StageOutputs):
    stage: ClassVar[str] = "sft"

    base_model: str
    """The model SFT started from."""

    train_yaml: str
    """The rendered LLaMA-Factory training YAML."""

    log: str
    """LLaMA-Factory's full output."""

    adapter: str | None = None
    """The LoRA adapter (``finetuning_type: lora``), merged into ``model``."""

    model: str
    """The fine-tuned model."""


class RLOutputs(StageOutputs):
    stage: ClassVar[str] = "rl"

    model: str | None = None
    """Local engine: the trained model (absent with ``rl.lora``)."""

    adapter: str | None = None
    """Local engine with ``rl.lora``: the adapter, merged into ``base_model`` by the merge stage."""

    checkpoints: str
    """The checkpoint folder (verl: ``global_step_N/`` and its tracker file)."""

    checkpoint: str | None = None
    """verl: the last checkpoint's actor folder."""

    base_model: str
    """The policy RL started from."""

    launch_script: str | None = None
    """verl: ``launch.sh``, the same run started by hand."""

    log: str | None = None
    """verl: its full output."""

    metrics: str | None = None
    """verl: its file logger's metrics."""

    train_data: str | None = None
    """verl: the training parquet."""

    val_data: str | None = None
    """verl: the validation parquet (null without validation sets)."""


class MergeOutputs(StageOutputs):
    stage: ClassVar[str] = "merge"

    model: str
    """The final model (the RL model, merged when it was a checkpoint or an adapter)."""


class EvalOutputs(StageOutputs):
    stage: ClassVar[str] = "eval"

    models: dict[str, str]
    """Model tag (``base``, ``sft``, ``rl``) -> the model evaluated under it."""


class ReportOutputs(StageOutputs):
    """Format (``html``, ``markdown``, ``json``, ``trajectories``, ``png:<plot>``) -> file."""

    model_config = ConfigDict(extra="allow")
    __pydantic_extra__: dict[str, str]

    stage: ClassVar[str] = "report"


class PretrainOutputs(StageOutputs):
    stage: ClassVar[str] = "pretrain"

    model: str
    """The pretrained tiny model."""


OUTPUTS: dict[str, type[StageOutputs]] = {
    kind.stage: kind for kind in (DataOutputs, SFTOutputs, RLOutputs, MergeOutputs, EvalOutputs,
                                  ReportOutputs, PretrainOutputs)}

OutputsT = TypeVar("OutputsT", bound=StageOutputs)


class StageManifest(BaseModel, Generic[OutputsT]):
    """The whole ``manifest.json`` of one finished stage."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    run_id: str
    stage: str
    finished_at: str
    outputs: OutputsT
    summary: dict[str, Any]

    def to_json(self) -> dict[str, Any]:
        """The manifest as the file holds it."""
        return self.model_dump(mode="json", exclude_unset=True)


def _problem(exc: ValidationError) -> str:
    first = exc.errors()[0]
    where = ".".join(str(part) for part in first["loc"])
    return f"{where}: {first['msg']}" if where else "not a JSON object"


def read_manifest(path: Path, kind: type[OutputsT]) -> StageManifest[OutputsT]:
    """The manifest at ``path`` of a ``kind.stage`` stage, validated (:class:`ManifestError`
    names the file and the first problem)."""
    hint = f"redo the {kind.stage} stage with --force"
    raw = read_json(path, f"the {kind.stage} stage's manifest", hint, error=ManifestError)
    try:
        return StageManifest[kind].model_validate(raw)
    except ValidationError as exc:
        raise ManifestError(f"{path} is not a {kind.stage} stage manifest ({_problem(exc)})",
                            hint=hint) from None
