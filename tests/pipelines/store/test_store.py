"""The DuckDB store: migrations, transactional writes, concurrent readers, version guard."""

from __future__ import annotations

import multiprocessing as mp
import time
from itertools import pairwise
from pathlib import Path

import duckdb
import pytest

from pipelines.errors import UserError
from pipelines.store import SCHEMA_VERSION, EvalRecord, Store, resolve_store_path


def test_fresh_store_is_migrated(tmp_path):
    store = Store(tmp_path / "s.duckdb")
    assert store.schema_version() == SCHEMA_VERSION
    # Re-opening applies nothing twice.
    assert Store(tmp_path / "s.duckdb").migrate() == SCHEMA_VERSION
    con = duckdb.connect(str(tmp_path / "s.duckdb"))
    tables = {r[0] for r in con.execute("SELECT table_name FROM information_schema.tables").fetchall()}
    con.close()
    assert {"runs", "stages", "metrics", "eval_trajectories", "eval_scores", "eval_aggregates",
            "judge_cache", "schema_version"} <= tables


def test_store_from_newer_pyvision_is_refused(tmp_path):
    path = tmp_path / "s.duckdb"
    Store(path).migrate()
    con = duckdb.connect(str(path))
    con.execute("INSERT INTO schema_version (version, name) VALUES (?, 'future')", [SCHEMA_VERSION + 1])
    con.close()
    with pytest.raises(UserError, match="newer than this pyvision"):
        Store(path).migrate()
    with pytest.raises(UserError, match="newer than this pyvision"):
        Store(path, read_only=True)


def test_store_path_resolution(monkeypatch, tmp_path):
    monkeypatch.setenv("PYVISION_STORE", str(tmp_path / "env.duckdb"))
    assert resolve_store_path(None) == tmp_path / "env.duckdb"
    assert resolve_store_path(tmp_path / "cli.duckdb") == tmp_path / "cli.duckdb"
    monkeypatch.delenv("PYVISION_STORE")
    assert resolve_store_path(None) == Path("runs/pyvision.duckdb")


def test_read_only_store_must_exist(tmp_path):
    with pytest.raises(UserError, match="store not found"):
        Store(tmp_path / "missing.duckdb", read_only=True)


def test_runs_stages_metrics_roundtrip(tmp_path):
    store = Store(tmp_path / "s.duckdb")
    store.upsert_run("r1", "tiny", config={"seed": 0}, git_sha="abc")
    store.set_stage("r1", "rl", "running", run_dir="runs/r1/rl")
    store.log_metrics("r1", "rl", 0, {"reward/mean": 0.25, "bad": float("nan")})
    store.log_metrics("r1", "rl", 1, {"reward/mean": 0.5})
    store.set_stage("r1", "rl", "done", summary={"steps": 2})
    rows = store.metrics("r1", "rl", names=["reward/mean"])
    assert [(r["step"], r["value"]) for r in rows] == [(0, 0.25), (1, 0.5)]
    assert store.metrics("r1", "rl", names=["bad"])[0]["value"] is None
    assert store.last_step("r1", "rl") == 1
    store.delete_metrics_after("r1", "rl", 0)
    assert store.last_step("r1", "rl") == 0
    (stage,) = store.stages("r1")
    assert stage["status"] == "done" and stage["summary"] == {"steps": 2}
    assert stage["run_dir"] == "runs/r1/rl" and stage["started_at"] and stage["finished_at"]


def test_eval_records_replace_not_duplicate(tmp_path):
    store = Store(tmp_path / "s.duckdb")
    rec = EvalRecord(run_id="r", model="base", benchmark="vstar", sample_id="1",
                     benchmark_version="1", prompt_version="image@v1", prompt_hash="h",
                     scorer="choice@1", prediction="A", stop_reason="answered", turns=2,
                     tool_calls=1, failed_calls=0, visual_tokens=64, total_tokens=300,
                     duration_s=0.5, trajectory={"turns": []}, scores={"overall": 1.0})
    store.add_eval_record(rec)
    store.add_eval_record(rec)
    assert store.eval_sample_ids("r", "base", "vstar") == {"1"}
    assert store.eval_scores("r", "base", "vstar") == {"1": {"overall": 1.0}}
    store.set_eval_aggregate("r", "base", "vstar", {"overall": 1.0}, n=1, benchmark_version="1",
                             prompt_version="image@v1", scorer="choice@1")
    store.set_eval_aggregate("r", "base", "vstar", {"overall": 0.5}, n=2, benchmark_version="1",
                             prompt_version="image@v1", scorer="choice@1")
    (agg,) = store.eval_aggregates(["r"])
    assert agg["value"] == 0.5 and agg["n"] == 2
    (full,) = store.eval_records("r", with_trajectory=True)
    assert full["trajectory"] == {"turns": []}


def _record(run_id="r", sample_id="1", fingerprint=None, model="rl"):
    return EvalRecord(run_id=run_id, model=model, benchmark="vstar", sample_id=sample_id,
                      benchmark_version="1", prompt_version="image@v1", prompt_hash="h",
                      scorer="choice@1", prediction="A", stop_reason="answered", turns=2,
                      tool_calls=1, failed_calls=0, visual_tokens=64, total_tokens=300,
                      duration_s=0.5, trajectory=None, scores={"overall": 1.0},
                      model_fingerprint=fingerprint)


def test_eval_writer_commits_in_batches_within_its_delay(tmp_path, monkeypatch):
    import pipelines.store as store_mod

    store = Store(tmp_path / "s.duckdb")
    clock = [100.0]
    monkeypatch.setattr(store_mod.time, "monotonic", lambda: clock[0])
    writer = store.eval_writer(max_delay_s=1.0)
    writer.add(_record(sample_id="1"))
    clock[0] += 0.5
    writer.add(_record(sample_id="2"))
    assert store.eval_sample_ids("r", "rl", "vstar") == set()  # both still within the delay
    clock[0] += 0.6
    writer.add(_record(sample_id="3"))  # the first is now 1.1 s old: all three commit together
    assert writer.pending == [] and writer._inflight is not None  # on the commit thread
    writer._inflight.result()
    assert store.eval_sample_ids("r", "rl", "vstar") == {"1", "2", "3"}
    writer.add(_record(sample_id="4"))
    writer.flush()
    assert store.eval_sample_ids("r", "rl", "vstar") == {"1", "2", "3", "4"}
    assert writer._committer is None  # no thread left behind
    writer.flush()  # nothing pending: a no-op


def test_a_batch_that_fails_on_the_commit_thread_raises_after_the_rest_are_in(tmp_path,
                                                                                monkeypatch):
    from concurrent.futures import wait

    import pipelines.store as store_mod

    monkeypatch.setattr(store_mod, "_COMMIT_REST_MAX_S", 0.0)
    store = Store(tmp_path / "s.duckdb")
    real = store.add_eval_records

    def flaky(records):
        if any(r.sample_id == "2" for r in records):
            raise OSError("disk full")
        real(records)

    monkeypatch.setattr(store, "add_eval_records", flaky)
    writer = store.eval_writer(max_delay_s=0.0)  # every sample its own batch when it can be
    raised = []
    for i in range(1, 5):
        try:
            writer.add(_record(sample_id=str(i)))
        except OSError as exc:  # the add after the failed batch: its own sample stays queued
            raised.append((i, str(exc)))
        wait([writer._inflight] if writer._inflight else [])  # done before the next sample
    try:
        writer.flush()
    except OSError as exc:
        raised.append(("flush", str(exc)))
    assert raised == [(3, "disk full")]  # once, by the next add
    assert store.eval_sample_ids("r", "rl", "vstar") == {"1", "3", "4"}


def test_samples_that_finish_faster_than_they_commit_join_one_batch_and_leave_gaps(
        tmp_path, monkeypatch):
    # One batch in flight at a time, and after each the store is left alone for as long as the
    # commit held it: a second process (the kill -9 test's reader, `pyvision report`) gets in.
    # Each sample its own queued batch used to hold the file back to back.
    store = Store(tmp_path / "s.duckdb")
    real = store.add_eval_records
    commits: list[tuple[float, float, int]] = []

    def slow(records):
        start = time.monotonic()
        time.sleep(0.03)
        real(records)
        commits.append((start, time.monotonic(), len(records)))

    monkeypatch.setattr(store, "add_eval_records", slow)
    writer = store.eval_writer(max_delay_s=0.0)
    for i in range(30):
        writer.add(_record(sample_id=str(i)))
        time.sleep(0.005)
    writer.flush()
    assert store.eval_sample_ids("r", "rl", "vstar") == {str(i) for i in range(30)}
    assert sum(n for _, _, n in commits) == 30 and len(commits) < 15
    # Between two background commits (the last commit is flush's, at once), the store rested.
    for (start, end, _), (next_start, _, _) in pairwise(commits[:-1]):
        assert next_start - end >= 0.9 * (end - start)


def test_stored_samples_count_as_done_only_for_the_same_weights(tmp_path):
    store = Store(tmp_path / "s.duckdb")
    store.add_eval_record(_record(sample_id="1", fingerprint="aaaa"))
    store.add_eval_record(_record(sample_id="2", fingerprint="bbbb"))
    store.add_eval_record(_record(sample_id="3", fingerprint=None))
    assert store.eval_sample_ids("r", "rl", "vstar") == {"1", "2", "3"}
    assert store.eval_sample_ids("r", "rl", "vstar", fingerprint="aaaa") == {"1"}
    assert store.eval_sample_ids("r", "rl", "vstar", fingerprint=None) == {"3"}


def test_a_version_1_store_gains_the_fingerprint_column(tmp_path):
    import duckdb

    from pipelines.store import MIGRATIONS_DIR

    path = tmp_path / "old.duckdb"
    con = duckdb.connect(str(path))
    con.execute("CREATE TABLE schema_version (version INTEGER PRIMARY KEY, name VARCHAR, "
                "applied_at TIMESTAMP DEFAULT current_timestamp)")
    con.execute((MIGRATIONS_DIR / "001_initial.sql").read_text())
    con.execute("INSERT INTO schema_version (version, name) VALUES (1, '001_initial')")
    con.execute("INSERT INTO eval_trajectories (run_id, model, benchmark, sample_id, "
                "benchmark_version, prompt_version, prompt_hash, scorer) "
                "VALUES ('r', 'rl', 'vstar', '1', '1', 'v1', 'h', 's')")
    con.close()
    store = Store(path)
    assert store.schema_version() == SCHEMA_VERSION >= 2
    # Rows written before fingerprints existed match only "unknown weights".
    assert store.eval_sample_ids("r", "rl", "vstar", fingerprint=None) == {"1"}
    assert store.eval_sample_ids("r", "rl", "vstar", fingerprint="aaaa") == set()


def test_forget_stage_drops_only_that_stage_of_that_run(tmp_path):
    store = Store(tmp_path / "s.duckdb")
    for run in ("r", "other"):
        store.log_metrics(run, "rl", 0, {"reward/mean": 0.5})
        store.log_metrics(run, "sft", 0, {"loss": 1.0})
        store.add_eval_record(_record(run_id=run))
        store.set_eval_aggregate(run, "rl", "vstar", {"overall": 1.0}, n=1, benchmark_version="1",
                                 prompt_version="image@v1", scorer="choice@1")
    store.forget_stage("r", "rl")
    assert [m["stage"] for m in store.metrics("r")] == ["sft"]
    assert store.eval_sample_ids("r", "rl", "vstar") == {"1"}
    store.forget_stage("r", "eval")
    assert store.eval_sample_ids("r", "rl", "vstar") == set()
    assert store.eval_scores("r", "rl", "vstar") == {}
    assert [a["run_id"] for a in store.eval_aggregates(["r", "other"])] == ["other"]
    assert len(store.metrics("other")) == 2 and store.eval_sample_ids("other", "rl", "vstar") == {"1"}


def test_failed_write_leaves_nothing(tmp_path):
    store = Store(tmp_path / "s.duckdb")
    rec = EvalRecord(run_id="r", model="base", benchmark="vstar", sample_id="1",
                     benchmark_version="1", prompt_version="p", prompt_hash="h", scorer="s",
                     prediction="A", stop_reason="answered", turns=1, tool_calls=0,
                     failed_calls=0, visual_tokens=0, total_tokens=1, duration_s=0.1,
                     trajectory=None, scores={"overall": "not-a-number"})  # type: ignore[dict-item]
    # The trajectory row is inserted before the scores fail: the transaction must roll it back.
    with pytest.raises(ValueError):
        store.add_eval_record(rec)
    assert store.eval_sample_ids("r", "base", "vstar") == set()


def test_judge_cache(tmp_path):
    store = Store(tmp_path / "s.duckdb")
    key = Store.judge_key("m", "prompt")
    assert store.judge_get(key) is None
    store.judge_put(key, "m", "Judgement: 1", 1.0)
    assert store.judge_get(key)["verdict"] == 1.0
    assert Store.judge_key("m", "prompt") == key != Store.judge_key("m2", "prompt")


BATCH = 7


def _writer(path: str, batches: int) -> None:
    store = Store(path)
    for step in range(batches):
        store.log_metrics("r", "rl", step, {f"m{i}": float(i) for i in range(BATCH)})
        time.sleep(0.005)


def test_concurrent_reader_never_sees_half_a_write(tmp_path):
    path = tmp_path / "s.duckdb"
    Store(path).migrate()
    ctx = mp.get_context("spawn")
    proc = ctx.Process(target=_writer, args=(str(path), 40))
    proc.start()
    seen = []
    reader = Store(path, read_only=True)
    deadline = time.monotonic() + 60
    while proc.is_alive() and time.monotonic() < deadline:
        seen.append(len(reader.metrics("r")))
    proc.join(30)
    assert proc.exitcode == 0
    seen.append(len(reader.metrics("r")))
    assert seen[-1] == 40 * BATCH
    assert all(n % BATCH == 0 for n in seen), "a reader saw part of a transaction"
    assert len(set(seen)) > 1, "reader and writer should have interleaved"


def test_weights_fingerprint_follows_the_weights_only(tmp_path):
    from pipelines.fsutil import weights_fingerprint

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    assert weights_fingerprint(model) is None  # no weights: identity unknown
    assert weights_fingerprint("Qwen/Qwen2.5-VL-7B-Instruct") is None
    big = model / "model-00001-of-00001.safetensors"
    with big.open("wb") as fh:  # over 64 MiB: sampled, not read whole
        fh.truncate(80 << 20)
    first = weights_fingerprint(model)
    (model / "config.json").write_text('{"use_cache": true}')
    (model / "checkpoint-10").mkdir()
    (model / "checkpoint-10" / "model.safetensors").write_bytes(b"x")
    assert weights_fingerprint(model) == first  # config and checkpoint folders do not count
    with big.open("r+b") as fh:  # retraining rewrites the tensors: the middle changes
        fh.seek(40 << 20)
        fh.write(b"\1")
    assert weights_fingerprint(model) != first


# -- a store that does not exist yet, bad store paths, a lock held by someone else ---------------


def test_a_new_store_is_created_by_its_first_write_not_before(tmp_path):
    path = tmp_path / "runs" / "s.duckdb"
    store = Store(path)
    assert not path.exists() and not path.parent.exists()
    assert store.runs() == [] and store.last_step("r", "rl") is None  # reads create nothing
    assert store.eval_sample_count("r") == 0 and not path.exists()
    store.upsert_run("r", "r")
    assert path.is_file() and Store(path, read_only=True).runs()[0]["run_id"] == "r"


@pytest.mark.parametrize("make, needle", [
    (lambda p: p.mkdir(), "is a folder, not a DuckDB file"),
    (lambda p: p.write_text("x" * 64), "is not a DuckDB database"),
    (lambda p: p.write_bytes(b""), "is not a DuckDB database"),
])
def test_bad_store_paths_are_one_line_errors(tmp_path, make, needle):
    path = tmp_path / "s.duckdb"
    make(path)
    for read_only in (False, True):
        with pytest.raises(UserError, match=needle):
            Store(path, read_only=read_only)


def test_a_duckdb_file_that_is_not_a_store_is_refused_untouched(tmp_path):
    mine = tmp_path / "mine.duckdb"
    con = duckdb.connect(str(mine))
    con.execute("CREATE TABLE runs (x INTEGER)")
    con.close()
    before = mine.read_bytes()
    for read_only in (True, False):
        with pytest.raises(UserError, match=r"is a DuckDB database but not a pyvision store "
                                            r"\(it holds table 'runs' and no schema_version\)"):
            Store(mine, read_only=read_only).runs()
    with pytest.raises(UserError, match="not a pyvision store"):
        Store(mine).upsert_run("r", "r")
    assert mine.read_bytes() == before  # no schema_version added to the user's database
    empty = tmp_path / "empty.duckdb"
    duckdb.connect(str(empty)).close()
    with pytest.raises(UserError, match="is an empty DuckDB file"):
        Store(empty, read_only=True)
    Store(empty).upsert_run("r", "r")  # written to, it becomes a store
    assert Store(empty, read_only=True).runs()[0]["run_id"] == "r"


def _a_store_with_runs(path: Path) -> bytes:
    store = Store(path)
    for i in range(300):
        store.log_metrics("r", "rl", i, {f"m{j}": float(i * j) for j in range(20)})
    return path.read_bytes()


def test_a_damaged_store_is_a_one_line_error_not_a_lock_wait(tmp_path, monkeypatch):
    import pipelines.store as store_module

    monkeypatch.setattr(store_module, "_LOCK_WAIT_S", 30.0)
    data = bytearray(_a_store_with_runs(tmp_path / "good.duckdb"))
    for i in range(5000, len(data), 997):  # flipped bytes: DuckDB's checksum "... in block ..."
        data[i] ^= 0xFF
    flipped, truncated = tmp_path / "flipped.duckdb", tmp_path / "truncated.duckdb"
    flipped.write_bytes(bytes(data))
    truncated.write_bytes((tmp_path / "good.duckdb").read_bytes()[: len(data) // 2])
    for path in (flipped, truncated):
        start = time.monotonic()
        with pytest.raises(UserError) as refused:
            Store(path, read_only=True).metrics("r", "rl")
        assert time.monotonic() - start < 10  # not waited out as if it were locked
        assert f"store {path} (" in refused.value.message
        assert "damaged" in refused.value.hint


def test_a_store_under_a_file_is_refused_before_anything_is_made(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(UserError, match="is a file"):
        Store(tmp_path / "f" / "s.duckdb")


def test_a_held_lock_names_its_holder(tmp_path, monkeypatch, capsys):
    import subprocess
    import sys

    import pipelines.store as store_module

    path = tmp_path / "s.duckdb"
    Store(path).upsert_run("a", "a")
    holder = subprocess.Popen(
        [sys.executable, "-c", ("import duckdb, sys, time\n"
                                "con = duckdb.connect(sys.argv[1], read_only=True)\n"
                                "print('ready', flush=True)\ntime.sleep(120)"), str(path)],
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "ready"
        monkeypatch.setattr(store_module, "_LOCK_WAIT_S", 1.5)
        monkeypatch.setattr(store_module, "_LOCK_NOTICE_S", 0.3)
        start = time.monotonic()
        with pytest.raises(UserError) as refused:
            Store(path).upsert_run("b", "b")
        assert time.monotonic() - start < 10
        message = refused.value.message
        assert f"is held by process {holder.pid} (" in message
        assert "duckdb.connect(sys.argv[1], read_only=True)" in message  # its command line
        assert "for over 2 s" in message
        notice = capsys.readouterr().err
        assert f"waiting for the store {path}: held by process {holder.pid}" in notice
    finally:
        holder.kill()
        holder.wait()
    Store(path).upsert_run("b", "b")  # once it is gone, the write goes through


def test_report_reads_through_one_connection(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from pyvision_cli.report import app
    from tests.pipelines.report.test_report import fill_store

    store = Store()
    fill_store(store, "a")
    fill_store(store, "b", shift=0.05)
    opened = []
    real_open = Store._open
    monkeypatch.setattr(Store, "_open", lambda self: opened.append(1) or real_open(self))
    import contextlib

    reading, rendered = [], []
    real_session = Store.session

    @contextlib.contextmanager
    def session(self):
        with real_session(self):
            reading.append(1)
            try:
                yield self
            finally:
                reading.pop()

    monkeypatch.setattr(Store, "session", session)

    def plots_with_the_lock_let_go(data, out):  # matplotlib is slow and beside the point here
        rendered.append(not reading)
        return {}

    import pipelines.report

    monkeypatch.setattr(pipelines.report, "make_plots", plots_with_the_lock_let_go)
    for fmt in ("json", "table", "html"):
        opened.clear()
        out = ["--out", str(tmp_path / "rep")] if fmt == "html" else []  # json / table print
        result = CliRunner().invoke(app, ["--format", fmt, *out])
        assert result.exit_code == 0, result.output
        # One to check the schema version, one for every read of the report (html: and one to
        # see whether there is anything to write): the lock is taken briefly, a few times, and
        # let go before any rendering. It used to be taken once per query.
        assert len(opened) == (3 if fmt == "html" else 2), (fmt, len(opened))
    assert rendered == [True]  # html rendered after the reads let the store go


def test_eval_records_in_multi_row_statements(tmp_path, monkeypatch):
    """A batch is written a few rows a statement (here 2, so chunks end mid-batch): every row
    lands once, a key given twice keeps its later record, an earlier copy of a sample (and its
    scores) is replaced, media shared by samples is stored once."""
    import dataclasses

    import pipelines.store as store_mod
    from pipelines.core.media import MediaBlob

    monkeypatch.setattr(store_mod, "_ROWS_PER_STATEMENT", 2)
    store = Store(tmp_path / "s.duckdb")
    blob = MediaBlob(sha256="ab" * 32, mime="image/jpeg", width=2, height=1, data=b"\xff\xd8")
    old = dataclasses.replace(_record(sample_id="3"), prediction="B", scores={"overall": 0.0,
                                                                                "stale": 1.0})
    store.add_eval_records([old])
    recs = [dataclasses.replace(_record(sample_id=str(i)), blobs=[blob],
                                prediction=None if i == 0 else "A") for i in range(5)]
    store.add_eval_records([*recs, dataclasses.replace(recs[1], prediction="C")])
    rows = {r["sample_id"]: r for r in store.eval_records("r")}
    assert sorted(rows) == ["0", "1", "2", "3", "4"]
    assert rows["0"]["prediction"] is None and rows["1"]["prediction"] == "C"
    assert rows["3"]["prediction"] == "A"
    assert store.eval_scores("r", "rl", "vstar")["3"] == {"overall": 1.0}
    assert store._query("SELECT count(*) AS n FROM media")[0]["n"] == 1


@pytest.mark.parametrize("reason", ["No space left on device", "Disk quota exceeded",
                                    "Read-only file system"])
def test_a_write_the_disk_refuses_is_one_line_and_keeps_what_was_stored(tmp_path, monkeypatch,
                                                                        reason):
    # A full disk used to end `pyvision eval` (or any stage) in DuckDB's traceback, exit 1.
    import contextlib

    store = Store(tmp_path / "s.duckdb")
    store.log_metrics("r", "rl", 0, {"loss": 1.0})
    connect = store._connect

    class DiskRefuses:
        def __init__(self, con: duckdb.DuckDBPyConnection) -> None:
            self.con = con

        def execute(self, sql: str, *args):
            if sql == "COMMIT":
                raise duckdb.TransactionException(
                    f'TransactionContext Error: Failed to commit: Could not write file '
                    f'"{store.path}.wal": {reason}')
            return self.con.execute(sql, *args)

    @contextlib.contextmanager
    def refusing():
        with connect() as con:
            yield DiskRefuses(con)

    monkeypatch.setattr(store, "_connect", refusing)
    with pytest.raises(UserError) as refused:
        store.log_metrics("r", "rl", 1, {"loss": 0.5})
    assert refused.value.message.startswith(f"cannot write the store {store.path} (")
    assert reason in refused.value.message and "free space on its disk" in refused.value.hint
    monkeypatch.undo()
    assert [m["step"] for m in store.metrics("r", "rl")] == [0]
    store.log_metrics("r", "rl", 1, {"loss": 0.5})  # room again: the store takes writes
    assert [m["step"] for m in store.metrics("r", "rl")] == [0, 1]


def test_resuming_rl_forgets_the_rollouts_after_its_checkpoint(tmp_path):
    store = Store(tmp_path / "s.duckdb")
    row = {"group_index": 0, "sample_index": 0, "task_id": "t", "group_status": "kept",
           "status": "kept", "reward": 1.0}
    for step in range(4):
        store.log_metrics("r", "rl", step, {"loss": 1.0})
        store.set_rollouts("r", step, [row])
    store.set_rollouts("other", 3, [row])
    store.delete_metrics_after("r", "rl", 1)  # resumed from the checkpoint after step 1
    assert sorted({m["step"] for m in store.metrics("r", "rl")}) == [0, 1]
    assert [r["step"] for r in store.rollouts(["r"])] == [0, 1]
    assert [r["step"] for r in store.rollouts(["other"])] == [3]
