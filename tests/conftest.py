"""Shared fixtures. Tests are offline and CPU-only unless marked (see pyproject.toml markers)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# Nothing in the default test run may touch a hub or a tracker; set before any HF import.
for _key, _value in {
    "HF_HUB_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "WANDB_MODE": "disabled",
    "TOKENIZERS_PARALLELISM": "false",
    "MPLBACKEND": "Agg",
}.items():
    os.environ.setdefault(_key, _value)


@pytest.fixture(autouse=True)
def _isolated_store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Each test gets its own store file, never the user's runs/pyvision.duckdb."""
    path = tmp_path / "store.duckdb"
    monkeypatch.setenv("PYVISION_STORE", str(path))
    return path


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A nano tiny Qwen2.5-VL built once per test session (offline, deterministic)."""
    from pipelines.models.tiny import build_tiny_model

    out = tmp_path_factory.mktemp("tiny-nano") / "model"
    build_tiny_model(out, size="nano", seed=0)
    return out


@pytest.fixture(scope="session")
def tiny_qwen3_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A nano tiny Qwen3-VL (its processor and chat template), sharing the nano tokenizer."""
    from pipelines.models.tiny import build_tiny_model

    out = tmp_path_factory.mktemp("tiny-nano-qwen3") / "model"
    build_tiny_model(out, size="nano", seed=0, arch="qwen3_vl", tokenizer_from=tiny_model_dir)
    return out
