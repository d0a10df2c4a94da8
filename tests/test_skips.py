"""CI fails on an unexpected skip (tests/conftest.py): only CUDA tests may skip without a GPU."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.server_process import REPO_ROOT

pytestmark = pytest.mark.e2e  # runs pytest in a subprocess

SKIPPING = '''
import pytest

def test_needs_a_tool():
    pytest.skip("{reason}")

def test_passes():
    pass
'''


def _run(tmp_path, reason: str, no_skip: str) -> subprocess.CompletedProcess:
    (tmp_path / "test_skipping.py").write_text(SKIPPING.format(reason=reason))
    env = {**os.environ, "ATTNSERVE_TEST_NO_SKIP": no_skip}
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
