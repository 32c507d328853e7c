"""The stderr console shared by the CLI and the pipelines (stdout stays for data)."""

from __future__ import annotations

from rich.console import Console

err = Console(stderr=True, highlight=False)
