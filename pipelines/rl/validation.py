"""Where RL validates: the one rule both engines follow (the local engine's ``rl.local.test_freq``,
verl's ``rl.verl.test_freq``)."""

from __future__ import annotations

from pipelines.config.recipe import Recipe
from pipelines.manifest import DataOutputs
from pipelines.rundir import StageDir


def validation_sources(recipe: Recipe, sd: StageDir) -> list[str]:
    """The task folders RL validates on, with either engine: ``rl.val_tasks``, else the data
    stage's held-out sets (none: validation is off)."""
    if recipe.rl.val_tasks:
        return list(recipe.rl.val_tasks)
    data = sd.outputs_of(DataOutputs)
    return list(data.heldout.values()) if data is not None else []
