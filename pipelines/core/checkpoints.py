"""Checkpoints that resume exactly: Hugging Face weights plus optimizer, sampler and every RNG
state, written atomically (the local RL engine and tiny-model pretraining share them).
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path
from typing import Any

from pipelines.fsutil import atomic_dir

STATE_FILE = "trainer_state.pt"


def rng_state() -> dict[str, Any]:
    import numpy as np
    import torch

    state = {"python": random.getstate(), "numpy": np.random.get_state(),
             "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    import numpy as np
    import torch

    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(root: Path, step: int, model: Any, processor: Any, optimizer: Any,
                    sampler: Any, extra: dict[str, Any] | None = None,
                    keep: int = 2) -> Path:
    """Write ``root/step_{step}`` atomically (HF model + trainer state) and prune old ones."""
    import torch

    target = root / f"step_{step}"
    with atomic_dir(target, overwrite=True) as tmp:
        model.save_pretrained(tmp)
        processor.save_pretrained(tmp)
        torch.save({"step": step, "optimizer": optimizer.state_dict(),
                    "sampler": sampler.state_dict(), "rng": rng_state(),
                    "extra": extra or {}}, tmp / STATE_FILE)
        (tmp / "step.json").write_text(json.dumps({"step": step}) + "\n")
    for old in list_checkpoints(root)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return target


def list_checkpoints(root: Path) -> list[Path]:
    """Complete checkpoints under ``root``, oldest first."""
    if not root.is_dir():
        return []
    found = [p for p in root.glob("step_*") if (p / STATE_FILE).is_file()
             and p.name.split("_")[-1].isdigit()]
    return sorted(found, key=lambda p: int(p.name.split("_")[-1]))


def load_checkpoint(path: Path, optimizer: Any, sampler: Any) -> dict[str, Any]:
    """Restore optimizer, sampler and RNG state from ``path`` (weights are loaded by the caller)."""
    import torch

    state = torch.load(path / STATE_FILE, weights_only=False)
    optimizer.load_state_dict(state["optimizer"])
    sampler.load_state_dict(state["sampler"])
    set_rng_state(state["rng"])
    return state
