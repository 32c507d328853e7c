"""Load a recipe: YAML file + repeated ``--set dotted.key=value`` overrides -> a frozen model.

Unknown keys are caught here, before pydantic, so the error can name the closest valid key
(``unknown key 'rl.lerning_rate' in recipe.yaml; did you mean 'rl.learning_rate'?``). Values of
``--set`` are parsed as YAML scalars/flow collections, so ``--set rl.lr=1e-6``,
``--set eval.benchmarks=[vstar,hrbench4k]`` and ``--set sft.lora=null`` all do what they say.
"""

from __future__ import annotations

import copy
import difflib
import re
import types
import typing
from collections.abc import Iterable
from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ValidationError

from pipelines.errors import ConfigError

M = TypeVar("M", bound=BaseModel)


def _model_of(annotation: Any) -> type[BaseModel] | None:
    """The BaseModel class inside an annotation such as ``Foo``, ``Foo | None``, ``Optional[Foo]``."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        models = [m for a in typing.get_args(annotation) if (m := _model_of(a)) is not None]
        return models[0] if len(models) == 1 else None
    return None


def _valid_keys(model: type[BaseModel], prefix: str = "") -> list[str]:
    keys: list[str] = []
    for name, field in model.model_fields.items():
        dotted = f"{prefix}{name}"
        keys.append(dotted)
        sub = _model_of(field.annotation)
        if sub is not None:
            keys.extend(_valid_keys(sub, dotted + "."))
    return keys


# Keys that moved, old -> new: a recipe that still uses the old one is told where it went.
MOVED_KEYS = {"rl.verl.val_tasks": "rl.val_tasks",
              "rl.local.weight_decay": "rl.optimizer.weight_decay",
              "rl.local.grad_clip": "rl.optimizer.grad_clip"}


def check_unknown_keys(model: type[BaseModel], data: Any, source: str, prefix: str = "") -> None:
    """Raise ConfigError for the first key in ``data`` that ``model`` does not declare."""
    if not isinstance(data, dict):
        return
    fields = model.model_fields
    aliases = {f.alias: n for n, f in fields.items() if f.alias}
    for key, value in data.items():
        name = aliases.get(key, key)
        if name not in fields:
            dotted = f"{prefix}{key}"
            candidates = _valid_keys(model, prefix)
            close = difflib.get_close_matches(dotted, candidates, n=1, cutoff=0.5)
            if not close:
                close = difflib.get_close_matches(str(key), list(fields), n=1, cutoff=0.5)
                close = [f"{prefix}{c}" for c in close]
            hint = f"did you mean '{close[0]}'?" if close else (
                f"valid keys here: {', '.join(sorted(fields))}")
            if dotted in MOVED_KEYS:
                hint = f"it moved to '{MOVED_KEYS[dotted]}'"
            raise ConfigError(f"unknown config key '{dotted}' in {source}; {hint}",
                              hint="rename or remove the key")
        sub = _model_of(fields[name].annotation)
        if sub is not None and isinstance(value, dict):
            check_unknown_keys(sub, value, source, f"{prefix}{name}.")


def parse_override(item: str) -> tuple[list[str], Any]:
    """``"a.b.c=VALUE"`` -> (["a", "b", "c"], parsed VALUE)."""
    if "=" not in item:
        raise ConfigError(f"--set expects dotted.key=value, got '{item}'",
                          hint="write e.g. --set rl.learning_rate=1e-6")
    key, raw = item.split("=", 1)
    key = key.strip()
    if not key or any(not part for part in key.split(".")):
        raise ConfigError(f"--set has an empty key in '{item}'", hint="write e.g. --set rl.n=8")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except (yaml.YAMLError, ValueError):  # ValueError: an integer past Python's 4300 digits
        value = raw
    return key.split("."), value


def apply_overrides(data: dict[str, Any], overrides: Iterable[str]) -> dict[str, Any]:
    """Return a copy of ``data`` with each ``dotted.key=value`` applied in order."""
    out = copy.deepcopy(data)
    for item in overrides:
        path, value = parse_override(item)
        node = out
        for part in path[:-1]:
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            if not isinstance(child, dict):
                raise ConfigError(f"--set {item}: '{part}' is a value, not a section",
                                  hint="override the whole value or a key of a section")
            node = child
        node[path[-1]] = value
    return out


def read_yaml(path: str | Path) -> dict[str, Any]:
    from pipelines.inputs import read_text

    p = Path(path)
    if not p.exists():
        raise ConfigError(f"config file not found: {p}",
                          hint="pass an existing recipe file, e.g. pipelines/recipes/tiny-cpu.yaml")
    text = read_text(p, "config file", hint="pass a recipe YAML file, e.g. -c "
                     "pipelines/recipes/tiny-cpu.yaml")
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{p}:{mark.line + 1}" if mark is not None else str(p)
        raise ConfigError(f"invalid YAML in {where}: {getattr(exc, 'problem', exc)}",
                          hint="fix the YAML syntax") from None
    except ValueError as exc:  # e.g. an integer past Python's 4300-digit limit
        raise ConfigError(f"invalid value in {p}: {str(exc).splitlines()[0][:200]}",
                          hint="fix the value") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{p} must hold a mapping of config keys, not {type(data).__name__}",
                          hint="start the file with top-level keys such as 'name:'")
    return data


def validate(model: type[M], data: dict[str, Any], source: str) -> M:
    """Validate ``data`` into ``model`` with one-line, located errors."""
    check_unknown_keys(model, data, source)
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        errors = exc.errors()
        path, msg, used = _first_error(errors)
        loc = ".".join(str(p) for p in path) or "(top level)"
        more = f" (and {len(errors) - used} more)" if len(errors) > used else ""
        raise ConfigError(f"invalid value for '{loc}' in {source}: {msg}{more}",
                          hint=f"set a valid '{loc}' in the file or with --set {loc}=VALUE") from None


def _first_error(errors: list[Any]) -> tuple[tuple, str, int]:
    """(location, message, errors it stands for) of the first validation error. A value that
    matches no member of a union (``bool | int | float | str``) fails once per member, each
    located with the member's tag appended (``args.x.int``): those read as one error at the
    value's own location, whose message names what each member wanted."""
    first = errors[0]
    loc = tuple(first["loc"])
    members = [e for e in errors if tuple(e["loc"][:-1]) == loc[:-1] and len(e["loc"]) == len(loc)
               and _UNION_TAG.match(str(e["loc"][-1])) and e.get("input") is first.get("input")]
    if len(loc) > 1 and len(members) > 1:
        wants = [e["msg"].removeprefix("Input should be ") for e in members]
        return (loc[:-1], "Input should be " + ", ".join(wants[:-1]) + " or " + wants[-1],
                len(members))
    return loc, first["msg"], 1


# How pydantic tags a union member in an error's location: a type's name (``int``,
# ``list[str]``, ``function-after[...]``) or a model's class name; config keys are snake_case.
_UNION_TAG = re.compile(r"^(bool|int|float|str|bytes|none|list|dict|tuple|set|frozenset|literal"
                        r"|function-\w+|[A-Z]\w*)(\[.*\])?$")


def load_config(model: type[M], path: str | Path | None, overrides: Iterable[str] = (),
                defaults: dict[str, Any] | None = None) -> M:
    """Load ``path`` (or ``defaults`` when None), apply overrides, validate into ``model``."""
    overrides = list(overrides)
    data = read_yaml(path) if path is not None else copy.deepcopy(defaults or {})
    source = str(path) if path is not None else "the default recipe"
    if overrides:
        source += " with --set " + " ".join(overrides)
    return validate(model, apply_overrides(data, overrides), source)


def dump_config(config: BaseModel) -> str:
    """The resolved config as YAML (every field, defaults included), for run directories."""
    return yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False, allow_unicode=True)
