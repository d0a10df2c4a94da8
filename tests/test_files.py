"""attnserve.files on real files: what lands on disk, its mode, and what a failed or killed write leaves."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from attnserve.files import read_json, remove_temporaries, write_atomic, write_json_atomic
from tests.server_process import REPO_ROOT


def mode_of(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_bytes_land_whole_with_mode_0644_over_an_old_file(tmp_path):
    target = tmp_path / "a.bin"
    target.write_bytes(b"old contents, longer than the new ones")
    os.chmod(target, 0o600)
    assert write_atomic(target, b"new") == target
    assert target.read_bytes() == b"new"
    assert mode_of(target) == 0o644  # not mkstemp's 0600, not the old file's mode
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.bin"]


def test_a_writer_gets_the_open_file_and_a_mode_can_be_asked(tmp_path):
    target = tmp_path / "nested" / "dir" / "b.bin"  # missing parents are made

    def writer(f) -> None:
        f.write(b"head-")
        f.write(bytes(range(256)))

    write_atomic(target, writer, mode=0o600)
    assert target.read_bytes() == b"head-" + bytes(range(256))
    assert mode_of(target) == 0o600


@pytest.mark.parametrize("error", [ValueError("disk said no"), KeyboardInterrupt()])
def test_a_writer_that_raises_leaves_the_target_and_no_temporary(tmp_path, error):
    target = tmp_path / "c.json"
    target.write_bytes(b'{"kept": true}\n')

    def writer(f) -> None:
        f.write(b"half of a new file")
        raise error

    with pytest.raises(type(error)):
        write_atomic(target, writer)
    assert target.read_bytes() == b'{"kept": true}\n'
    assert [p.name for p in tmp_path.iterdir()] == ["c.json"]


def test_a_failed_first_write_creates_nothing(tmp_path):
    def writer(f) -> None:
        raise OSError("no space left")

    with pytest.raises(OSError, match="no space left"):
        write_atomic(tmp_path / "never.bin", writer)
    assert list(tmp_path.iterdir()) == []


def test_json_round_trips_with_a_final_newline(tmp_path):
    data = {"key": "abc", "items": 3, "outputs": ["output", "attn_probs"], "nested": {"x": 1.5, "none": None}}
    path = write_json_atomic(tmp_path / "m.json", data)
    assert read_json(path) == data
    assert path.read_text(encoding="utf-8").endswith("}\n")
    assert mode_of(path) == 0o644


@pytest.mark.parametrize("text, kind", [("[1, 2]", "list"), ('"text"', "str"), ("3", "int"), ("null", "NoneType")])
def test_read_json_refuses_anything_but_an_object(tmp_path, text, kind):
    path = tmp_path / "x.json"
    path.write_text(text, encoding="utf-8")
    with pytest.raises(ValueError, match=f"expected a JSON object, got {kind}"):
        read_json(path)


def test_read_json_refuses_broken_json(tmp_path):
    path = tmp_path / "x.json"
    path.write_text('{"cut": ', encoding="utf-8")
    with pytest.raises(ValueError):
        read_json(path)


def test_a_killed_writer_leaves_only_a_temporary_that_remove_temporaries_clears(tmp_path):
    target = tmp_path / "part.npz"
    (tmp_path / "keep.npz").write_bytes(b"a finished file")
    (tmp_path / ".lock").write_bytes(b"")
    # A real process killed (SIGKILL) in the middle of its write: no handler runs, no cleanup.
    script = (
        "import os, signal, sys\n"
        "from pathlib import Path\n"
        "from attnserve.files import write_atomic\n"
        "def writer(f):\n"
        "    f.write(b'half'); f.flush()\n"
        "    os.kill(os.getpid(), signal.SIGKILL)\n"
        "write_atomic(Path(sys.argv[1]), writer)\n"
    )
    proc = subprocess.run([sys.executable, "-c", script, str(target)], cwd=REPO_ROOT, capture_output=True)
    assert proc.returncode == -9, proc.stderr
    assert not target.exists()
    left = [p for p in tmp_path.iterdir() if p.name not in ("keep.npz", ".lock")]
    assert len(left) == 1 and left[0].name.startswith(".part.npz.") and left[0].read_bytes() == b"half"

    assert remove_temporaries(tmp_path) == left
    assert sorted(p.name for p in tmp_path.iterdir()) == [".lock", "keep.npz"]
    assert remove_temporaries(tmp_path) == []
