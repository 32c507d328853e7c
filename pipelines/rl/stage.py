"""The RL stage: inputs from the earlier stages, then the local engine or verl.

Inputs: the policy to start from is the SFT stage's model (``sft/output``; a LoRA adapter is merged
first), else the data stage's base model; RL prompts are the data stage's ``rl_tasks`` folders.
Both can be given explicitly. ``engine: local`` trains in this process; ``engine: verl`` renders
verl's configuration and launches ``verl.trainer.main_ppo`` (see ``pipelines/rl/verl``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pipelines.config.recipe import Recipe
from pipelines.errors import UserError
from pipelines.manifest import DataOutputs, SFTOutputs
from pipelines.rl.validation import validation_sources
from pipelines.rundir import StageDir, earlier_stages_hint


def resolve_rl_inputs(recipe: Recipe, sd: StageDir, *, model: str | None = None,
                      tasks: list[str] | None = None, in_run: bool = False) -> tuple[str, list[str]]:
    """(policy to start from, RL task folders). ``in_run``: called by `pyvision run` (no
    --model or --tasks to pass: the hints name its earlier stages)."""
    data = sd.outputs_of(DataOutputs)
    sft = sd.outputs_of(SFTOutputs)
    model = model or (sft.model if sft is not None else None) or (
        data.base_model if data is not None else None) or (
        None if recipe.model.tiny else recipe.model.base)
    if model is None:
        raise UserError(f"no model to start RL from in run '{sd.run_id}'",
                        hint=earlier_stages_hint(sd.run_id) if in_run else
                        "run the data and sft stages first, or pass --model PATH")
    task_dirs = tasks or (data.rl_tasks if data is not None else [])
    if not task_dirs:
        raise UserError(f"no RL prompts for run '{sd.run_id}'",
                        hint=earlier_stages_hint(sd.run_id) if in_run else
                        "run the data stage first, or pass --tasks DIR (a tasks.jsonl folder)")
    # Checked here, before the stage writes anything: a model folder that cannot load and a
    # prompt folder without usable rows end in one line, not in a failed stage left behind.
    from pipelines.core.records import read_tasks

    sd.check_model(model, "the model to start RL from")
    read = [(tasks, Path(report.path).parent, report.path)
            for tasks, report in (read_tasks(t, strict=True) for t in task_dirs)]
    if not any(tasks for tasks, _, _ in read):
        raise UserError(f"no usable RL prompts in {', '.join(str(t) for t in task_dirs)}",
                        hint="check them with `pyvision data validate DIR`, or pass --tasks DIR")
    from pipelines.data.validate import check_media_decode

    check_media_decode(read, "RL prompts")
    if recipe.rl.engine == "local":
        # An optimizer class or argument that does not build ends here too (built on a stand-in
        # parameter). verl builds its own in its environment, which may hold modules this one
        # lacks.
        import torch

        from pipelines.rl.algos import build_optimizer

        build_optimizer([torch.nn.Parameter(torch.zeros(1))], recipe.rl)
        if recipe.rl.local.test_freq > 0:
            # Read as the engine will (and verl's export does): a bad folder ends here, not
            # mid-stage.
            for folder in validation_sources(recipe, sd):
                read_tasks(folder, strict=recipe.data.strict)
    return model, [str(t) for t in task_dirs]


def run_rl(recipe: Recipe, sd: StageDir, *, model: str, task_dirs: list[str], resume: bool = False,
           dry_run: bool = False, show_progress: bool = True) -> dict[str, Any]:
    """Dispatch to the configured engine; returns the stage summary (or the launch plan)."""
    if recipe.rl.engine == "local":
        if dry_run:
            raise UserError("--dry-run is for the verl engine (it prints the launch command)",
                            hint="drop --dry-run, or pass --engine verl")
        from pipelines.rl.local import train_local

        return train_local(recipe, sd, model_path=model, task_dirs=task_dirs, resume=resume,
                           show_progress=show_progress)
    from pipelines.rl.verl.launch import launch_verl

    return launch_verl(recipe, sd, model=model, task_dirs=[Path(t) for t in task_dirs],
                       resume=resume, dry_run=dry_run, show_progress=show_progress)
