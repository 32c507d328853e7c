"""Merge a LoRA adapter into its base model with LLaMA-Factory's own export.

The export is rendered as a YAML kept beside the output (``llamafactory-cli export``); the result
is checked (:func:`pipelines.core.modeldir.verify_model_dir`) before it is moved into place.
An adapter of LoRA RL (marked by :data:`pipelines.core.modeldir.LORA_MARKER`) was made by peft
with the processor saved beside it, and is merged with peft in this process instead.
"""

from __future__ import annotations

import re
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
from pipelines.errors import SubprocessFailed, UserError
from pipelines.fsutil import atomic_dir, atomic_write_text, keep_failed_log
from pipelines.inputs import check_model, read_json, read_text, safetensors_problem
from pipelines.sft import llamafactory as lf

# Model types whose LLaMA-Factory chat template is unambiguous. Qwen3-VL is not among them: its
# Instruct and Thinking checkpoints share a model type and need different templates.
_TEMPLATE_OF_MODEL_TYPE = {"qwen2_vl": "qwen2_vl", "qwen2_5_vl": "qwen2_vl"}


def adapter_template(adapter: Path, base: str | Path) -> str:
    """The chat template an SFT adapter was trained with: the one in its run's rendered training
    YAML (``<run>/sft/llamafactory_train.yaml``, or LLaMA-Factory's web UI ``training_args.yaml``
    in the adapter folder), else the one a Qwen2-VL / Qwen2.5-VL base implies. A wrong template
    merges without error and gives a model that was trained on one prompt format and is served
    another, so anything else is a question for the user."""
    for path in (adapter.parent / lf.TRAIN_YAML, adapter / "training_args.yaml"):
        if path.is_file():
            try:
                args = yaml.safe_load(read_text(path, "training YAML")) or {}
            except yaml.YAMLError as exc:
                raise UserError(f"{path} is not valid YAML ({exc.__class__.__name__})",
                                hint="repair or remove it, or pass --template") from None
            if isinstance(args, dict) and args.get("template"):
                return str(args["template"])
    config = Path(str(base)) / "config.json"
    parsed = read_json(config, "base model's config", hint="restore the base model's config.json, "
                       "or pass --template") if config.is_file() else None
    model_type = parsed.get("model_type") if isinstance(parsed, dict) else None
    if model_type is None and re.search(r"Qwen2(\.5)?-VL", str(base)):
        model_type = "qwen2_5_vl"
    if model_type in _TEMPLATE_OF_MODEL_TYPE:
        return _TEMPLATE_OF_MODEL_TYPE[model_type]
    raise UserError(f"cannot tell which chat template {adapter} was trained with (base {base}, "
                    f"model type {model_type or 'unknown'})",
                    hint="pass --template, as in the SFT recipe's sft.template: qwen2_vl for "
                         "Qwen2-VL / Qwen2.5-VL, qwen3_vl_nothink for Qwen3-VL Instruct, qwen3_vl "
                         "for Qwen3-VL Thinking")


def check_adapter(adapter: Path) -> None:
    """``adapter`` holds an ``adapter_config.json`` that peft can load: a JSON object with a LORA
    ``peft_type`` and a positive rank ``r``. Checked before merging, so a broken file is one line
    that names it, not LLaMA-Factory's traceback."""
    config = adapter / "adapter_config.json"
    if not config.is_file():
        raise UserError(f"{adapter} is not a LoRA adapter (no adapter_config.json)",
                        hint="pass the SFT output folder of a finetuning_type: lora run")
    fix = "restore it from the run that trained the adapter (peft writes it beside the weights)"
    parsed = read_json(config, "adapter config", hint=fix)
    if not isinstance(parsed, dict):
        raise UserError(f"{config} is not a JSON object", hint=fix)
    missing = [key for key in ("peft_type", "r") if key not in parsed]
    if missing:
        raise UserError(f"{config} has no '{missing[0]}' (a LoRA adapter's config names its "
                        "peft_type and rank r)", hint=fix)
    if parsed["peft_type"] != "LORA":
        raise UserError(f"{config}: peft_type is {parsed['peft_type']!r}, not 'LORA'",
                        hint="pass a LoRA adapter (other peft methods cannot be merged here)")
    if type(parsed["r"]) is not int or parsed["r"] < 1:
        raise UserError(f"{config}: the rank r is {parsed['r']!r}, not a positive integer",
                        hint=fix)
    weights = [adapter / n for n in ("adapter_model.safetensors", "adapter_model.bin")
               if (adapter / n).is_file()]
    if not weights:
        raise UserError(f"{adapter} has no adapter weights (adapter_model.safetensors)", hint=fix)
    if weights[0].suffix == ".safetensors" and (problem := safetensors_problem(weights[0])):
        raise UserError(f"{adapter}: {problem}", hint=fix)


def merge_lora(adapter: str | Path, base: str | Path, out: str | Path, *, python: str = "python",
               template: str | None = None, force: bool = False) -> dict[str, Any]:
    """Merge a LoRA adapter into its base model with LLaMA-Factory's export; verify; return info.
    ``template`` is the LLaMA-Factory chat template of the SFT run (:func:`adapter_template`
    when not given)."""
    # LLaMA-Factory runs in the output's temp folder: the local paths it is given are absolute.
    adapter, out = Path(adapter).absolute(), Path(out).absolute()
    check_adapter(adapter)
    if Path(str(base)).exists():
        base = Path(base).absolute()
        check_model(str(base), "base model")
    elif str(base).count("/") != 1:
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
    template = template or adapter_template(adapter, base)
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
        try:
            lf.run_llamafactory("export", cfg_path, python=lf.python_for(python),
                                log_path=tmp / "merge.log")
        except SubprocessFailed:
            kept = keep_failed_log(tmp / "merge.log", out)
            raise SubprocessFailed(f"LLaMA-Factory export could not merge {adapter} into {base}; "
                                   f"log: {kept}",
                                   hint="read the log tail above; check that the adapter was "
                                        "trained on this base model with this chat template "
                                        "(--template)") from None
        info = verify_model_dir(tmp / "model")
        flatten_into(tmp, "model")
        info["path"] = str(out)
    return info
