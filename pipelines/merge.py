"""Turn training outputs into plain Hugging Face models, and check that they load.

- A LoRA adapter (SFT with ``finetuning_type: lora``) is merged by LLaMA-Factory's own export:
  :mod:`pipelines.sft.lora`.
  An adapter of LoRA RL (the local engine's ``rl/adapter``, marked by ``pyvision_lora.json``)
  is merged there with peft instead (:func:`pipelines.core.modeldir.merge_peft`).
- A verl FSDP actor checkpoint (``<ckpt>/global_step_N/actor``) is merged by verl's own
  ``python -m verl.model_merger merge --backend fsdp``. With ``rl.lora`` verl's merger writes
  the base weights and the adapter (``lora_adapter/``) separately; the adapter is then merged
  into them with peft, so the result is one plain model either way (the adapter is kept beside
  it, in ``lora_adapter/``).

Either way the result is written to a temporary folder and renamed into place only after it has
been checked: config, processor and weights present, the weight names and shapes matching what the
config's model class expects (checked on the meta device, so a 7B model costs no RAM), and, for
small models, a real forward pass.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

from pipelines.core.modeldir import flatten_into, merge_peft, refuse_existing, verify_model_dir
from pipelines.errors import SubprocessFailed, UserError
from pipelines.fsutil import atomic_dir, keep_failed_log
from pipelines.sft import llamafactory as lf


def merge_verl(checkpoint: str | Path, out: str | Path, *, python: str = "python",
               force: bool = False) -> dict[str, Any]:
    """Merge a verl FSDP actor checkpoint with ``verl.model_merger``; verify; return info."""
    ckpt = Path(checkpoint)
    actor = _find_actor_dir(ckpt)
    out = Path(out)
    refuse_existing(out, force)
    with atomic_dir(out, overwrite=force) as tmp:
        argv = [lf.python_for(python), "-m", "verl.model_merger", "merge", "--backend", "fsdp",
                "--local_dir", str(actor), "--target_dir", str(tmp / "model")]
        log_path = tmp / "merge.log"
        proc = subprocess.run(argv, capture_output=True, text=True, errors="replace", check=False)
        log_path.write_text(f"$ {' '.join(argv)}\n{proc.stdout}\n{proc.stderr}")
        if proc.returncode != 0:
            tail = (proc.stdout + proc.stderr).strip().splitlines()[-lf.LOG_TAIL_LINES:]
            from pipelines.console import err

            err.print("[red]verl.model_merger failed; last lines:[/]")
            for line in tail:
                err.print(f"  {line}", markup=False)
            kept = keep_failed_log(log_path, out)
            raise SubprocessFailed(f"verl.model_merger exited with code {proc.returncode} on {actor}; "
                                   f"log: {kept}", hint="check that the checkpoint is complete")
        if (tmp / "model" / "lora_adapter" / "adapter_config.json").is_file():
            # LoRA RL: verl's merger saved the base weights and the adapter apart.
            shutil.move(str(tmp / "model" / "lora_adapter"), str(tmp / "lora_adapter"))
            merge_peft(tmp / "lora_adapter", tmp / "model", tmp / "merged")
            shutil.rmtree(tmp / "model")
            (tmp / "merged").rename(tmp / "model")
        info = verify_model_dir(tmp / "model")
        flatten_into(tmp, "model")
        info["path"] = str(out)
    return info


def _find_actor_dir(ckpt: Path) -> Path:
    """Accept ``.../global_step_N/actor``, ``.../global_step_N`` or a folder of global steps."""
    if not ckpt.exists():
        raise UserError(f"checkpoint not found: {ckpt}", hint="pass verl's checkpoint folder")
    if (ckpt / "fsdp_config.json").is_file() or list(ckpt.glob("model_world_size_*_rank_0.pt")):
        return ckpt
    if (ckpt / "actor").is_dir():
        return _find_actor_dir(ckpt / "actor")
    steps = sorted((p for p in ckpt.glob("global_step_*") if p.name.split("_")[-1].isdigit()),
                   key=lambda p: int(p.name.split("_")[-1]))
    if steps:
        return _find_actor_dir(steps[-1])
    raise UserError(f"{ckpt} holds no verl FSDP checkpoint (no model_world_size_*_rank_0.pt, "
                    "actor/ or global_step_*/)", hint="pass <checkpoints>/global_step_N/actor")


