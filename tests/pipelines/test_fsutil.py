"""All-or-nothing writes publish what they write with the modes a plain write would give."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from pipelines.fsutil import atomic_dir, atomic_write_text


@pytest.fixture
def umask():
    old = os.umask(0o022)
    yield lambda mask: os.umask(mask)
    os.umask(old)


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_written_files_and_folders_get_the_umasks_mode_not_a_temp_files(tmp_path, umask):
    # mkstemp's 0600 and mkdtemp's 0700 left reports, manifests and data readable to their
    # writer only (a web server or a colleague could not open report.html).
    atomic_write_text(tmp_path / "report.html", "<html/>")
    with atomic_dir(tmp_path / "out") as tmp:
        (tmp / "rows.jsonl").write_text("{}\n")
    assert _mode(tmp_path / "report.html") == 0o644
    assert _mode(tmp_path / "out") == 0o755
    umask(0o077)
    atomic_write_text(tmp_path / "private.txt", "x")
    assert _mode(tmp_path / "private.txt") == 0o600


def test_a_rewritten_file_keeps_its_mode(tmp_path, umask):
    target = tmp_path / "manifest.json"
    target.write_text("{}")
    target.chmod(0o640)
    atomic_write_text(target, '{"a": 1}')
    assert _mode(target) == 0o640 and target.read_text() == '{"a": 1}'
