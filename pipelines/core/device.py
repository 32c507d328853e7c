"""Where local models run: ``model.device`` and ``model.dtype`` resolved to torch's terms, the
same way for the local RL engine, the HF policy and the benchmarks."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any


def resolve_device(name: str) -> str:
    """``auto`` is ``cuda`` when torch sees a GPU, else ``cpu``; ``cuda`` where torch sees none
    is a clear error, not torch's at the first tensor moved there."""
    import torch

    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        from pipelines.errors import UserError

        raise UserError("device 'cuda' asked for, but torch sees no GPU on this machine",
                        hint="use model.device=cpu or auto (`pyvision perf rl --device cpu`), or "
                             "run where `pyvision doctor` lists a GPU")
    return name


def torch_dtype(name: str, device: str) -> Any:
    """``model.dtype`` as a torch dtype; ``auto`` is bf16 on a GPU and fp32 on CPU."""
    import torch

    return {"auto": torch.bfloat16 if device == "cuda" else torch.float32,
            "float32": torch.float32, "bfloat16": torch.bfloat16,
            "float16": torch.float16}[name]


def synchronize(model: Any) -> None:
    """Wait for the work queued on ``model``'s GPU (nothing to wait for on a CPU), so that a
    phase's wall time counts its kernels and copies, not only their launches."""
    import torch

    device = next(model.parameters()).device
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@contextlib.contextmanager
def cpu_threads(n: int) -> Iterator[None]:
    """torch's CPU threads set to ``n`` inside the block and restored after it (0: unchanged)."""
    import torch

    before = torch.get_num_threads()
    if not n or n == before:
        yield
        return
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def free_memory_bytes(device: str) -> int | None:
    """Memory free for new tensors on ``device``: the GPU's free memory, or the host's
    ``MemAvailable``; None where it cannot be told."""
    if device == "cuda":
        import torch

        return int(torch.cuda.mem_get_info()[0])
    try:
        with open("/proc/meminfo", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None
