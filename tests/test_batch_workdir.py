"""The batch job's work directory on real files: the typed manifest, the lock, parts written whole
(a SIGKILLed write leaves nothing the next run mistakes for a part)."""

from __future__ import annotations

import stat
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from attnserve.client.batch import BatchError, BatchJob, Manifest, WorkDir, discover_shards, fingerprint

from tests.server_process import REPO_ROOT


def a_manifest(tmp_path: Path, outputs=("output",)) -> Manifest:
    inp = tmp_path / "in.npz"
    if not inp.exists():
        rng = np.random.default_rng(0)
        np.savez(inp, query=rng.standard_normal((5, 2, 4)), key=rng.standard_normal((5, 3, 4)),
                 value=rng.standard_normal((5, 3, 4)))
    job = BatchJob(model="m", input_path=inp, output_path=tmp_path / "out.npz", outputs=outputs)
    shards, _ = discover_shards(inp)
    return Manifest.start(fingerprint(job, shards), items=5, batch_size=2)


def test_the_manifest_round_trips_and_pinning_makes_a_new_one(tmp_path):
    workdir = WorkDir(tmp_path / "out.npz.parts")
    workdir.lock()
    manifest = a_manifest(tmp_path)
    workdir.write_manifest(manifest)
    assert workdir.read_manifest() == manifest and not manifest.pinned

    pinned = manifest.pin("3")
    assert (pinned.served_version, pinned.pinned, manifest.served_version) == ("3", True, None)
    workdir.write_manifest(pinned)
    assert workdir.read_manifest() == pinned
    assert pinned.key == manifest.key == manifest.fingerprint.key
    assert a_manifest(tmp_path, outputs=("output", "attn_probs")).key != manifest.key
    workdir.unlock()


@pytest.mark.parametrize("text", ['{"key": "k"}', '[]', '{"key": 1, "items": 3}', "not json"])
def test_a_manifest_this_code_did_not_write_is_refused_by_name(tmp_path, text):
    workdir = WorkDir(tmp_path / "parts")
    workdir.lock()
    (workdir.path / "manifest.json").write_text(text)
    with pytest.raises(BatchError, match="manifest.json is unreadable .*delete"):
        workdir.read_manifest()
    workdir.unlock()


def test_one_run_at_a_time(tmp_path):
    first, second = WorkDir(tmp_path / "parts"), WorkDir(tmp_path / "parts")
    first.lock()
    with pytest.raises(BatchError, match="another batch job is writing"):
        second.lock()
    first.unlock()
    second.lock()  # free again
    second.unlock()


def test_parts_are_listed_in_order_and_written_0644(tmp_path):
    workdir = WorkDir(tmp_path / "parts")
    workdir.lock()
    for start, stop in ((8, 16), (0, 8), (16, 20)):
        workdir.write_part(start, stop, {"output": np.full((stop - start, 2), start, dtype=np.float32)})
    assert workdir.parts() == [(0, 8), (8, 16), (16, 20)]
    with np.load(workdir.part_path(8, 16)) as part:
        np.testing.assert_array_equal(part["output"], np.full((8, 2), 8, dtype=np.float32))
    assert stat.S_IMODE(workdir.part_path(0, 8).stat().st_mode) == 0o644
    assert sorted(p.name for p in workdir.path.iterdir()) == [
        ".lock", "000000000000-000000000008.npz", "000000000008-000000000016.npz", "000000000016-000000000020.npz"]
    workdir.remove()
    assert not workdir.path.exists()


def test_a_part_killed_mid_write_is_not_a_part_and_the_next_lock_clears_it(tmp_path):
    parts = tmp_path / "parts"
    # np.savez writes the first array, then converts the second: which kills the process mid-write.
    script = (
        "import os, signal, sys\n"
        "from pathlib import Path\n"
        "import numpy as np\n"
        "from attnserve.client.batch import WorkDir\n"
        "class Kill:\n"
        "    def __array__(self, *a, **k):\n"
        "        os.kill(os.getpid(), signal.SIGKILL)\n"
        "w = WorkDir(Path(sys.argv[1])); w.lock()\n"
        "w.write_part(0, 8, {'output': np.zeros((8, 2), np.float32), 'attn_probs': Kill()})\n"
    )
    proc = subprocess.run([sys.executable, "-c", script, str(parts)], cwd=REPO_ROOT, capture_output=True)
    assert proc.returncode == -9, proc.stderr
    workdir = WorkDir(parts)
    assert workdir.parts() == []
    leftovers = [p.name for p in parts.iterdir() if p.name != ".lock"]
    assert len(leftovers) == 1 and leftovers[0].endswith(".tmp"), leftovers
    workdir.lock()
    assert [p.name for p in parts.iterdir()] == [".lock"]
    workdir.unlock()
