"""The experiment store: one DuckDB file holding every run, metric and evaluation result.

This module is the only place in the project that writes SQL. Other modules call its methods.

Concurrency model. DuckDB lets one process write a database file at a time (other processes may
read when no process holds it for writing). The store therefore opens a short-lived connection
per operation and retries while another process holds the lock, so a training run streaming
metrics and a `pyvision report` in another terminal can take turns. Every write runs in one
transaction: a reader sees all of it or none of it. Within a process, a lock serialises writers
from several threads.

Schema. Migrations are the numbered SQL files in ``migrations/``, applied in order, each in its
own transaction, and recorded in ``schema_version``. A store written by a newer pyvision (a
higher version than this code knows) is refused rather than silently misread.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import random
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import duckdb

from pipelines.core.media import MediaBlob
from pipelines.errors import DISK_REFUSED, UserError

# Rows a multi-row statement carries at most. ``executemany`` runs one statement per row: 64
# evaluated samples (5 statements each) took 0.61 s of CPU to write that way, 0.19 s as a few
# multi-row statements (plus 0.14 s for the 8 connections either way).
_ROWS_PER_STATEMENT = 512


def _row_of_parameters(n: int) -> str:
    return "(" + ", ".join(["?"] * n) + ")"


def _insert_rows(con: duckdb.DuckDBPyConnection, table: str, columns: Sequence[str],
                 rows: Sequence[Sequence[Any]], *, or_ignore: bool = False) -> None:
    """``INSERT [OR IGNORE] INTO table (columns) VALUES (...), (...)``: many rows a statement."""
    head = (f"INSERT {'OR IGNORE ' if or_ignore else ''}INTO {table} ({', '.join(columns)}) "
            "VALUES ")
    one = _row_of_parameters(len(columns))
    for at in range(0, len(rows), _ROWS_PER_STATEMENT):
        chunk = rows[at: at + _ROWS_PER_STATEMENT]
        con.execute(head + ", ".join([one] * len(chunk)), [v for row in chunk for v in row])


def _delete_keys(con: duckdb.DuckDBPyConnection, table: str, columns: Sequence[str],
                 keys: Sequence[Sequence[Any]]) -> None:
    """Delete the rows of ``table`` whose ``columns`` equal one of ``keys``."""
    one = _row_of_parameters(len(columns))
    for at in range(0, len(keys), _ROWS_PER_STATEMENT):
        chunk = keys[at: at + _ROWS_PER_STATEMENT]
        con.execute(f"DELETE FROM {table} WHERE ({', '.join(columns)}) IN "
                    f"(SELECT * FROM (VALUES {', '.join([one] * len(chunk))}))",
                    [v for key in chunk for v in key])

DEFAULT_STORE = Path("runs") / "pyvision.duckdb"
MIGRATIONS_DIR = Path(__file__).with_name("migrations")
_LOCK_WAIT_S = 60.0
_LOCK_NOTICE_S = 2.0
"""After this long waiting for another process's lock, say whose it is."""
_WRITE_LOCK = threading.RLock()
_COMMIT_REST_MAX_S = 0.5
"""After a background commit (``EvalWriter``) the store is left alone for as long as the commit
held it, up to this: other processes (``pyvision report``, a second evaluation) get in between."""


def resolve_store_path(cli_value: str | Path | None = None) -> Path:
    """`--store PATH`, else `$PYVISION_STORE`, else `runs/pyvision.duckdb`."""
    if cli_value:
        return Path(cli_value)
    env = os.environ.get("PYVISION_STORE")
    return Path(env) if env else DEFAULT_STORE


def _migrations() -> list[tuple[int, str, str]]:
    out = []
    for path in sorted(MIGRATIONS_DIR.glob("*.sql")):
        number = int(path.name.split("_", 1)[0])
        out.append((number, path.stem, path.read_text(encoding="utf-8")))
    return out


SCHEMA_VERSION = max(n for n, _, _ in _migrations())
# The migration that adds thumbnails (``media``) and RL rollouts: older stores opened read-only
# lack them.
MEDIA_MIGRATION = 5
ANY_WEIGHTS = object()
"""``eval_sample_ids`` default: samples stored by any weights."""


def _in_runs(run_ids: Sequence[str] | None) -> tuple[str, list[Any]]:
    """A ``WHERE`` clause (and its parameters) keeping the rows of ``run_ids``; all when empty."""
    if not run_ids:
        return "", []
    return f" WHERE run_id IN ({', '.join('?' for _ in run_ids)})", list(run_ids)


def _is_lock_error(exc: Exception) -> bool:
    """DuckDB's "Could not set lock on file ... Conflicting lock is held": the word ``lock``, not
    the ``block`` of a corrupt file's checksum error."""
    import re

    return re.search(r"\block\b|being used by another process", str(exc).lower()) is not None


def _is_damage(exc: Exception) -> bool:
    """DuckDB's errors for a damaged file: an I/O error (a truncated copy), a checksum that does
    not match ("Corrupt database file")."""
    return isinstance(exc, duckdb.IOException) or "corrupt" in str(exc).lower()


def _is_write_failure(exc: Exception) -> bool:
    """DuckDB's errors for a write the disk refused: full, over quota, or remounted read-only
    (the transaction is rolled back; the file keeps what it held)."""
    text = str(exc)
    return any(os.strerror(code) in text for code in DISK_REFUSED)


_DAMAGED_HINT = ("the file is damaged (an interrupted copy?): restore it from a copy, or pass "
                 "--store FILE (or set PYVISION_STORE) to another DuckDB file")


def lock_holder(message: str) -> str:
    """Who holds the store's lock, from DuckDB's lock error: ``process 123 (its command line)``
    (``another process`` when the message does not say)."""
    import re

    found = re.search(r"\(PID (\d+)\)", message)
    if not found:
        return "another process"
    return describe_process(int(found.group(1)))


def describe_process(pid: int) -> str:
    """``process 123 (its command line)``, or ``process 123`` when the command line is unknown."""
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return f"process {pid}"
    command = " ".join(" ".join(part.decode(errors="replace") for part in raw.split(b"\0")).split())
    return f"process {pid} ({command[:120]})" if command else f"process {pid}"


@dataclass(frozen=True)
class EvalRecord:
    """One evaluated sample: its trajectory summary plus the scores it earned."""

    run_id: str
    model: str
    benchmark: str
    sample_id: str
    benchmark_version: str
    prompt_version: str
    prompt_hash: str
    scorer: str
    prediction: str | None
    stop_reason: str | None
    turns: int
    tool_calls: int
    failed_calls: int
    visual_tokens: int
    total_tokens: int
    duration_s: float
    trajectory: Mapping[str, Any] | None
    scores: Mapping[str, float]
    model_fingerprint: str | None = None
    """Digest of the weights that produced it (``fsutil.weights_fingerprint``); None if unknown."""
    scored_by: str | None = None
    """Which scorer decided: ``judge``, ``rules`` or ``rule_fallback`` (judge asked, no answer)."""
    task: Mapping[str, Any] | None = None
    """The task it was scored against (JSON), so it can be scored again from the store."""
    media: Mapping[str, Any] | None = None
    """Thumbnails it shows: ``{"inputs": [sha256, ...], "images": [sha256, ...]}`` (the
    trajectory's images by index), each stored once in ``media`` (``blobs``)."""
    blobs: Sequence[MediaBlob] = ()
    """The thumbnails ``media`` refers to; those already stored are skipped."""


class Store:
    """A DuckDB experiment store at ``path``.

    The path is checked at once (a folder, a file that is not DuckDB, a read-only file or folder
    is a one-line UserError). A store that does not exist yet is created and migrated by the
    first write, not before: a command that fails its input checks leaves no store behind, and
    reads of a store not yet created find nothing.
    """

    def __init__(self, path: str | Path | None = None, *, read_only: bool = False) -> None:
        from pipelines.inputs import check_store_path

        self.path = resolve_store_path(path)
        self.read_only = read_only
        self._ready = False
        self._session: duckdb.DuckDBPyConnection | None = None
        self._read_version = SCHEMA_VERSION
        check_store_path(self.path, write=not read_only)
        if read_only:
            # Not migrated: a store written by an older pyvision reads as it is (_at_least).
            self._read_version = self._check_version()
            self._ready = True
        elif self.path.exists():
            self._prepare()

    def _prepare(self) -> None:
        """Create (when missing) and migrate the store; once per Store object."""
        if not self._ready:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.migrate()
            self._ready = True

    # -- connections -------------------------------------------------------------------------

    @contextlib.contextmanager
    def session(self) -> Iterator[Store]:
        """Hold one connection for every read inside the block, then let go: a reader that
        makes many queries (``pyvision report``) takes the file's lock once, briefly, instead
        of once per query, so a writer waiting for it gets in between two reports."""
        if self._session is not None:
            yield self
            return
        with self._connect() as con:
            self._session = con
            try:
                yield self
            finally:
                self._session = None

    def _open(self) -> duckdb.DuckDBPyConnection:
        """A new connection, retrying while another process holds the file's lock."""
        start = time.monotonic()
        deadline = start + _LOCK_WAIT_S
        delay = 0.01
        told = False
        while True:
            try:
                return duckdb.connect(str(self.path), read_only=self.read_only)
            except duckdb.Error as exc:
                if not _is_lock_error(exc):
                    raise UserError(f"cannot open the store {self.path} "
                                    f"({str(exc).splitlines()[0][:200]})",
                                    hint=_DAMAGED_HINT if _is_damage(exc) else
                                    "pass --store FILE (or set PYVISION_STORE) to another "
                                    "DuckDB file") from None
                holder = lock_holder(str(exc))
                if time.monotonic() > deadline:
                    raise UserError(
                        f"store {self.path} is held by {holder} for over {_LOCK_WAIT_S:.0f} s",
                        hint="wait for it to finish, close it, or use --store to write "
                             "elsewhere") from None
                if not told and time.monotonic() > start + _LOCK_NOTICE_S:
                    told = True
                    from pipelines.console import err

                    err.print(f"waiting for the store {self.path}: held by {holder} (giving up "
                              f"after {_LOCK_WAIT_S:.0f} s)", soft_wrap=True, highlight=False,
                              markup=False)
                time.sleep(delay * (1 + random.random()))
                delay = min(delay * 2, 0.5)

    @contextlib.contextmanager
    def _connect(self) -> Iterator[duckdb.DuckDBPyConnection]:
        if self._session is not None:
            yield self._session
            return
        if not self.read_only:
            self._prepare()
        con = self._open()
        try:
            yield con
        finally:
            con.close()

    @contextlib.contextmanager
    def _transaction(self) -> Iterator[duckdb.DuckDBPyConnection]:
        if self.read_only:
            raise RuntimeError("this Store was opened read-only")
        with _WRITE_LOCK, self._connect() as con:
            con.execute("BEGIN TRANSACTION")
            try:
                yield con
                con.execute("COMMIT")
            except BaseException as exc:
                with contextlib.suppress(duckdb.Error):  # a failed COMMIT has rolled back
                    con.execute("ROLLBACK")
                if isinstance(exc, duckdb.Error) and _is_write_failure(exc):
                    raise UserError(f"cannot write the store {self.path} "
                                    f"({str(exc).splitlines()[0][:200]})",
                                    hint="free space on its disk, or pass --store FILE (or set "
                                         "PYVISION_STORE) to a file on another disk; what was "
                                         "stored before is kept") from None
                raise

    def _query(self, sql: str, params: Sequence[Any] = ()) -> list[dict[str, Any]]:
        if not self._ready and not self.path.exists():
            return []  # a store not created yet holds nothing; a read does not create it
        with self._connect() as con:
            try:
                cur = con.execute(sql, list(params))
                cols = [d[0] for d in cur.description]
                return [dict(zip(cols, row)) for row in cur.fetchall()]
            except duckdb.Error as exc:  # a damaged file; a wrong query stays a bug
                if _is_damage(exc):
                    raise self._damaged(exc) from None
                raise

    # -- schema ------------------------------------------------------------------------------

    def schema_version(self) -> int:
        with self._connect() as con:
            return self._version(con)

    @staticmethod
    def _version(con: duckdb.DuckDBPyConnection) -> int:
        exists = con.execute(
            "SELECT count(*) FROM information_schema.tables WHERE table_name='schema_version'"
        ).fetchone()[0]
        if not exists:
            return 0
        return int(con.execute("SELECT coalesce(max(version), 0) FROM schema_version")
                   .fetchone()[0])

    def _refuse_foreign(self, con: duckdb.DuckDBPyConnection) -> None:
        """A DuckDB file with tables that pyvision never wrote (no ``schema_version`` beside
        them) is refused, rather than read as runs or migrated in place."""
        names = sorted(r[0] for r in con.execute(
            "SELECT table_name FROM information_schema.tables WHERE table_schema='main'"
        ).fetchall())
        if names and "schema_version" not in names:
            raise UserError(f"{self.path} is a DuckDB database but not a pyvision store (it holds "
                            f"table '{names[0]}' and no schema_version)",
                            hint="pass --store FILE (or set PYVISION_STORE) to a pyvision store or "
                                 "a new file")

    def _check_version(self) -> int:
        try:
            with self._connect() as con:
                self._refuse_foreign(con)
                version = self._version(con)
        except duckdb.Error as exc:
            raise self._damaged(exc) from None
        if version == 0:
            raise UserError(f"{self.path} is an empty DuckDB file: no pyvision stage has written "
                            "to it yet", hint="run a stage with --store pointing at it, or pass "
                                              "--store to a pyvision store")
        if version > SCHEMA_VERSION:
            raise UserError(
                f"store {self.path} has schema version {version}, newer than this pyvision "
                f"understands ({SCHEMA_VERSION})", hint="upgrade pyvision or use another --store")
        return version

    def _damaged(self, exc: duckdb.Error) -> UserError:
        return UserError(f"cannot read the store {self.path} ({str(exc).splitlines()[0][:200]})",
                         hint=_DAMAGED_HINT)

    def migrate(self) -> int:
        """Apply pending migrations; return the schema version."""
        try:
            return self._migrate()
        except duckdb.Error as exc:
            raise self._damaged(exc) from None

    def _migrate(self) -> int:
        with _WRITE_LOCK, contextlib.closing(self._open()) as con:
            self._refuse_foreign(con)
            con.execute("CREATE TABLE IF NOT EXISTS schema_version (version INTEGER PRIMARY KEY, "
                        "name VARCHAR, applied_at TIMESTAMP DEFAULT current_timestamp)")
            current = int(con.execute("SELECT coalesce(max(version), 0) FROM schema_version")
                          .fetchone()[0])
            if current > SCHEMA_VERSION:
                raise UserError(
                    f"store {self.path} has schema version {current}, newer than this pyvision "
                    f"understands ({SCHEMA_VERSION})", hint="upgrade pyvision or use another --store")
            for number, name, sql in _migrations():
                if number <= current:
                    continue
                con.execute("BEGIN TRANSACTION")
                try:
                    con.execute(sql)
                    con.execute("INSERT INTO schema_version (version, name) VALUES (?, ?)",
                                [number, name])
                except BaseException:
                    con.execute("ROLLBACK")
                    raise
                con.execute("COMMIT")
                current = number
        return current

    # -- runs and stages ---------------------------------------------------------------------

    def upsert_run(self, run_id: str, name: str, *, recipe_path: str | None = None,
                   config: Mapping[str, Any] | None = None, git_sha: str | None = None) -> None:
        with self._transaction() as con:
            con.execute(
                "INSERT INTO runs (run_id, name, recipe_path, config_json, git_sha) "
                "VALUES (?, ?, ?, ?, ?) ON CONFLICT (run_id) DO UPDATE SET name=excluded.name, "
                "recipe_path=excluded.recipe_path, config_json=excluded.config_json, "
                "git_sha=excluded.git_sha",
                [run_id, name, recipe_path, json.dumps(config) if config is not None else None,
                 git_sha])

    def runs(self) -> list[dict[str, Any]]:
        return self._query("SELECT run_id, name, recipe_path, git_sha, created_at FROM runs "
                           "ORDER BY created_at, run_id")

    def run_config(self, run_id: str) -> dict[str, Any] | None:
        """The resolved recipe stored with ``run_id`` (None when the run or its config is not
        stored)."""
        rows = self._query("SELECT config_json FROM runs WHERE run_id = ?", [run_id])
        return json.loads(rows[0]["config_json"]) if rows and rows[0]["config_json"] else None

    def set_stage(self, run_id: str, stage: str, status: str, *, run_dir: str | None = None,
                  summary: Mapping[str, Any] | None = None) -> None:
        if status not in ("running", "done", "failed"):
            raise ValueError(f"bad stage status {status!r}")
        now_col = "started_at" if status == "running" else "finished_at"
        with self._transaction() as con:
            con.execute(
                f"INSERT INTO stages (run_id, stage, status, run_dir, {now_col}, summary) "
                f"VALUES (?, ?, ?, ?, current_timestamp, ?) ON CONFLICT (run_id, stage) DO UPDATE "
                f"SET status=excluded.status, run_dir=coalesce(excluded.run_dir, stages.run_dir), "
                f"{now_col}=excluded.{now_col}, "
                f"summary=coalesce(excluded.summary, stages.summary)",
                [run_id, stage, status, run_dir,
                 json.dumps(summary) if summary is not None else None])

    def stages(self, run_id: str) -> list[dict[str, Any]]:
        rows = self._query("SELECT stage, status, run_dir, started_at, finished_at, summary "
                           "FROM stages WHERE run_id = ? ORDER BY started_at NULLS LAST, stage",
                           [run_id])
        for row in rows:
            row["summary"] = json.loads(row["summary"]) if row["summary"] else None
        return rows

    # -- metrics -----------------------------------------------------------------------------

    def log_metrics(self, run_id: str, stage: str, step: int,
                    metrics: Mapping[str, float | int | None]) -> None:
        """Record one step's metrics atomically (non-finite values are stored as NULL)."""
        rows = []
        for name, value in metrics.items():
            v = None if value is None else float(value)
            if v is not None and not math.isfinite(v):
                v = None
            rows.append([run_id, stage, int(step), str(name), v])
        if not rows:
            return
        with self._transaction() as con:
            _insert_rows(con, "metrics", ("run_id", "stage", "step", "name", "value"), rows)

    def metrics(self, run_id: str, stage: str | None = None,
                names: Sequence[str] | None = None) -> list[dict[str, Any]]:
        sql = "SELECT run_id, stage, step, name, value, time FROM metrics WHERE run_id = ?"
        params: list[Any] = [run_id]
        if stage is not None:
            sql += " AND stage = ?"
            params.append(stage)
        if names:
            sql += f" AND name IN ({', '.join('?' for _ in names)})"
            params.extend(names)
        return self._query(sql + " ORDER BY stage, step, name, time", params)

    def last_step(self, run_id: str, stage: str) -> int | None:
        rows = self._query("SELECT max(step) AS s FROM metrics WHERE run_id = ? AND stage = ?",
                           [run_id, stage])
        return None if not rows or rows[0]["s"] is None else int(rows[0]["s"])

    def delete_metrics_after(self, run_id: str, stage: str, step: int) -> None:
        """Forget metrics logged after ``step`` (a resumed run re-logs them), and for ``rl`` the
        rollouts recorded after it: a resumed run that stops sooner (``--resume --force`` with
        fewer steps) must not leave the first attempt's later steps in the report."""
        with self._transaction() as con:
            con.execute("DELETE FROM metrics WHERE run_id = ? AND stage = ? AND step > ?",
                        [run_id, stage, step])
            if stage == "rl":
                con.execute("DELETE FROM rl_rollouts WHERE run_id = ? AND step > ?",
                            [run_id, step])

    # -- evaluation --------------------------------------------------------------------------

    def add_eval_record(self, rec: EvalRecord) -> None:
        """Store one evaluated sample and its per-sample scores in one transaction."""
        self.add_eval_records([rec])

    # The columns of an evaluated sample's row (``eval_trajectories``), its key first.
    _EVAL_KEY = ("run_id", "model", "benchmark", "sample_id")
    _EVAL_COLUMNS = (*_EVAL_KEY, "benchmark_version", "prompt_version", "prompt_hash", "scorer",
                     "prediction", "stop_reason", "turns", "tool_calls", "failed_calls",
                     "visual_tokens", "total_tokens", "duration_s", "trajectory",
                     "model_fingerprint", "scored_by", "task", "media")

    def add_eval_records(self, records: Sequence[EvalRecord]) -> None:
        """Store evaluated samples (each replacing its earlier copy; of two with one key, the
        later) in one transaction."""
        latest = {(r.run_id, r.model, r.benchmark, r.sample_id): r for r in records}
        if not latest:
            return

        def dumped(value: Any) -> str | None:
            return json.dumps(value) if value is not None else None

        rows = [[*key, rec.benchmark_version, rec.prompt_version, rec.prompt_hash, rec.scorer,
                 rec.prediction, rec.stop_reason, rec.turns, rec.tool_calls, rec.failed_calls,
                 rec.visual_tokens, rec.total_tokens, rec.duration_s, dumped(rec.trajectory),
                 rec.model_fingerprint, rec.scored_by, dumped(rec.task), dumped(rec.media)]
                for key, rec in latest.items()]
        with self._transaction() as con:
            keys = list(latest)
            _delete_keys(con, "eval_scores", self._EVAL_KEY, keys)
            _delete_keys(con, "eval_trajectories", self._EVAL_KEY, keys)
            _insert_rows(con, "eval_trajectories", self._EVAL_COLUMNS, rows)
            self._insert_scores(con, [(list(k), r.scores) for k, r in latest.items()])
            self._insert_media(con, [b for r in latest.values() for b in r.blobs])

    def eval_writer(self, max_delay_s: float = 1.0) -> EvalWriter:
        """A buffer that commits evaluated samples together, at most ``max_delay_s`` after the
        first of them finished (one store connection per batch, not per sample)."""
        return EvalWriter(self, max_delay_s)

    @staticmethod
    def _insert_scores(con: duckdb.DuckDBPyConnection,
                       samples: Sequence[tuple[list[str], Mapping[str, float] | None]]) -> None:
        """The per-sample scores of each (key, scores)."""
        _insert_rows(con, "eval_scores", (*Store._EVAL_KEY, "metric", "value"),
                     [key + [m, None if v is None else float(v)]
                      for key, scores in samples for m, v in (scores or {}).items()])

    @staticmethod
    def _insert_media(con: duckdb.DuckDBPyConnection, blobs: Sequence[MediaBlob]) -> None:
        unique = {b.sha256: b for b in blobs}
        _insert_rows(con, "media", ("sha256", "mime", "width", "height", "data"),
                     [[b.sha256, b.mime, b.width, b.height, b.data] for b in unique.values()],
                     or_ignore=True)

    def _at_least(self, version: int) -> bool:
        """Whether the file has migration ``version`` (a store opened read-only is not migrated:
        one written by an older pyvision reads as if it had none of the newer tables)."""
        return self._read_version >= version

    def media(self, shas: Sequence[str]) -> dict[str, MediaBlob]:
        """The stored thumbnails among ``shas`` (missing ones are left out)."""
        if not self._at_least(MEDIA_MIGRATION):
            return {}
        wanted = sorted(set(shas))
        out: dict[str, MediaBlob] = {}
        for i in range(0, len(wanted), 500):
            part = wanted[i: i + 500]
            for r in self._query("SELECT sha256, mime, width, height, data FROM media WHERE "
                                 f"sha256 IN ({', '.join('?' for _ in part)})", part):
                out[r["sha256"]] = MediaBlob(r["sha256"], r["mime"], int(r["width"]),
                                             int(r["height"]), bytes(r["data"]))
        return out

    # -- RL rollouts -------------------------------------------------------------------------

    ROLLOUT_COLUMNS = ("group_index", "sample_index", "task_id", "data_source", "group_status",
                       "rank", "status", "reward", "accuracy", "tool", "format", "advantage",
                       "group_mean", "group_std", "stop_reason", "prediction", "turns",
                       "tool_calls", "visual_tokens", "trajectory", "task", "media")
    _ROLLOUT_JSON = ("trajectory", "task", "media")

    def set_rollouts(self, run_id: str, step: int, rows: Sequence[Mapping[str, Any]],
                     blobs: Sequence[MediaBlob] = ()) -> None:
        """Replace the recorded rollouts of one RL step (a resumed step records them again)."""
        cols = self.ROLLOUT_COLUMNS
        values = [[run_id, int(step)] + [
            (json.dumps(row.get(c)) if row.get(c) is not None else None)
            if c in self._ROLLOUT_JSON else row.get(c) for c in cols] for row in rows]
        with self._transaction() as con:
            con.execute("DELETE FROM rl_rollouts WHERE run_id=? AND step=?", [run_id, int(step)])
            _insert_rows(con, "rl_rollouts", ("run_id", "step", *cols), values)
            self._insert_media(con, blobs)

    def rollouts(self, run_ids: Sequence[str] | None = None, *,
                 with_trajectory: bool = True) -> list[dict[str, Any]]:
        """Recorded RL rollouts, by run, step, group and sample."""
        if not self._at_least(MEDIA_MIGRATION):
            return []
        where, params = _in_runs(run_ids)
        cols = [c for c in self.ROLLOUT_COLUMNS if with_trajectory or c != "trajectory"]
        rows = self._query(f"SELECT run_id, step, {', '.join(cols)} FROM rl_rollouts{where} "
                           "ORDER BY run_id, step, group_index, sample_index", params)
        for row in rows:
            for c in self._ROLLOUT_JSON:
                if c in row:
                    row[c] = json.loads(row[c]) if row[c] else None
        return rows

    def rescore_eval_sample(self, run_id: str, model: str, benchmark: str, sample_id: str, *,
                            scores: Mapping[str, float], scorer: str, scored_by: str) -> None:
        """Replace one stored sample's scores and the scorer that decided them (one
        transaction); its trajectory and prediction stay as they are."""
        with self._transaction() as con:
            key = [run_id, model, benchmark, sample_id]
            _delete_keys(con, "eval_scores", self._EVAL_KEY, [key])
            self._insert_scores(con, [(key, scores)])
            con.execute("UPDATE eval_trajectories SET scorer=?, scored_by=? WHERE run_id=? AND "
                        "model=? AND benchmark=? AND sample_id=?", [scorer, scored_by, *key])

    def eval_sample_ids(self, run_id: str, model: str, benchmark: str, *,
                        fingerprint: str | None | object = ANY_WEIGHTS) -> set[str]:
        """Samples stored for this run, model tag and benchmark; with ``fingerprint``, only
        those these weights produced (None: only those whose weights were unknown too)."""
        sql = "SELECT sample_id FROM eval_trajectories WHERE run_id=? AND model=? AND benchmark=?"
        params: list[Any] = [run_id, model, benchmark]
        if fingerprint is not ANY_WEIGHTS:
            sql += " AND model_fingerprint IS NOT DISTINCT FROM ?"
            params.append(fingerprint)
        return {r["sample_id"] for r in self._query(sql, params)}

    def eval_sample_count(self, run_id: str) -> int:
        """How many evaluated samples the run holds (every model tag and benchmark)."""
        rows = self._query("SELECT count(*) AS n FROM eval_trajectories WHERE run_id = ?",
                           [run_id])
        return int(rows[0]["n"]) if rows else 0

    def forget_eval_aggregate(self, run_id: str, model: str, benchmark: str) -> None:
        """Drop an aggregate whose samples are being evaluated again."""
        with self._transaction() as con:
            con.execute("DELETE FROM eval_aggregates WHERE run_id=? AND model=? AND benchmark=?",
                        [run_id, model, benchmark])

    def forget_stage(self, run_id: str, stage: str) -> None:
        """Forget what a stage recorded (its metrics; for ``eval`` every evaluated sample of the
        run): the stage is being redone from scratch."""
        with self._transaction() as con:
            con.execute("DELETE FROM metrics WHERE run_id=? AND stage=?", [run_id, stage])
            if stage == "rl":
                con.execute("DELETE FROM rl_rollouts WHERE run_id=?", [run_id])
            if stage == "eval":
                for table in ("eval_scores", "eval_trajectories", "eval_aggregates"):
                    con.execute(f"DELETE FROM {table} WHERE run_id=?", [run_id])

    def eval_records(self, run_id: str, model: str | None = None, benchmark: str | None = None,
                     with_trajectory: bool = False, with_task: bool = False,
                     with_media: bool = False) -> list[dict[str, Any]]:
        cols = ("run_id, model, benchmark, sample_id, benchmark_version, prompt_version, "
                "prompt_hash, scorer, scored_by, prediction, stop_reason, turns, tool_calls, "
                "failed_calls, visual_tokens, total_tokens, duration_s")
        if with_trajectory:
            cols += ", trajectory"
        if with_task:
            cols += ", task"
        if with_media:
            cols += ", media" if self._at_least(MEDIA_MIGRATION) else ", NULL AS media"
        sql = f"SELECT {cols} FROM eval_trajectories WHERE run_id = ?"
        params: list[Any] = [run_id]
        if model is not None:
            sql += " AND model = ?"
            params.append(model)
        if benchmark is not None:
            sql += " AND benchmark = ?"
            params.append(benchmark)
        rows = self._query(sql + " ORDER BY model, benchmark, sample_id", params)
        for column in ("trajectory", "task", "media"):
            for row in rows:
                if column in row:
                    row[column] = json.loads(row[column]) if row[column] else None
        return rows

    def eval_scored_by(self, run_ids: Sequence[str] | None = None
                       ) -> dict[tuple[str, str, str], dict[str, int]]:
        """``{(run_id, model, benchmark): {scored_by: samples}}``; samples stored before the
        scorer was recorded count as ``unknown``."""
        where, params = _in_runs(run_ids)
        sql = ("SELECT run_id, model, benchmark, coalesce(scored_by, 'unknown') AS by, "
               f"count(*) AS n FROM eval_trajectories{where} GROUP BY ALL ORDER BY ALL")
        out: dict[tuple[str, str, str], dict[str, int]] = {}
        for r in self._query(sql, params):
            out.setdefault((r["run_id"], r["model"], r["benchmark"]), {})[r["by"]] = int(r["n"])
        return out

    def eval_scores(self, run_id: str, model: str, benchmark: str) -> dict[str, dict[str, float]]:
        """``{sample_id: {metric: value}}`` for one model on one benchmark."""
        out: dict[str, dict[str, float]] = {}
        for r in self._query("SELECT sample_id, metric, value FROM eval_scores WHERE run_id=? "
                             "AND model=? AND benchmark=?", [run_id, model, benchmark]):
            out.setdefault(r["sample_id"], {})[r["metric"]] = r["value"]
        return out

    def set_eval_aggregate(self, run_id: str, model: str, benchmark: str,
                           metrics: Mapping[str, float], *, n: int, benchmark_version: str,
                           prompt_version: str, scorer: str) -> None:
        """Replace the aggregate scores of one model on one benchmark."""
        with self._transaction() as con:
            con.execute("DELETE FROM eval_aggregates WHERE run_id=? AND model=? AND benchmark=?",
                        [run_id, model, benchmark])
            _insert_rows(con, "eval_aggregates", ("run_id", "model", "benchmark", "metric", "value",
                                                  "n", "benchmark_version", "prompt_version",
                                                  "scorer"),
                         [[run_id, model, benchmark, m, float(v), n, benchmark_version,
                           prompt_version, scorer] for m, v in metrics.items()])

    def eval_aggregates(self, run_ids: Sequence[str] | None = None) -> list[dict[str, Any]]:
        where, params = _in_runs(run_ids)
        return self._query("SELECT run_id, model, benchmark, metric, value, n, benchmark_version, "
                           f"prompt_version, scorer, created_at FROM eval_aggregates{where} "
                           "ORDER BY run_id, benchmark, model, metric", params)

    # -- judge cache -------------------------------------------------------------------------

    @staticmethod
    def judge_key(model: str, prompt: str) -> str:
        return hashlib.sha256(f"{model}\x00{prompt}".encode()).hexdigest()

    def judge_get(self, key: str) -> dict[str, Any] | None:
        rows = self._query("SELECT key, model, response, verdict FROM judge_cache WHERE key = ?",
                           [key])
        return rows[0] if rows else None

    def judge_put(self, key: str, model: str, response: str, verdict: float | None) -> None:
        with self._transaction() as con:
            con.execute("INSERT INTO judge_cache (key, model, response, verdict) VALUES "
                        "(?, ?, ?, ?) ON CONFLICT (key) DO UPDATE SET response=excluded.response, "
                        "verdict=excluded.verdict", [key, model, response, verdict])


    # -- distillation ------------------------------------------------------------------------

    def put_distill(self, dataset: str, *, run_id: str | None, teacher: str,
                    card: Mapping[str, Any], samples: Sequence[Mapping[str, Any]]) -> None:
        """Replace a distilled dataset's card and per-sample rows (one transaction)."""
        cols = ("task_id", "sample_index", "family", "data_source", "verdict", "kept",
                "selection", "turns", "tool_calls", "failed_calls", "total_tokens",
                "visual_tokens")
        with self._transaction() as con:
            con.execute("DELETE FROM distill_samples WHERE dataset = ?", [dataset])
            con.execute("DELETE FROM distill_cards WHERE dataset = ?", [dataset])
            con.execute("INSERT INTO distill_cards (dataset, run_id, teacher, card) VALUES "
                        "(?, ?, ?, ?)", [dataset, run_id, teacher, json.dumps(card, default=str)])
            _insert_rows(con, "distill_samples", ("dataset", *cols),
                         [[dataset, *(s.get(c) for c in cols)] for s in samples])

    def distill_card(self, dataset: str) -> dict[str, Any] | None:
        rows = self._query("SELECT card FROM distill_cards WHERE dataset = ?", [dataset])
        return json.loads(rows[0]["card"]) if rows else None

    def distill_samples(self, dataset: str) -> list[dict[str, Any]]:
        return self._query("SELECT * FROM distill_samples WHERE dataset = ? ORDER BY task_id, "
                           "sample_index", [dataset])


class EvalWriter:
    """Commits evaluated samples in small batches; ``flush()`` (always call it, in a ``finally``)
    commits what is left. A batch goes to the store once its first sample is ``max_delay_s`` old
    (at the next ``add``), or later while the batch before it is still going in, so an
    interrupted evaluation loses little work and resumes from the rest.

    Those batches are committed on a thread of their own, in order, while the evaluation goes
    on: opening the store and committing (tens of milliseconds a batch) is off the evaluation's
    path, and DuckDB does that work without holding the GIL. One batch is in flight at a time,
    and after it the store is left alone for as long as the commit held it (at most
    ``_COMMIT_REST_MAX_S``): samples that finish faster than they commit join the next batch
    instead of queueing, and other processes reading the store get in between commits.
    ``flush()`` waits for every batch before it returns; a batch that failed raises there (or at
    the next ``add``), nothing is dropped without an error."""

    def __init__(self, store: Store, max_delay_s: float) -> None:
        self.store, self.max_delay_s = store, max_delay_s
        self.pending: list[EvalRecord] = []
        self.since = 0.0
        self._committer: Any = None  # a one-thread executor, made for the first batch
        self._inflight: Any = None  # the future of the batch being committed, if one is
        self._rest_until = 0.0  # monotonic time before which the next batch waits

    def add(self, rec: EvalRecord) -> None:
        """Queue ``rec``; raises the error of a batch that failed since the last call (``rec``
        itself stays queued: ``flush()`` commits it)."""
        if not self.pending:
            self.since = time.monotonic()
        self.pending.append(rec)
        self._raise_failed()
        now = time.monotonic()
        if now - self.since >= self.max_delay_s and self._inflight is None \
                and now >= self._rest_until:
            records, self.pending = self.pending, []
            if self._committer is None:
                from concurrent.futures import ThreadPoolExecutor

                self._committer = ThreadPoolExecutor(max_workers=1,
                                                     thread_name_prefix="store-commit")
            self._inflight = self._committer.submit(self._commit, records)

    def _commit(self, records: list[EvalRecord]) -> None:
        """On the commit thread: one batch, and when the next may start (after a rest as long
        as this commit, which lets other processes in)."""
        start = time.monotonic()
        try:
            self.store.add_eval_records(records)
        finally:
            end = time.monotonic()
            self._rest_until = end + min(end - start, _COMMIT_REST_MAX_S)

    def _raise_failed(self) -> None:
        """Forget the batch in flight once it is done; raise its error if it failed."""
        if self._inflight is not None and self._inflight.done():
            done, self._inflight = self._inflight, None
            done.result()

    def flush(self) -> None:
        """Commit everything added so far; returns once it is all in the store. When a batch
        failed, the ones after it are still committed, then its error is raised."""
        inflight, self._inflight = self._inflight, None
        # The batch in flight's error (None when it went in), raised once the rest are in.
        error = inflight.exception() if inflight is not None else None
        if self._committer is not None:
            self._committer.shutdown(wait=True)
            self._committer = None
        records, self.pending = self.pending, []
        try:
            self.store.add_eval_records(records)
        finally:
            if error is not None:
                raise error
