"""Typed, frozen recipe models (pydantic v2 only; importing this package never imports torch)."""

from pipelines.config.base import Section
from pipelines.config.loader import dump_config, load_config

__all__ = ["Section", "dump_config", "load_config"]
