"""attnserve.files on real files: what lands on disk, its mode, and what a failed or killed write leaves."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from attnserve.files import (
    MAX_JSON_BYTES,
    MAX_JSON_DEPTH,
    FileRefused,
    check_regular,
    json_depth,
    read_bounded,
    read_json,
    remove_temporaries,
    write_atomic,
    write_json_atomic,
)
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


# -- read_bounded and read_json's bounds: what the server and the tools read --------------------


def _in_thread(call):
    """call() on a daemon thread, joined with a bound: on the old code a FIFO blocked the open forever."""
    import threading

    outcome = {}

    def run() -> None:
        try:
            outcome["value"] = call()
        except BaseException as err:  # handed to the test
            outcome["error"] = err

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout=30)
    assert not thread.is_alive(), "the read blocked"
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


def test_read_bounded_refuses_a_fifo_without_blocking(tmp_path):
    os.mkfifo(tmp_path / "fifo")
    with pytest.raises(FileRefused, match=r"not a regular file \(a FIFO\)"):
        _in_thread(lambda: read_bounded(tmp_path / "fifo", 100))
    with pytest.raises(FileRefused, match=r"not a regular file \(a FIFO\)"):
        _in_thread(lambda: read_json(tmp_path / "fifo"))


def test_read_bounded_refuses_a_link_to_dev_zero_and_a_directory(tmp_path):
    (tmp_path / "zero").symlink_to("/dev/zero")
    with pytest.raises(FileRefused, match=r"not a regular file \(a character device\)"):
        _in_thread(lambda: read_json(tmp_path / "zero"))
    with pytest.raises(FileRefused, match=r"not a regular file \(a directory\)"):
        read_bounded(tmp_path, 100)
    with pytest.raises(FileRefused, match=r"not a regular file \(a character device\)"):
        check_regular(tmp_path / "zero")
    with pytest.raises(FileNotFoundError):  # a missing file stays what it was
        read_bounded(tmp_path / "missing", 100)


def test_read_bounded_reads_up_to_its_bound_and_follows_links_to_regular_files(tmp_path):
    (tmp_path / "exact").write_bytes(b"x" * 100)
    (tmp_path / "link").symlink_to(tmp_path / "exact")  # as a Kubernetes ConfigMap mounts its files
    assert read_bounded(tmp_path / "link", 100) == b"x" * 100
    assert check_regular(tmp_path / "link").st_size == 100
    (tmp_path / "over").write_bytes(b"x" * 101)
    with pytest.raises(FileRefused, match="larger than 100 bytes"):
        read_bounded(tmp_path / "over", 100)
    (tmp_path / "big.json").write_bytes(b"{}" + b" " * MAX_JSON_BYTES)
    with pytest.raises(FileRefused, match=f"larger than {MAX_JSON_BYTES} bytes"):
        read_json(tmp_path / "big.json")


def test_read_json_refuses_deep_nesting_with_a_message_never_a_recursion_error(tmp_path):
    deep = tmp_path / "deep.json"
    deep.write_text('{"a": ' + "[" * 100_000 + "]" * 100_000 + "}")
    with pytest.raises(FileRefused, match=f"nested deeper than {MAX_JSON_DEPTH} levels"):
        read_json(deep)
    just_over = tmp_path / "over.json"
    just_over.write_text('{"a": ' + "[" * MAX_JSON_DEPTH + "]" * MAX_JSON_DEPTH + "}")
    with pytest.raises(FileRefused, match="nested deeper"):
        read_json(just_over)
    at_bound = tmp_path / "at.json"
    at_bound.write_text('{"a": ' + "[" * (MAX_JSON_DEPTH - 1) + "]" * (MAX_JSON_DEPTH - 1) + "}")
    assert json_depth(read_json(at_bound)) == MAX_JSON_DEPTH


def test_log_quoting_leaves_plain_names_and_escapes_newlines_and_escape_sequences():
    from attnserve.server.quoting import escaped, logged

    assert logged("cross_attention") == "cross_attention"  # log lines stay greppable
    assert logged("bad\nname\x1b[31m") == "'bad\\nname\\x1b[31m'"
    assert logged("a b") == "'a b'"
    assert escaped("/m/bad\nname\x1b[31m/config.json: not a regular file") == (
        "/m/bad\\nname\\x1b[31m/config.json: not a regular file")
