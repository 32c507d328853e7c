"""Merge a LoRA adapter into its base model with LLaMA-Factory's own export.

The export is rendered as a YAML kept beside the output (``llamafactory-cli export``); the result
is checked (:func:`pipelines.core.modeldir.verify_model_dir`) before it is moved into place.
An adapter of LoRA RL (marked by :data:`pipelines.core.modeldir.LORA_MARKER`) was made by peft
with the processor saved beside it, and is merged with peft in this process instead.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from pipelines.core.modeldir import (
    LORA_MARKER,
    flatten_into,
    merge_peft,
    refuse_existing,
    verify_model_dir,
)
from pipelines.errors import UserError
from pipelines.fsutil import atomic_dir, atomic_write_text
from pipelines.sft import llamafactory as lf


def merge_lora(adapter: str | Path, base: str | Path, out: str | Path, *, python: str = "python",
               template: str = "qwen2_vl", force: bool = False) -> dict[str, Any]:
    """Merge a LoRA adapter into its base model with LLaMA-Factory's export; verify; return info."""
    adapter, out = Path(adapter), Path(out)
    if not (adapter / "adapter_config.json").is_file():
        raise UserError(f"{adapter} is not a LoRA adapter (no adapter_config.json)",
                        hint="pass the SFT output folder of a finetuning_type: lora run")
    if not Path(str(base)).exists() and str(base).count("/") != 1:
        raise UserError(f"base model not found: {base}", hint="pass a local model folder or a "
                        "hub id such as Qwen/Qwen2.5-VL-7B-Instruct")
    refuse_existing(out, force)
    if (adapter / LORA_MARKER).is_file():
        with atomic_dir(out, overwrite=force) as tmp:
            merge_peft(adapter, base, tmp / "model")
            info = verify_model_dir(tmp / "model")
            flatten_into(tmp, "model")
            info["path"] = str(out)
        return info
    with atomic_dir(out, overwrite=force) as tmp:
        export = {
            "model_name_or_path": str(base),
            "adapter_name_or_path": str(adapter),
            "template": template,
            "finetuning_type": "lora",
            "trust_remote_code": True,
            "export_dir": str(tmp / "model"),
            "export_size": 5,
            "export_device": "cpu",
            "export_legacy_format": False,
        }
        cfg_path = atomic_write_text(tmp / lf.EXPORT_YAML, yaml.safe_dump(export, sort_keys=False))
        lf.run_llamafactory("export", cfg_path, python=lf.python_for(python),
                            log_path=tmp / "merge.log")
        info = verify_model_dir(tmp / "model")
        flatten_into(tmp, "model")
        info["path"] = str(out)
    return info
