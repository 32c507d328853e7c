"""Base class for config sections and the rules every field follows.

Every config model in the project derives from :class:`Section`: frozen (a resolved config is a
value, never mutated), ``extra="forbid"`` (an unknown key is an error), and attribute docstrings
become field descriptions, so the documentation of a field lives where it is declared.
``tests/pipelines/config/test_config.py`` checks that every field of every section has a
description and that every numeric field has bounds.

A boolean is never a number here: pydantic's lax mode reads ``true`` as 1 for an ``int`` field
(and 1.0 for a ``float``), so ``--set agent.max_turns_eval=true`` or a YAML ``yes`` silently
became one turn. :meth:`Section._no_bool_for_numbers` refuses it for every field of every section
(inside lists, tuples and dict values too), while everything else lax mode accepts stays accepted:
an int for a float field (``learning_rate: 1``), a numeric string (``"5"``), a string for a
``Literal``. A fraction for an ``int`` field is refused by pydantic itself.

This module imports only pydantic: the CLI builds configs before deciding whether to import torch.
"""

from __future__ import annotations

import types
import typing
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationInfo, field_validator
from pydantic_core import PydanticCustomError

_UNIONS = (typing.Union, types.UnionType)


def _bool_for_number(annotation: Any, value: Any) -> str | None:
    """``"integer"``/``"number"`` when ``value`` holds a bool where ``annotation`` wants that and
    accepts no bool; else None (pydantic judges the rest)."""
    origin = typing.get_origin(annotation)
    if origin is typing.Annotated:
        return _bool_for_number(typing.get_args(annotation)[0], value)
    if origin in _UNIONS:
        args = typing.get_args(annotation)
        if any(a is bool or a is Any or a is object for a in args):
            return None
        for arg in args:
            if (found := _bool_for_number(arg, value)) is not None:
                return found
        return None
    if isinstance(value, bool):
        return {int: "integer", float: "number"}.get(annotation)
    args = typing.get_args(annotation)
    if origin in (list, set, frozenset) and isinstance(value, (list, tuple, set, frozenset)) \
            and args:
        return next((f for v in value if (f := _bool_for_number(args[0], v))), None)
    if origin is tuple and isinstance(value, (list, tuple)) and args:
        items = args[:1] * len(value) if len(args) == 2 and args[1] is Ellipsis else args
        return next((f for a, v in zip(items, value) if (f := _bool_for_number(a, v))), None)
    if origin is dict and isinstance(value, dict) and len(args) == 2:
        return next((f for v in value.values() if (f := _bool_for_number(args[1], v))), None)
    return None


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

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_for_numbers(cls, value: Any, info: ValidationInfo) -> Any:
        """Refuse true/false for a number (lax mode would read it as 1/0)."""
        field = cls.model_fields.get(info.field_name or "")
        if field is not None and (kind := _bool_for_number(field.annotation, value)):
            raise PydanticCustomError(
                "bool_for_number",
                "Input should be a valid {kind}, got a boolean (YAML reads true/false, yes/no, "
                "on/off as booleans)", {"kind": kind})
        return value
