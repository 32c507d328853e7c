"""Hugging Face model folders: check that one is complete and loads, and write one into place.

:func:`verify_model_dir` checks config, processor and weights: the weight names and shapes match
what the config's model class expects (on the meta device, so a 7B model costs no RAM) and, for
small models, a real forward pass. Merging (``pipelines.merge``, ``pipelines.sft.lora``) writes to
a temporary folder and renames it into place only after this check.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from pipelines.errors import UserError

# Models up to this many parameters also get a real forward pass (bigger ones: meta device only).
FULL_LOAD_MAX_PARAMS = 200_000_000


def load_vlm(path: str | Path, *, dtype: Any, what: str = "model",
             hint: str = "pass a local Hugging Face model folder") -> tuple[Any, Any]:
    """``(model, processor)`` of the vision-language model at ``path`` (a folder or a hub id)
    through transformers, on the CPU. What transformers refuses to load (an unreadable tokenizer,
    a config it has no image-text model class for, a field of the wrong type) is a UserError
    naming ``what`` and ``path``, not its traceback."""
    from huggingface_hub.errors import StrictDataclassError
    from transformers import AutoModelForImageTextToText, AutoProcessor

    try:
        processor = AutoProcessor.from_pretrained(path)
        model = AutoModelForImageTextToText.from_pretrained(path, dtype=dtype)
    except (OSError, ValueError, StrictDataclassError) as exc:
        lines = [line.strip() for line in str(exc).splitlines() if line.strip()] or \
            [type(exc).__name__]
        said = " ".join(lines[:2]) if lines[0].endswith(":") else lines[0]  # "field 'x': why"
        raise UserError(f"cannot load {what} '{path}': {said[:300]}", hint=hint) from None
    return model, processor


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


def refuse_existing(out: Path, force: bool) -> None:
    if out.exists() and any(out.iterdir()) and not force:
        raise UserError(f"output folder {out} exists and is not empty",
                        hint="pass --force to replace it, or another --out")


def flatten_into(tmp: Path, sub: str) -> None:
    """Move ``tmp/sub/*`` up into ``tmp`` (keeping the merge log and YAML beside the model)."""
    for item in (tmp / sub).iterdir():
        shutil.move(str(item), str(tmp / item.name))
    (tmp / sub).rmdir()
    (tmp / "merge_info.json").write_text(json.dumps({"merged_by": "pyvision merge"}) + "\n")


# Marks a peft LoRA adapter written by LoRA RL (the local engine's ``rl/adapter``): what it was
# trained on, so that the merge knows its base.
LORA_MARKER = "pyvision_lora.json"


# What a saved processor leaves in a model folder: transformers 5 writes one
# processor_config.json, hub checkpoints (and older versions) preprocessor_config.json.
PROCESSOR_FILES = ("processor_config.json", "preprocessor_config.json")


def has_processor(folder: str | Path) -> bool:
    """Whether ``folder`` holds a saved processor (either file name)."""
    return any((Path(folder) / f).is_file() for f in PROCESSOR_FILES)


def merge_peft(adapter: str | Path, base: str | Path, out: Path) -> Path:
    """``base`` with the peft LoRA ``adapter`` merged in, saved (with a processor) into ``out``."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForImageTextToText, AutoProcessor

    adapter = Path(adapter)
    model = AutoModelForImageTextToText.from_pretrained(
        str(base), dtype=torch.float32 if _small(base) else "auto")
    merged = PeftModel.from_pretrained(model, str(adapter)).merge_and_unload()
    merged.save_pretrained(out)
    source = adapter if has_processor(adapter) else base
    AutoProcessor.from_pretrained(str(source)).save_pretrained(out)
    return out


def _small(path: str | Path) -> bool:
    """Whether a local model's weights are small enough to merge in float32."""
    files = list(Path(path).glob("*.safetensors")) if Path(path).is_dir() else []
    return bool(files) and sum(f.stat().st_size for f in files) < 4 * FULL_LOAD_MAX_PARAMS
