"""Reading benchmark rows from the Hugging Face hub or a local copy, and caching their media.

Accepted local layouts for ``--data-dir`` (the same columns as the hub dataset in every case):

* the output of ``datasets.Dataset.save_to_disk`` or ``DatasetDict.save_to_disk`` (the folder
  itself, or a sub-folder named after the split or config);
* data files anywhere under the folder: ``*.parquet`` (as on the hub), ``*.jsonl``, ``*.json``
  (a list of rows) or ``*.tsv`` (VLMEvalKit style, e.g. HR-Bench's ``hr_bench_4k.tsv``). When
  file paths name the split (``hrbench_4k``, ``test``), only those files are read; files that
  name another split or configuration are skipped; when several formats are present, only the
  first of parquet, jsonl, json, tsv is read (a hub snapshot may hold the same rows twice).

Images may be stored inline (``{"bytes", "path"}`` structs as ``datasets`` writes them, base64
strings, data URLs, decoded PIL images) or as paths relative to the data file. Inline images are
written once, content-addressed, under ``<cache_dir>/<benchmark>/media/``; files that already
exist on disk are used where they are. Tasks carry absolute paths.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import json
import math
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipelines.errors import DataError, UserError, malformed_json

DATA_SUFFIXES = (".parquet", ".jsonl", ".json", ".tsv")
# Files that our own tools write next to data; never rows of a benchmark.
_OWN_FILES = {"tasks.jsonl", "manifest.json", "dataset_info.json", "state.json",
              "dataset_dict.json", "conversations.jsonl", "predictions.jsonl"}
HUB_TIMEOUT_S = 8.0


def default_cache_dir() -> Path:
    """``$PYVISION_CACHE/benchmarks``, else ``~/.cache/pyvision/benchmarks``."""
    root = os.environ.get("PYVISION_CACHE") or os.path.join("~", ".cache", "pyvision")
    return Path(root).expanduser() / "benchmarks"


@dataclass(frozen=True)
class RowSource:
    """Where a benchmark's rows live: a hub dataset and the hints that find its local files."""

    hf_id: str
    hf_config: str | None
    split: str
    include_hints: tuple[str, ...] = ()
    """Lower-case substrings of a file path that mark it as this split's data."""
    exclude_hints: tuple[str, ...] = ()
    """Substrings that mark a file as another split or configuration."""
    download_name: str = ""
    """The ``pyvision data download`` name that fetches this dataset."""


@dataclass(frozen=True)
class Row:
    """One raw dataset row and where it came from (for error messages and relative media)."""

    values: dict[str, Any]
    where: str
    base_dir: Path


# -- local copies --------------------------------------------------------------------------------


def _is_saved_dataset(folder: Path) -> bool:
    return (folder / "dataset_dict.json").is_file() or (folder / "state.json").is_file()


def _saved_dataset_rows(folder: Path, source: RowSource) -> Iterator[Row]:
    import datasets

    loaded = datasets.load_from_disk(str(folder))
    if isinstance(loaded, datasets.DatasetDict):
        if source.split in loaded:
            loaded = loaded[source.split]
        elif len(loaded) == 1:
            loaded = next(iter(loaded.values()))
        else:
            raise DataError(f"{folder} holds splits {sorted(loaded)} but not '{source.split}'",
                            hint=f"save the '{source.split}' split of {source.hf_id}")
    yield from _dataset_rows(loaded, str(folder), folder)


def _dataset_rows(ds: Any, where: str, base_dir: Path) -> Iterator[Row]:
    """Rows of a ``datasets.Dataset`` with image columns left as encoded bytes (no re-encoding)."""
    import datasets

    for name, feature in ds.features.items():
        if isinstance(feature, datasets.Image) and feature.decode:
            ds = ds.cast_column(name, datasets.Image(decode=False))
    for i, values in enumerate(ds):
        yield Row(dict(values), f"{where}[{i}]", base_dir)


def data_files(data_dir: Path, source: RowSource) -> list[Path]:
    """The data files under ``data_dir`` that hold ``source``'s split (see module docstring)."""
    found = []
    for path in sorted(data_dir.rglob("*")):
        rel = path.relative_to(data_dir)
        if (not path.is_file() or path.suffix.lower() not in DATA_SUFFIXES
                or path.name in _OWN_FILES or any(part.startswith(".") for part in rel.parts)
                or "media" in rel.parts[:-1]):
            continue
        found.append(path)

    def named(path: Path, hints: tuple[str, ...]) -> bool:
        text = str(path.relative_to(data_dir)).lower()
        return any(h in text for h in hints)

    kept = [p for p in found if not named(p, source.exclude_hints)]
    chosen = [p for p in kept if named(p, source.include_hints)] or kept
    # One format only: a hub snapshot of HR-Bench holds the same rows as parquet and as tsv.
    for suffix in DATA_SUFFIXES:
        same = [p for p in chosen if p.suffix.lower() == suffix]
        if same:
            return same
    return []


def clean_value(value: Any) -> Any:
    """JSON-safe copies of row values (NaN from pandas becomes None)."""
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, dict):
        return {str(k): clean_value(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [clean_value(v) for v in value]
    if hasattr(value, "item") and not isinstance(value, (bytes, str)):
        try:
            return clean_value(value.item())  # numpy scalar
        except (TypeError, ValueError):
            return value
    return value


def parquet_rows(path: Path) -> Iterator[dict[str, Any]]:
    """The rows of a parquet file, read in batches; a file pyarrow cannot read (truncated by a
    broken download, or not parquet at all) is a DataError naming it, wherever it breaks."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        # Batches keep memory bounded: HR-Bench 8K parquet holds gigabytes of base64 images.
        for batch in pq.ParquetFile(path).iter_batches(batch_size=32):
            yield from batch.to_pylist()
    except (pa.ArrowException, OSError) as exc:
        text = str(exc).strip()
        reason = text.splitlines()[0].split(". ")[0].rstrip(".") if text else type(exc).__name__
        raise DataError(f"{path} is not a readable parquet file ({reason})",
                        hint="download it again (the copy is corrupt or truncated), or remove "
                             "it if it is not part of the dataset") from None


def json_records(path: Path) -> list[Any]:
    """The records of a ``.json`` data file: the file's list, or the first list among the values
    of its top-level object (``{"data": [...]}``); malformed JSON is a DataError at its line."""
    from pipelines.inputs import read_json

    data = read_json(path, "data file", "fix the file or download it again", error=DataError)
    if isinstance(data, dict):
        data = next((v for v in data.values() if isinstance(v, list)), [])
    return data if isinstance(data, list) else []


def _file_rows(path: Path) -> Iterator[Row]:
    suffix = path.suffix.lower()
    base = path.parent
    if suffix == ".parquet":
        for index, values in enumerate(parquet_rows(path), start=1):
            yield Row(values, f"{path}:{index}", base)
    elif suffix == ".jsonl":
        from pipelines.core.records import iter_jsonl

        for number, values in iter_jsonl(path):
            if isinstance(values, json.JSONDecodeError):
                raise DataError(f"{path}:{number}: {malformed_json(values)}",
                                hint="fix or remove the line")
            if not isinstance(values, dict):
                raise DataError(f"{path}:{number}: a row must be a JSON object",
                                hint="write one object per line")
            yield Row(values, f"{path}:{number}", base)
    elif suffix == ".json":
        for i, values in enumerate(json_records(path)):
            if isinstance(values, dict):
                yield Row(values, f"{path}[{i}]", base)
    elif suffix == ".tsv":
        import pandas as pd

        index = 0
        for chunk in pd.read_csv(path, sep="\t", chunksize=64, keep_default_na=True):
            for values in chunk.to_dict(orient="records"):
                index += 1
                # +1: the header is the file's first line.
                yield Row({str(k): clean_value(v) for k, v in values.items()},
                          f"{path}:{index + 1}", base)


def local_rows(data_dir: Path, source: RowSource, name: str) -> Iterator[Row]:
    """Rows of ``source``'s split from a local copy in any accepted layout."""
    data_dir = Path(data_dir).expanduser()
    if not data_dir.is_dir():
        raise UserError(f"--data-dir {data_dir} is not a folder",
                        hint=f"pass the folder holding a copy of {source.hf_id} for '{name}'")
    for folder in (data_dir, data_dir / source.split, data_dir / (source.hf_config or "-"),
                   data_dir / name):
        if folder.is_dir() and _is_saved_dataset(folder):
            yield from _saved_dataset_rows(folder, source)
            return
    files = data_files(data_dir, source)
    if not files:
        raise DataError(f"no data for '{name}' under {data_dir} (looked for a saved dataset and "
                        f"for {', '.join('*' + s for s in DATA_SUFFIXES)} files)",
                        hint=f"copy {source.hf_id} (split {source.split}) there, e.g. with "
                             f"`pyvision data download {source.download_name or name}` on a "
                             f"machine with internet")
    for path in files:
        yield from _file_rows(path)


# -- the hub -------------------------------------------------------------------------------------


def _offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def hub_unreachable_reason(hf_id: str, timeout_s: float = HUB_TIMEOUT_S) -> str | None:
    """None when the hub answers for ``hf_id`` within ``timeout_s``, else why it did not."""
    from huggingface_hub import HfApi

    try:
        HfApi(endpoint=os.environ.get("HF_ENDPOINT")).dataset_info(hf_id, timeout=timeout_s)
    except Exception as exc:  # noqa: BLE001 - any failure to answer means "unreachable"
        text = str(exc).splitlines()[0][:160] if str(exc) else ""
        return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
    return None


def no_hub_error(name: str, source: RowSource, reason: str) -> UserError:
    """The error for a benchmark that cannot be loaded from the hub: what, and both routes."""
    return UserError(
        f"cannot load benchmark '{name}' from the Hugging Face hub ({source.hf_id}): {reason}",
        hint=f"pass --data-dir DIR holding a local copy of {source.hf_id} (made with `pyvision "
             f"data download {source.download_name or name}` on a machine with internet), or "
             f"set HF_HUB_OFFLINE=1 if it is already in the Hugging Face cache")


def hub_rows(source: RowSource, name: str, *, limit: int | None,
             timeout_s: float = HUB_TIMEOUT_S) -> Iterator[Row]:
    """Rows from ``datasets.load_dataset``; fails within ``timeout_s`` when the hub is unreachable.

    With ``HF_HUB_OFFLINE`` set, only the local Hugging Face cache is tried (no network).
    """
    if not _offline():
        reason = hub_unreachable_reason(source.hf_id, timeout_s)
        if reason is not None:
            raise no_hub_error(name, source, reason)
    import datasets
    import httpx

    try:
        ds = datasets.load_dataset(source.hf_id, source.hf_config, split=source.split)
    except (OSError, httpx.HTTPError, datasets.exceptions.DatasetsError) as exc:
        text = str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__
        raise no_hub_error(name, source, text) from exc
    if limit is not None:
        ds = ds.select(range(min(limit, len(ds))))
    where = f"{source.hf_id}:{source.split}"
    yield from _dataset_rows(ds, where, Path.cwd())


# -- media ---------------------------------------------------------------------------------------


def write_bytes_atomic(path: Path, data: bytes) -> Path:
    """Write through a temp file and a rename, so a reader never sees a half-written file."""
    import tempfile

    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def _is_file(path: Path) -> bool:
    """``path.is_file()`` that is False, not an error, for names the OS rejects as too long."""
    try:
        return path.is_file()
    except OSError:
        return False


class MediaStore:
    """Writes inline images once, named by content hash, under ``root``; returns absolute paths."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root).expanduser().resolve()

    def _write(self, data: bytes, where: str) -> str:
        from PIL import Image, UnidentifiedImageError

        try:
            with Image.open(io.BytesIO(data)) as img:
                fmt = (img.format or "png").lower()
        except (UnidentifiedImageError, Image.DecompressionBombError, OSError) as exc:
            raise DataError(f"{where}: the image cannot be decoded ({type(exc).__name__})",
                            hint="download the dataset again; the file may be truncated") from None
        ext = {"jpeg": "jpg"}.get(fmt, fmt)
        path = self.root / f"{hashlib.sha1(data).hexdigest()[:20]}.{ext}"
        if not (path.is_file() and path.stat().st_size == len(data)):
            write_bytes_atomic(path, data)
        return str(path)

    def image(self, value: Any, row: Row, column: str) -> str | None:
        """An absolute image path for a row's image value, or None when the row has no image."""
        where = f"{row.where} column '{column}'"
        if value is None:
            return None
        if isinstance(value, dict):
            if value.get("bytes"):
                return self._write(bytes(value["bytes"]), where)
            return self._existing(value.get("path"), row, where) if value.get("path") else None
        if isinstance(value, (bytes, bytearray)):
            return self._write(bytes(value), where) if value else None
        if hasattr(value, "save"):  # a decoded PIL image
            buf = io.BytesIO()
            value.save(buf, format=getattr(value, "format", None) or "PNG")
            return self._write(buf.getvalue(), where)
        if isinstance(value, str):
            text = value.strip()
            if not text:
                return None
            if len(text) < 1024 and _is_file(row.base_dir / text):
                return str((row.base_dir / text).resolve())
            if text.startswith("data:") and "," in text:
                text = text.split(",", 1)[1]
            try:
                data = base64.b64decode(text, validate=True)
            except (binascii.Error, ValueError):
                raise DataError(f"{where}: '{text[:60]}' is neither an image file nor base64",
                                hint="keep images inline or as paths relative to the data file"
                                ) from None
            return self._write(data, where)
        raise DataError(f"{where}: unsupported image value of type {type(value).__name__}",
                        hint="store images as bytes, base64 or file paths")

    def _existing(self, recorded: str, row: Row, where: str) -> str:
        for candidate in (Path(recorded), row.base_dir / recorded):
            if _is_file(candidate):
                return str(candidate.resolve())
        raise DataError(f"{where}: image file {recorded} not found",
                        hint="copy the images next to the data file, or keep them inline")
