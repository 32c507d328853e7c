"""`pyvision doctor`: is this installation able to run each part of the pipeline?

Every check returns a :class:`Check` with a status (``ok`` | ``missing`` | ``warn``), what was
found, and what to do when it is not ok. Checks never raise: a broken import is a finding.
"""

from __future__ import annotations

import importlib.metadata as md
import os
import platform
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from pipelines.rundir import package_versions

HUB_URL = "https://huggingface.co/api/models/Qwen/Qwen2.5-VL-7B-Instruct"

# Package -> (needed for, fix). vllm is optional: it cannot share this environment with verl and
# LLaMA-Factory (conflicting torch/transformers pins), so clusters install it separately.
PACKAGES: dict[str, tuple[str, str]] = {
    "torch": ("everything", "make install"),
    "torchvision": ("Qwen2.5-VL processors", "make install"),
    "transformers": ("models and the local engine", "make install"),
    "verl": ("RL at scale (pyvision rl --engine verl)", "make install"),
    "llamafactory": ("SFT (pyvision sft)", "make install"),
    "lmms-eval": ("lmms-eval interoperability", "make install"),
    "duckdb": ("the experiment store", "make install"),
    "datasets": ("dataset download and loading", "make install"),
    "huggingface-hub": ("hub downloads", "make install"),
    "decord": ("video in the sandbox", "make install"),
    "av": ("writing synthetic videos", "make install"),
    "math-verify": ("maths verifier", "make install"),
    "vllm": ("--engine vllm (optional)", ("install vLLM in a separate GPU environment: "
                                          "pip install vllm (see README, 'Evaluation')")),
}
OPTIONAL = {"vllm"}


@dataclass(frozen=True)
class Check:
    name: str
    status: str  # ok | missing | warn
    found: str
    fix: str = ""


def _package_checks() -> list[Check]:
    versions = package_versions(tuple(PACKAGES))
    out = []
    for name, (purpose, fix) in PACKAGES.items():
        v = versions.get(name)
        if v:
            out.append(Check(f"package {name}", "ok", f"{v} ({purpose})"))
        else:
            status = "warn" if name in OPTIONAL else "missing"
            out.append(Check(f"package {name}", status, f"not installed ({purpose})", fix))
    return out


def _torch_check() -> Check:
    try:
        import torch
    except Exception as exc:  # noqa: BLE001 - any import failure is a finding
        return Check("torch device", "missing", f"torch does not import: {exc}", "make install")
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if n:
        names = ", ".join(sorted({torch.cuda.get_device_name(i) for i in range(n)}))
        return Check("torch device", "ok", f"cuda, {n} GPU(s): {names}")
    return Check("torch device", "ok", f"cpu only, {os.cpu_count()} cores (0 GPUs); the embedded "
                 "default runs here, GPU recipes need a CUDA machine")


def _bwrap_check() -> Check:
    path = shutil.which("bwrap")
    if not path:
        return Check("sandbox isolation", "warn", "bubblewrap not found: sandbox falls back to "
                     "rlimits only, which is no security boundary",
                     "apt-get install bubblewrap")
    try:
        proc = subprocess.run([path, "--ro-bind", "/", "/", "--unshare-all", "--die-with-parent",
                               "true"], capture_output=True, text=True, timeout=10, check=False)
    except (OSError, subprocess.SubprocessError) as exc:
        return Check("sandbox isolation", "warn", f"bwrap at {path} failed to run: {exc}",
                     "check that user namespaces are enabled (sysctl kernel.unprivileged_userns_clone=1)")
    if proc.returncode != 0:
        return Check("sandbox isolation", "warn",
                     f"bwrap at {path} cannot create namespaces: {proc.stderr.strip()[:120]}",
                     "enable user namespaces, or run in a container that allows them")
    return Check("sandbox isolation", "ok", f"bubblewrap {path} creates namespaces")


SANDBOX_LIBRARIES = {"np": "numpy", "Image": "PIL", "plt": "matplotlib", "decord": "decord"}


def _sandbox_runtime_check() -> Check:
    """Start a sandbox and list the libraries the model's code finds preloaded there.

    The sandbox runs ``python -I`` in an emptied environment, so a library the host imports (from
    PYTHONPATH, say) may still be missing inside; a missing decord fails every video task.
    """
    import warnings

    start = time.monotonic()
    try:
        from pipelines.agent.sandbox import Sandbox
        from pipelines.config.sandbox import SandboxConfig

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # no bubblewrap: the isolation check reports it
            with Sandbox(SandboxConfig(timeout_s=30)) as sbx:
                result = sbx.run(f"print(' '.join(k for k in {sorted(SANDBOX_LIBRARIES)!r} "
                                 "if k in globals()))")
    except Exception as exc:  # noqa: BLE001 - a sandbox that cannot start is the finding
        return Check("sandbox runtime", "missing", f"a sandbox does not start: {exc}",
                     "run `pyvision sandbox run` to see the error; reinstall with make install")
    if result.status != "ok":
        return Check("sandbox runtime", "missing",
                     f"code in a new sandbox ended with {result.status}: {result.stderr[-200:]}",
                     "reinstall with make install")
    have = set(result.stdout.split())
    lacking = [lib for name, lib in SANDBOX_LIBRARIES.items() if name not in have]
    ms = (time.monotonic() - start) * 1000
    if lacking:
        return Check("sandbox runtime", "warn",
                     f"not importable inside the sandbox: {', '.join(lacking)}"
                     + (" (video tasks fail)" if "decord" in lacking else ""),
                     f"install {', '.join(lacking)} for {sys.executable}, in its site-packages "
                     "or on PYTHONPATH")
    return Check("sandbox runtime", "ok",
                 f"starts in {ms:.0f} ms with {', '.join(SANDBOX_LIBRARIES.values())} preloaded")


def _store_check(store_path: Path) -> Check:
    if not store_path.exists():
        from pipelines.errors import UserError
        from pipelines.inputs import check_store_path

        try:  # it will be created on the first run: that must be possible
            check_store_path(store_path, write=True)
        except UserError as exc:
            return Check("store", "warn", exc.message, exc.hint or "")
        return Check("store", "ok", f"{store_path} (not created yet; made on first run)")
    try:
        from pipelines.store import SCHEMA_VERSION, Store

        version = Store(store_path, read_only=True).schema_version()
    except Exception as exc:  # noqa: BLE001
        return Check("store", "warn", f"{store_path} cannot be read: {exc}",
                     "pass --store elsewhere or move the file away")
    status = "ok" if version <= SCHEMA_VERSION else "warn"
    return Check("store", status, f"{store_path} (schema v{version}, this pyvision v{SCHEMA_VERSION})",
                 "" if status == "ok" else "upgrade pyvision")


def _hub_check(timeout_s: float) -> Check:
    if os.environ.get("HF_HUB_OFFLINE") == "1":
        return Check("model hub", "warn", "HF_HUB_OFFLINE=1: hub access disabled",
                     "unset HF_HUB_OFFLINE to download models and datasets")
    import httpx

    start = time.monotonic()
    try:
        resp = httpx.get(HUB_URL, timeout=timeout_s, follow_redirects=True)
    except httpx.HTTPError as exc:
        return Check("model hub", "warn",
                     f"huggingface.co unreachable ({type(exc).__name__}); offline use only",
                     "use the embedded tiny-cpu recipe, or `pyvision data import` / local model "
                     "paths made elsewhere")
    ms = (time.monotonic() - start) * 1000
    if resp.status_code >= 500:
        return Check("model hub", "warn", f"huggingface.co answered HTTP {resp.status_code}",
                     "retry later")
    return Check("model hub", "ok", f"huggingface.co answers (HTTP {resp.status_code}, {ms:.0f} ms)")


def run_checks(store_path: Path, *, hub_timeout_s: float = 3.0, check_hub: bool = True) -> list[Check]:
    checks = [Check("python", "ok" if sys.version_info[:2] == (3, 11) else "warn",
                    f"{platform.python_version()} ({sys.executable})",
                    "" if sys.version_info[:2] == (3, 11) else "use Python 3.11 (the tested one)")]
    try:
        checks.append(Check("pyvision", "ok", md.version("pyvision-rl")))
    except md.PackageNotFoundError:
        checks.append(Check("pyvision", "missing", "package metadata missing", "make install"))
    checks += _package_checks()
    checks.append(_torch_check())
    checks.append(_bwrap_check())
    checks.append(_sandbox_runtime_check())
    checks.append(_store_check(store_path))
    if check_hub:
        checks.append(_hub_check(hub_timeout_s))
    return checks


def checks_as_json(checks: list[Check]) -> dict:
    return {"ok": all(c.status != "missing" for c in checks), "checks": [asdict(c) for c in checks]}
