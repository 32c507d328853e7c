"""Turn training outputs into plain Hugging Face models, and check that they load.

- A LoRA adapter (SFT with ``finetuning_type: lora``) is merged by LLaMA-Factory's own export
  (``llamafactory-cli export``), rendered as a YAML kept beside the output.
- A verl FSDP actor checkpoint (``<ckpt>/global_step_N/actor``) is merged by verl's own
  ``python -m verl.model_merger merge --backend fsdp``.

Either way the result is written to a temporary folder and renamed into place only after it has
been checked: config, processor and weights present, the weight names and shapes matching what the
config's model class expects (checked on the meta device, so a 7B model costs no RAM), and, for
small models, a real forward pass.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import yaml

from pipelines.errors import SubprocessFailed, UserError
from pipelines.fsutil import atomic_dir, atomic_write_text
from pipelines.sft import llamafactory as lf

FULL_LOAD_MAX_PARAMS = 200_000_000


def _weights_index(path: Path) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape from the safetensors headers (no tensor data is read)."""
    from safetensors import safe_open

    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise UserError(f"no *.safetensors weights in {path}",
                        hint="the merge did not produce a model; read its log")
    shapes: dict[str, tuple[int, ...]] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as fh:
            for key in fh.keys():  # noqa: SIM118 - a safetensors handle, not a dict
                shapes[key] = tuple(fh.get_slice(key).get_shape())
    return shapes


def verify_model_dir(path: str | Path, *, full_load: bool | None = None) -> dict[str, Any]:
    """Check that ``path`` is a loadable Qwen2.5-VL-style model; return what was checked."""
    import torch
    from transformers import AutoConfig, AutoModelForImageTextToText, AutoProcessor

    path = Path(path)
    if not (path / "config.json").is_file():
        raise UserError(f"{path} has no config.json", hint="pass a Hugging Face model folder")
    config = AutoConfig.from_pretrained(path)
    AutoProcessor.from_pretrained(path)
    with torch.device("meta"):
        model = AutoModelForImageTextToText.from_config(config)
    expected = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    on_disk = _weights_index(path)
    n_params = sum(p.numel() for p in model.parameters())
    missing = _unmatched(expected, on_disk, _tied_embeddings(config))
    if missing:
        raise UserError(f"{path}: weights do not match the model config ({missing[0]} and "
                        f"{len(missing) - 1} more missing or mis-shaped)",
                        hint="the merge produced an incomplete model; read its log")
    result = {"path": str(path), "model_type": config.model_type, "parameters": n_params,
              "tensors": len(on_disk), "full_load": False}
    if full_load is None:
        full_load = n_params <= FULL_LOAD_MAX_PARAMS
    if full_load:
        loaded = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32)
        ids = torch.tensor([[0, 1, 2, 3]])
        with torch.no_grad():
            logits = loaded(input_ids=ids).logits
        if not torch.isfinite(logits).all():
            raise UserError(f"{path}: the model's logits are not finite",
                            hint="the weights are corrupt; redo the merge")
        result["full_load"] = True
    return result


def _tied_embeddings(config: Any) -> bool:
    text = getattr(config, "text_config", None)
    return bool(getattr(config, "tie_word_embeddings", False)
                or getattr(text, "tie_word_embeddings", False))


def _canonical_key(key: str) -> str:
    """One name per tensor across transformers' checkpoint layouts.

    transformers 5 saves Qwen2.5-VL as ``model.language_model.*`` / ``model.visual.*``; checkpoints
    written by transformers 4 (the hub's Qwen2.5-VL-7B-Instruct) use ``model.*`` / ``visual.*``.
    """
    return key.replace("model.language_model.", "model.").replace("model.visual.", "visual.")


def _unmatched(expected: dict[str, tuple[int, ...]], on_disk: dict[str, tuple[int, ...]],
               tied: bool) -> list[str]:
    """Names of expected tensors that are absent from disk or have another shape."""
    disk = {_canonical_key(k): v for k, v in on_disk.items()}
    bad = []
    for name, shape in expected.items():
        if tied and name.endswith("lm_head.weight"):
            continue  # tied to the input embeddings, not saved separately
        if disk.get(_canonical_key(name)) != shape:
            bad.append(name)
    return bad


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
    _refuse_existing(out, force)
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
        _flatten_into(tmp, "model")
        info["path"] = str(out)
    return info


def merge_verl(checkpoint: str | Path, out: str | Path, *, python: str = "python",
               force: bool = False) -> dict[str, Any]:
    """Merge a verl FSDP actor checkpoint with ``verl.model_merger``; verify; return info."""
    ckpt = Path(checkpoint)
    actor = _find_actor_dir(ckpt)
    out = Path(out)
    _refuse_existing(out, force)
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
            kept = out.parent / f"{out.name}.merge-failed.log"
            shutil.copy(log_path, kept)
            raise SubprocessFailed(f"verl.model_merger exited with code {proc.returncode} on {actor}; "
                                   f"log: {kept}", hint="check that the checkpoint is complete")
        info = verify_model_dir(tmp / "model")
        _flatten_into(tmp, "model")
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


def _refuse_existing(out: Path, force: bool) -> None:
    if out.exists() and any(out.iterdir()) and not force:
        raise UserError(f"output folder {out} exists and is not empty",
                        hint="pass --force to replace it, or another --out")


def _flatten_into(tmp: Path, sub: str) -> None:
    """Move ``tmp/sub/*`` up into ``tmp`` (keeping the merge log and YAML beside the model)."""
    for item in (tmp / sub).iterdir():
        shutil.move(str(item), str(tmp / item.name))
    (tmp / sub).rmdir()
    (tmp / "merge_info.json").write_text(json.dumps({"merged_by": "pyvision merge"}) + "\n")
