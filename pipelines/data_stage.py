"""The data stage of a recipe: everything the later stages read, in ``runs/<run-id>/data/``.

1. Synthetic tasks: train and held-out sets for each configured kind (``synth/<kind>/<split>``).
2. A split of the train tasks: the first ``sft_fraction`` get cold-start trajectories, the rest are
   RL prompts (``rl/<kind>/tasks.jsonl``, media referenced in place).
3. Cold-start trajectories executed in the sandbox (``trajectories/<kind>``), distilled from a
   teacher (``distill/``, :mod:`pipelines.data.distill`, on the same SFT tasks and the folders of
   ``data.distill.tasks``), or both, and any conversation folders: ``data.sft_sources``.
4. The base model: a tiny Qwen2.5-VL built here when the recipe asks for one, its tokenizer trained
   on the trajectories' own text (so its merges fit the data); else the recipe's model id/path.
5. The LLaMA-Factory export of all trajectories (``llamafactory/``), with the copy drills of
   ``data.copy_drills`` (:mod:`pipelines.data.drills`) when the recipe asks for them.
6. Real datasets named in ``data.datasets`` (downloaded; offline this stops with the import route).

The manifest's ``outputs`` is the contract with the later stages: ``base_model``,
``sft_dataset_dir``, ``sft_dataset_name``, ``rl_tasks`` (folders), ``heldout`` (benchmark name ->
folder).
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from pipelines.config.recipe import Recipe
from pipelines.console import err
from pipelines.core.records import Task, read_conversations, read_tasks, write_tasks
from pipelines.rundir import StageDir

KIND_BENCHMARK = {"image-search": "synth-image", "video": "synth-video"}


def subset_tasks(tasks: list[Task], src_root: Path, dst_dir: Path) -> Path:
    """Write ``tasks`` into ``dst_dir/tasks.jsonl`` with media paths relative to ``dst_dir``."""
    dst_dir.mkdir(parents=True, exist_ok=True)

    def rel(p: str) -> str:
        full = Path(p) if Path(p).is_absolute() else src_root / p
        return os.path.relpath(full.resolve(), dst_dir.resolve())

    moved = [t.model_copy(update={"images": [rel(p) for p in t.images],
                                  "video": rel(t.video) if t.video else None}) for t in tasks]
    return write_tasks(dst_dir / "tasks.jsonl", moved)


def tiny_base(recipe: Recipe, model_dir: Path, conversations: list, sd: StageDir) -> None:
    """The run's tiny base model, as ``model.tiny.init`` says: the shipped pretrained base, one
    pretrained here, or random weights with a tokenizer fitted to the run's trajectories."""
    tiny = recipe.model.tiny
    assert tiny is not None
    if tiny.init == "pretrained":
        from pipelines.models.pretrain import copy_shipped_base

        copy_shipped_base(tiny.size, model_dir)
    elif tiny.init == "pretrain":
        from pipelines.models.pretrain import pretrain

        pretrain(recipe.model.pretrain, size=tiny.size, seed=tiny.seed, out=model_dir,
                 work=sd.path / "pretrain", store=sd.store, run_id=sd.run_id, resume=True)
    else:
        from pipelines.models.tiny import build_tiny_model

        corpus = [m.content for _, convs in conversations for c in convs for m in c.messages]
        with err.status(f"building tiny Qwen2.5-VL ({tiny.size})"):
            build_tiny_model(model_dir, size=tiny.size, seed=tiny.seed, extra_corpus=corpus,
                             force=True)


def check_data_inputs(recipe: Recipe) -> None:
    """What the data stage can check before it writes, so that a typo is one line and no half
    stage blocks the corrected command: the base model it will hand to SFT when the recipe
    builds no tiny one (a local folder must exist and look loadable; a hub id is resolved by
    SFT), the model a pretraining in the stage continues (``model.pretrain.init``), the names in
    ``data.datasets``, the conversation and task folders it reads and the teacher it distills
    from."""
    from pipelines.core.records import CONVERSATIONS_FILE, TASKS_FILE, rows_file
    from pipelines.data.hub import get_dataset

    if recipe.model.tiny is None:
        from pipelines.inputs import check_model

        check_model(recipe.model.base, "model.base")
    elif recipe.model.tiny.init == "pretrain":
        from pipelines.models.pretrain import check_init

        check_init(recipe.model.pretrain)
    for name in recipe.data.datasets:
        get_dataset(name)
    for source in recipe.data.resolved_sft_sources():
        if source not in ("scripted", "distill"):
            rows_file(source, CONVERSATIONS_FILE)
    if "distill" in recipe.data.resolved_sft_sources():
        from pipelines.data.distill import check_teacher

        for folder in recipe.data.distill.tasks:
            rows_file(folder, TASKS_FILE)
        check_teacher(recipe.data.distill.teacher)


def run_data_stage(recipe: Recipe, sd: StageDir, *, show_progress: bool = True) -> dict[str, Any]:
    from pipelines.data.export_llamafactory import export_llamafactory
    from pipelines.data.synth import synthesize
    from pipelines.data.trajectories import make_trajectories

    root = sd.path
    start = time.monotonic()
    kinds = {"image-search": recipe.data.synth.image_search, "video": recipe.data.synth.video}
    outputs: dict[str, Any] = {"rl_tasks": [], "heldout": {}}
    summary: dict[str, Any] = {}
    traj_sources = []
    sources = recipe.data.resolved_sft_sources()
    distill_tasks: list[Path] = []
    for kind, cfg in kinds.items():
        if cfg.n_train == 0 and cfg.n_heldout == 0:
            continue
        if cfg.n_heldout:
            held = root / "synth" / kind / "heldout"
            if not (held / "manifest.json").exists():
                synthesize(kind, cfg.n_heldout, recipe.seed, held, split="heldout",
                           families=cfg.families, progress=show_progress)
            outputs["heldout"][KIND_BENCHMARK[kind]] = str(held)
        if not cfg.n_train:
            continue
        train = root / "synth" / kind / "train"
        if not (train / "manifest.json").exists():
            m = synthesize(kind, cfg.n_train, recipe.seed, train, split="train",
                           families=cfg.families, progress=show_progress)
            summary[f"{kind}/tasks_per_s"] = m["tasks_per_s"]
        tasks, _ = read_tasks(train)
        n_sft = round(len(tasks) * recipe.data.synth.sft_fraction)
        if n_sft < len(tasks):
            rl_dir = root / "rl" / kind
            subset_tasks(tasks[n_sft:], train, rl_dir)
            outputs["rl_tasks"].append(str(rl_dir))
        if n_sft:
            sft_dir = root / "sft-tasks" / kind
            subset_tasks(tasks[:n_sft], train, sft_dir)
            distill_tasks.append(sft_dir)
            traj = root / "trajectories" / kind
            if "scripted" in sources and not (traj / "manifest.json").exists():
                m = make_trajectories(sft_dir, traj, seed=recipe.seed, agent_cfg=recipe.agent,
                                      sandbox_cfg=recipe.sandbox, progress=show_progress)
                err.print(f"trajectories ({kind}): kept {m['kept']} of {m['tasks']} "
                          f"(dropped {m['dropped'] or 'none'}), {m['trajectories_per_s']}/s")
                summary[f"{kind}/trajectories_kept"] = m["kept"]
                summary[f"{kind}/trajectories_dropped"] = sum(m["dropped"].values())
                summary[f"{kind}/trajectories_per_s"] = m["trajectories_per_s"]
            if "scripted" in sources:
                traj_sources.append(traj)
        summary[f"{kind}/train_tasks"] = len(tasks)
        summary[f"{kind}/sft_tasks"] = n_sft
        summary[f"{kind}/rl_tasks"] = len(tasks) - n_sft

    for name in recipe.data.datasets:
        # Real datasets join the mix: SFT conversations are exported with the trajectories,
        # RL rows become prompts. Offline, download stops with the `data import` route.
        from pipelines.data.hub import download, get_dataset

        target = root / "datasets" / name
        manifest = (download(name, target, strict=recipe.data.strict)
                    if not (target / "manifest.json").exists() else {"kept": None})
        outputs.setdefault("datasets", {})[name] = str(target)
        summary[f"{name}/rows"] = manifest.get("kept")
        kind = get_dataset(name).kind
        if kind == "sft":
            traj_sources.append(target)
        elif kind == "rl":
            outputs["rl_tasks"].append(str(target))

    if "distill" in sources:
        traj_sources.append(_distill(recipe, sd, distill_tasks, summary, show_progress))
    for source in sources:
        if source not in ("scripted", "distill"):
            traj_sources.append(Path(source))

    conversations = [(src, read_conversations(src)[0]) for src in traj_sources]
    if recipe.model.tiny is not None:
        model_dir = root / "base-model"
        if not (model_dir / "config.json").is_file():
            tiny_base(recipe, model_dir, conversations, sd)
        outputs["base_model"] = str(model_dir)
    else:
        outputs["base_model"] = recipe.model.base
    if recipe.data.copy_drills:
        # Drills of the cold-start trajectories only, exported from their sources' roots.
        from pipelines.data.drills import copy_drills

        drills = [(src, copy_drills(convs, recipe.data.copy_drills, recipe.seed))
                  for src, convs in conversations if src.parent == root / "trajectories"]
        conversations += drills
        summary["sft_drill_rows"] = sum(len(d) for _, d in drills)
    if conversations:
        info = export_llamafactory(conversations, root / "llamafactory", name="pyvision_sft",
                                   agent_cfg=recipe.agent)
        outputs["sft_dataset_dir"], outputs["sft_dataset_name"] = info["dataset_dir"], info["dataset"]
        summary["sft_rows"] = info["rows"]
    summary["seconds"] = round(time.monotonic() - start, 1)
    sd.finish(outputs, summary)
    return {"outputs": outputs, "summary": summary}


def _distill(recipe: Recipe, sd: StageDir, task_dirs: list[Path], summary: dict[str, Any],
             show_progress: bool) -> Path:
    """Distil the SFT tasks (and ``data.distill.tasks``) from the recipe's teacher into
    ``distill/``; a re-run draws only what is missing."""
    from pipelines.data.distill import distill

    out = sd.path / "distill"
    folders = [*task_dirs, *(Path(p) for p in recipe.data.distill.tasks)]
    if not (out / "manifest.json").exists():
        card = distill(recipe, folders, out, store=sd.store, run_id=sd.run_id,
                       progress=show_progress)
        s = card["samples"]
        err.print(f"distill: {s['drawn']} samples from {card['teacher']['served_model']}, "
                  f"{s['accepted']} verified, {card['selection']['kept']} kept "
                  f"(rejected: {s['rejected'] or 'none'})", markup=False)
        summary["distill/samples"] = s["drawn"]
        summary["distill/accepted"] = s["accepted"]
        summary["distill/kept"] = card["selection"]["kept"]
    return out
