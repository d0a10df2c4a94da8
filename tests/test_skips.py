"""CI fails on an unexpected skip (tests/conftest.py): only CUDA tests may skip without a GPU; and
an e2e run whose servers would fall back to the Python data plane does not start there."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.server_process import DATA_PLANE_ENV, REPO_ROOT, without_native_env

pytestmark = pytest.mark.e2e  # runs pytest in a subprocess

SKIPPING = '''
import pytest

def test_needs_a_tool():
    pytest.skip("{reason}")

def test_passes():
    pass
'''


SERVING = '''
import pytest

@pytest.mark.e2e
def test_would_start_a_server():
    pass
'''


def _run(tmp_path, reason: str, no_skip: str, source: str = SKIPPING, **env: str) -> subprocess.CompletedProcess:
    (tmp_path / "test_skipping.py").write_text(source.format(reason=reason))
    env = {**os.environ, "ATTNSERVE_TEST_NO_SKIP": no_skip, **env}
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "tests.conftest", "-p", "no:cacheprovider",
                           str(tmp_path / "test_skipping.py")], cwd=REPO_ROOT, env=env, capture_output=True,
                          text=True, timeout=120)


def test_an_unexpected_skip_fails_the_run_in_ci(tmp_path):
    done = _run(tmp_path, "nginx is not installed", "true")
    assert done.returncode == 1, done.stdout
    assert "unexpected skips" in done.stdout and "nginx is not installed" in done.stdout


def test_a_cuda_skip_is_expected_and_outside_ci_any_skip_passes(tmp_path):
    assert _run(tmp_path, "no CUDAExecutionProvider here", "true").returncode == 0
    assert _run(tmp_path, "nginx is not installed", "").returncode == 0


def test_in_ci_servers_that_would_fall_back_to_the_python_plane_stop_the_run(tmp_path, monkeypatch):
    monkeypatch.delenv(DATA_PLANE_ENV, raising=False)
    (tmp_path / "site").mkdir()
    no_native = without_native_env(tmp_path / "site")  # as where the extension is not built
    done = _run(tmp_path, "", "true", SERVING, **no_native)
    assert done.returncode == pytest.ExitCode.USAGE_ERROR, done.stdout + done.stderr
    assert "would serve on the Python plane instead" in done.stderr and "make native" in done.stderr, done.stderr
    # Outside CI, or with the Python plane asked for, the same run passes.
    assert _run(tmp_path, "", "", SERVING, **no_native).returncode == 0
    assert _run(tmp_path, "", "true", SERVING, **no_native, **{DATA_PLANE_ENV: "python"}).returncode == 0
    # A run of no e2e test starts no server: it runs.
    assert _run(tmp_path, "no CUDAExecutionProvider here", "true", **no_native).returncode == 0
