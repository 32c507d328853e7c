"""Run directories: ``<runs_dir>/<run-id>/<stage>/`` that describe themselves.

Each stage directory holds ``config.yaml`` (the resolved recipe, every default spelled out),
``environment.json`` (package versions, Python, git sha, command line) and, written last,
``manifest.json`` (outputs, typed per stage in :mod:`pipelines.manifest`, and summary). The
manifest's existence means "this stage finished": a re-run skips such a stage unless ``--force``.
A re-run with a different resolved config is refused rather than mixing two configs under one run
id.

Every stage, run by its own command or by ``pyvision run``, goes through the same two steps:
:meth:`StageDir.finished` (a finished stage is skipped, its manifest shown) and
:meth:`StageDir.running` (begin, run, record a failure; the stage writes its manifest last with
:meth:`StageDir.finish`).
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import importlib.metadata as md
import platform
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel

from pipelines.errors import ConfigChanged, UserError
from pipelines.fsutil import atomic_write_json, atomic_write_text
from pipelines.manifest import OUTPUTS, OutputsT, StageManifest, read_manifest

STAGES = ("data", "sft", "rl", "merge", "eval", "report")
MANIFEST = "manifest.json"
KEY_PACKAGES = ("torch", "torchvision", "transformers", "verl", "llamafactory", "lmms-eval",
                "vllm", "duckdb", "datasets", "huggingface-hub", "pydantic", "typer", "decord",
                "av", "pillow", "numpy", "math-verify", "pyvision-rl")
_RUN_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
RUN_ID_RULE = ("letters, digits, '.', '_' and '-', starting with a letter or digit, at most 128 "
               "characters")


def earlier_stages_hint(run_id: str) -> str:
    """How `pyvision run` gets a stage's missing inputs: from the stages before it."""
    return f"run the earlier stages first (pyvision run RECIPE --run-id {run_id})"


def package_versions(names: tuple[str, ...] = KEY_PACKAGES) -> dict[str, str | None]:
    """Installed versions, read from metadata (imports nothing)."""
    out: dict[str, str | None] = {}
    for name in names:
        try:
            out[name] = md.version(name)
        except md.PackageNotFoundError:
            out[name] = None
    return out


def git_sha(cwd: str | Path | None = None) -> str | None:
    """The checkout's commit (with ``-dirty`` when it has local changes), or None."""
    where = Path(cwd) if cwd else Path(__file__).resolve().parent.parent
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=where, capture_output=True,
                             text=True, timeout=5, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               cwd=where, capture_output=True, text=True, timeout=5,
                               check=False).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return sha + ("-dirty" if dirty else "") if sha else None


def new_run_id(name: str) -> str:
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    return f"{name}-{stamp}"


def valid_run_id(run_id: str) -> bool:
    """The one rule for run ids, in every command: a single path component, never '..'."""
    return bool(_RUN_ID_RE.fullmatch(run_id))


def check_run_id(run_id: str) -> str:
    if not valid_run_id(run_id):
        raise UserError(f"invalid run id '{run_id}'", hint=f"use {RUN_ID_RULE}")
    return run_id


def _flatten(d: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(d, dict):
        out: dict[str, Any] = {}
        for k, v in d.items():
            out.update(_flatten(v, f"{prefix}{k}."))
        return out
    return {prefix.rstrip("."): d}


@dataclass
class StageDir:
    """One stage of one run, on disk and in the store."""

    runs_dir: Path
    run_id: str
    stage: str
    config: BaseModel
    store: Any = None
    recipe_path: str | None = None
    started: bool = field(default=False, init=False)
    _finished_summary: dict[str, Any] | None = field(default=None, init=False, repr=False)
    """The summary of the manifest this attempt wrote (None until :meth:`finish` wrote it)."""

    @property
    def path(self) -> Path:
        return self.runs_dir / self.run_id / self.stage

    @property
    def run_path(self) -> Path:
        return self.runs_dir / self.run_id

    @property
    def manifest_path(self) -> Path:
        return self.path / MANIFEST

    def is_complete(self) -> bool:
        return self.manifest_path.is_file()

    def manifest(self) -> StageManifest:
        """This finished stage's manifest, validated."""
        return read_manifest(self.manifest_path, OUTPUTS[self.stage])

    def outputs_of(self, kind: type[OutputsT]) -> OutputsT | None:
        """The outputs of this run's ``kind.stage`` stage, validated; None when that stage has
        not finished."""
        path = self.run_path / kind.stage / MANIFEST
        return read_manifest(path, kind).outputs if path.is_file() else None

    def check_model(self, model: str, what: str) -> None:
        """:func:`pipelines.inputs.check_model`; for a model inside this run's folder (an earlier
        stage made it and its manifest names it) that is gone or broken, deleted or edited by
        hand since, the fix is to redo the stage that made it, not to pass another folder."""
        from pipelines.inputs import check_model

        try:
            check_model(model, what)
        except UserError as exc:
            made = Path(model).expanduser().resolve()
            if not made.is_relative_to(self.run_path) or made == self.run_path or \
                    made.relative_to(self.run_path).parts[0] not in STAGES:
                raise
            stage = made.relative_to(self.run_path).parts[0]
            raise UserError(exc.message, hint=f"redo the {stage} stage that made it: pass --from "
                                              f"{stage} --force to the run's `pyvision run`"
                            ) from None

    def _config_dict(self) -> dict[str, Any]:
        return self.config.model_dump(mode="json")

    def prior_attempt(self) -> str | None:
        """What an earlier, unfinished attempt at this stage left behind (its folder, its metrics
        in the store), or None when there was none."""
        found = []
        if (self.path / "config.yaml").is_file():
            found.append(f"its folder {self.path}")
        if self.store is not None:
            step = self.store.last_step(self.run_id, self.stage)
            if step is not None:
                found.append(f"metrics up to step {step} in the store")
        return " and ".join(found) or None

    def check_rerun(self, *, resume: bool, force: bool) -> None:
        """Refuse to start an unfinished stage again from scratch without being told how:
        ``--resume`` continues it, ``--force`` starts it over (and forgets its metrics). Without
        either, a second set of metric rows would follow the first under the same run id."""
        if resume or force:
            return
        found = self.prior_attempt()
        if found:
            raise UserError(f"{self.stage} of run '{self.run_id}' was started before ({found})",
                            hint="pass --resume to continue it, --force to start it over, or "
                                 "--run-id NEW for a separate run")

    def check_same_config(self, hint: str | None = None) -> None:
        """Refuse (:class:`ConfigChanged`) to continue a run whose stored config differs from
        this one."""
        stored = self.path / "config.yaml"
        if not stored.is_file():
            return
        old = _flatten(yaml.safe_load(stored.read_text(encoding="utf-8")) or {})
        new = _flatten(self._config_dict())
        # A field added by a newer pyvision is absent from configs written before it; at its
        # default it changes nothing, so it must not block resuming those runs. A field that no
        # longer exists cannot affect this run either.
        defaults = _flatten(type(self.config)().model_dump(mode="json"))
        changed = sorted(k for k in new if old.get(k, defaults.get(k)) != new[k])
        if changed:
            raise ConfigChanged(f"run '{self.run_id}' stage '{self.stage}'", changed,
                                hint=hint or "pass --force to redo the stage, or --run-id NEW "
                                "for a separate run")

    def begin(self, *, force: bool = False, resume: bool = False,
              config_hint: str | None = None) -> None:
        """Create the stage directory and record config and environment (manifest comes last).

        ``force`` starts the stage over: its folder and its metrics and results in the store are
        removed. ``resume`` keeps them (the engine continues from its last checkpoint) and
        requires the same config, unless ``force`` is given too: ``resume`` and ``force``
        together continue from the checkpoint with the new config, which replaces the old one.
        ``config_hint`` is the fix a config mismatch suggests.
        """
        if force and not resume:
            if self.path.exists():
                shutil.rmtree(self.path)
            if self.store is not None:
                # A redone stage must not leave the old attempt's metrics or results behind.
                self.store.forget_stage(self.run_id, self.stage)
        elif not force:
            self.check_same_config(config_hint)
        self.path.mkdir(parents=True, exist_ok=True)
        atomic_write_text(self.path / "config.yaml",
                          yaml.safe_dump(self._config_dict(), sort_keys=False))
        atomic_write_json(self.path / "environment.json", {
            "python": sys.version.split()[0],
            "platform": platform.platform(),
            "argv": sys.argv,
            "git_sha": git_sha(),
            "packages": package_versions(),
            "started_at": _dt.datetime.now().isoformat(timespec="seconds"),
        })
        if self.store is not None:
            self.store.upsert_run(self.run_id, getattr(self.config, "name", self.run_id),
                                  recipe_path=self.recipe_path, config=self._config_dict(),
                                  git_sha=git_sha())
            self.store.set_stage(self.run_id, self.stage, "running", run_dir=str(self.path))
        self._finished_summary = None
        self.started = True

    def finish(self, outputs: Mapping[str, Any], summary: Mapping[str, Any] | None = None) -> None:
        """Write ``manifest.json`` (last) and mark the stage done in the store. ``outputs`` must
        have the stage's shape (:data:`pipelines.manifest.OUTPUTS`): a stage that writes
        something later stages cannot read fails here, before its manifest exists.

        The manifest decides: once it is written the stage has finished, even if the store's
        update after it never happens (Ctrl-C, a crash in between). :meth:`running` then does
        not record a failure, and :meth:`finished` corrects a store that still says otherwise."""
        manifest = {
            "run_id": self.run_id,
            "stage": self.stage,
            "finished_at": _dt.datetime.now().isoformat(timespec="seconds"),
            "outputs": OUTPUTS[self.stage].model_validate(dict(outputs)).to_json(),
            "summary": dict(summary or {}),
        }
        atomic_write_json(self.manifest_path, manifest)
        self._finished_summary = manifest["summary"]
        if self.store is not None:
            self.store.set_stage(self.run_id, self.stage, "done", summary=manifest["summary"])

    def fail(self, message: str) -> None:
        if self.store is not None:
            self.store.set_stage(self.run_id, self.stage, "failed", summary={"error": message})

    def finished(self, *, redo: bool = False) -> StageManifest | None:
        """The manifest of this stage when it finished and is not to be redone: the caller skips
        the stage. None when the stage is to run (through :meth:`running`).

        A store that still says this finished stage is running or failed (the command was
        stopped between writing the manifest and updating the store) is marked done, with the
        manifest's summary: the two agree again. A store with no row for the stage is left
        alone (a store other than the run's), and so is a stage that another command is running
        now (its lock is held: a forced rerun keeps the old manifest until it finishes)."""
        if redo or not self.is_complete():
            return None
        manifest = self.manifest()
        if (self.store is not None and not getattr(self.store, "read_only", False)
                and not self._lock_held()):
            row = next((r for r in self.store.stages(self.run_id) if r["stage"] == self.stage),
                       None)
            if row is not None and row["status"] != "done":
                self.store.set_stage(self.run_id, self.stage, "done", summary=manifest.summary)
        return manifest

    @contextlib.contextmanager
    def running(self, *, force: bool = False, resume: bool = False,
                config_hint: str | None = None, refuse_unfinished: bool = False) -> Iterator[None]:
        """One attempt at the stage: :meth:`begin` (``force``, ``resume`` and ``config_hint`` as
        there; ``refuse_unfinished`` first refuses an unfinished stage without ``resume`` or
        ``force``, :meth:`check_rerun`), then the block, which ends with :meth:`finish`.

        When the block raises (Ctrl-C and bad input included) the failure is recorded in the
        store and the exception goes on: the manifest is the block's last write, so a failed
        attempt leaves none, and the next run starts the stage again or continues it from its
        checkpoints. Once :meth:`finish` has written the manifest the stage has finished: an
        exception after it (Ctrl-C while the store is updated) records no failure, and the
        store is marked done once more (or by the next :meth:`finished`)."""
        with self._attempt_lock():
            if refuse_unfinished:
                self.check_rerun(resume=resume, force=force)
            self.begin(force=force, resume=resume, config_hint=config_hint)
            try:
                yield
            except BaseException as exc:
                if self._finished_summary is None:
                    self.fail(str(exc))
                elif self.store is not None:
                    with contextlib.suppress(Exception):  # the exception that stopped it goes on
                        self.store.set_stage(self.run_id, self.stage, "done",
                                             summary=self._finished_summary)
                raise

    @property
    def lock_path(self) -> Path:
        """The stage's lock file, ``<run>/.<stage>.lock`` (held for one attempt)."""
        return self.run_path / f".{self.stage}.lock"

    def _lock_held(self) -> bool:
        """Whether a command (this process's included) holds this stage's lock now."""
        import fcntl
        import os

        try:
            fd = os.open(self.lock_path, os.O_RDONLY)
        except OSError:
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        finally:
            os.close(fd)  # closing the descriptor lets go of the shared lock it took
        return False

    @contextlib.contextmanager
    def _attempt_lock(self) -> Iterator[None]:
        """Hold this stage's lock (``<run>/.<stage>.lock``) for one attempt: a second command on
        the same stage of the same run (another terminal, a second `pyvision run`) is refused at
        once, instead of writing into the same folder and marking the first one's stage failed.
        The kernel lets go of the lock when its process ends, however it ends."""
        import fcntl
        import os

        self.run_path.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT, 0o666)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                from pipelines.store import describe_process

                pid = os.read(fd, 32).decode(errors="replace").strip()
                holder = describe_process(int(pid)) if pid.isdigit() else "another process"
                raise UserError(f"{self.stage} of run '{self.run_id}' is being run by {holder}",
                                hint="wait for it to finish, or pass --run-id NEW for a "
                                     "separate run") from None
            os.ftruncate(fd, 0)
            os.write(fd, str(os.getpid()).encode())
            yield
        finally:
            os.close(fd)


def stage_dir(config: BaseModel, stage: str, run_id: str | None, *, runs_dir: str | Path | None,
              store: Any = None, recipe_path: str | None = None) -> StageDir:
    """The StageDir for ``stage`` of ``run_id`` (default run id: the recipe's name)."""
    name = getattr(config, "name", "run")
    rid = check_run_id(run_id or name)
    # Absolute: stages hand these paths to subprocesses (LLaMA-Factory, verl) that run in other
    # working directories, and later stages read them back from manifests.
    root = Path(runs_dir if runs_dir is not None else getattr(config, "runs_dir", "runs")).resolve()
    from pipelines.inputs import check_writable_dir

    check_writable_dir(root, "the runs folder")
    return StageDir(root, rid, stage, config, store=store, recipe_path=recipe_path)
