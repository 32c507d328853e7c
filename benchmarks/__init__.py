"""Benchmarks: one class per benchmark (load, prompt, score, aggregate, validate).

The registry maps names to ``"module:Class"`` strings so that importing this package imports no
benchmark (nor ``datasets``, ``numpy`` or ``math_verify``); :func:`get_benchmark` imports the one
asked for. :func:`score_predictions` scores a JSONL of raw rows plus predictions made anywhere
(``pyvision eval score``).
"""

from __future__ import annotations

import difflib
import importlib
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipelines.errors import DataError, UserError

if TYPE_CHECKING:
    from benchmarks.base import Benchmark

BENCHMARKS: dict[str, str] = {
    "vstar": "benchmarks.vstar:VStar",
    "hrbench4k": "benchmarks.hrbench:HRBench4K",
    "hrbench8k": "benchmarks.hrbench:HRBench8K",
    "mathverse": "benchmarks.mathverse:MathVerse",
    "vsibench": "benchmarks.vsibench:VSIBench",
    "synth-image": "benchmarks.synth:SynthImage",
    "synth-video": "benchmarks.synth:SynthVideo",
}
"""Benchmark name -> ``"module:Class"``."""


def check_benchmark_name(name: str) -> str:
    """``name`` if it is a registered benchmark (imports nothing), else a UserError naming the
    closest."""
    if name not in BENCHMARKS:
        close = difflib.get_close_matches(name, list(BENCHMARKS), n=1, cutoff=0.5)
        hint = f"did you mean '{close[0]}'?" if close else f"known: {', '.join(BENCHMARKS)}"
        raise UserError(f"unknown benchmark '{name}'", hint=hint)
    return name


def benchmark_class(name: str) -> type[Benchmark]:
    """The class registered as ``name``; an unknown name is a UserError naming the closest."""
    module, _, cls = BENCHMARKS[check_benchmark_name(name)].partition(":")
    return getattr(importlib.import_module(module), cls)


def get_benchmark(name: str, **kwargs: Any) -> Benchmark:
    """An instance of benchmark ``name`` (kwargs go to its constructor, e.g. ``judge=``)."""
    import inspect

    cls = benchmark_class(name)
    try:
        inspect.signature(cls).bind(**kwargs)
    except TypeError as exc:
        raise UserError(f"benchmark '{name}' does not take {sorted(kwargs)} ({exc})",
                        hint="drop the option or pick another benchmark") from None
    return cls(**kwargs)


def score_predictions(name: str, predictions_path: Path | str, **kwargs: Any) -> dict[str, Any]:
    """Score a JSONL file of the benchmark's raw rows (minus media) each with a ``prediction``.

    Returns ``{"benchmark", "version", "n", "aggregate": {metric: value}, "per_sample":
    [{"id", "scores"}]}``. A malformed line, a row without ``prediction`` or a needed column,
    or a repeated id is a DataError with file and line.
    """
    from pipelines.core.records import iter_jsonl
    from pipelines.errors import malformed_json, require_file

    bench = get_benchmark(name, **kwargs)
    path = require_file(predictions_path, "predictions file",
                        hint="pass the JSONL written by the evaluation (one row per line)")
    samples = []
    seen: set[str] = set()
    for number, obj in iter_jsonl(path):
        where = f"{path}:{number}"
        if isinstance(obj, Exception):
            raise DataError(f"{where}: {malformed_json(obj)}", hint="fix or remove the line")
        if not isinstance(obj, dict):
            raise DataError(f"{where}: a line must be a JSON object", hint="write one row per line")
        if "prediction" not in obj:
            raise DataError(f"{where}: no 'prediction' field",
                            hint="add the final answer text as 'prediction' (null if none)")
        prediction = obj["prediction"]
        if prediction is not None and not isinstance(prediction, str):
            raise DataError(f"{where}: 'prediction' must be a string or null, "
                            f"not {type(prediction).__name__}", hint="write the answer as text")
        bench.check_columns(obj, where)
        try:
            task = bench.task_from_row(obj)
        except DataError as exc:
            raise DataError(f"{where}: {exc.message}", hint=exc.hint) from None
        if task.id in seen:
            raise DataError(f"{where}: duplicate id '{task.id}'", hint="keep one line per row")
        seen.add(task.id)
        samples.append((task, bench.score(task, prediction)))
    if not samples:
        raise DataError(f"{path} holds no predictions", hint="pass a non-empty JSONL file")
    return {"benchmark": bench.name, "version": bench.version, "n": len(samples),
            "aggregate": bench.aggregate(samples),
            "per_sample": [{"id": t.id, "scores": s} for t, s in samples]}


__all__ = ["BENCHMARKS", "benchmark_class", "get_benchmark", "score_predictions"]
