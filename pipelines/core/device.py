"""Where local models run: ``model.device`` and ``model.dtype`` resolved to torch's terms, the
same way for the local RL engine, the HF policy and the benchmarks."""

from __future__ import annotations

from typing import Any


def resolve_device(name: str) -> str:
    """``auto`` is ``cuda`` when torch sees a GPU, else ``cpu``."""
    import torch

    if name != "auto":
        return name
    return "cuda" if torch.cuda.is_available() else "cpu"


def torch_dtype(name: str, device: str) -> Any:
    """``model.dtype`` as a torch dtype; ``auto`` is bf16 on a GPU and fp32 on CPU."""
    import torch

    return {"auto": torch.bfloat16 if device == "cuda" else torch.float32,
            "float32": torch.float32, "bfloat16": torch.bfloat16,
            "float16": torch.float16}[name]
