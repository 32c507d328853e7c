"""Base class for config sections and the rules every field follows.

Every config model in the project derives from :class:`Section`: frozen (a resolved config is a
value, never mutated), ``extra="forbid"`` (an unknown key is an error), and attribute docstrings
become field descriptions, so the documentation of a field lives where it is declared.
``tests/pipelines/config/test_config.py`` checks that every field of every section has a
description and that every numeric field has bounds.

This module imports only pydantic: the CLI builds configs before deciding whether to import torch.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Section(BaseModel):
    """A frozen, strictly-keyed, self-documenting config section."""

    model_config = ConfigDict(
        frozen=True,
        extra="forbid",
        use_attribute_docstrings=True,
        validate_default=True,
        protected_namespaces=(),
        allow_inf_nan=False,  # .nan / .inf: "a finite number", not a misleading bound
    )
