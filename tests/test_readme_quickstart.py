"""The README's quickstart runs as written: every ```python and ```bash block against a real server.

Each block runs in a fresh process (as a user would paste it), with the README's addresses
(localhost:8001 / 127.0.0.1:8001 for gRPC, localhost:8000 for REST) replaced by the test
server's ports. A `print(...)  # (shape)` line must print what its comment says.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.server_process import REPO_ROOT, ServerProcess

pytestmark = pytest.mark.e2e

README = (REPO_ROOT / "README.md").read_text()
BLOCKS = re.findall(r"^```(python|bash)\n(.*?)^```", README, re.M | re.S)
EXPECTED_PRINT = re.compile(r"^\s*print\(.*\)\s+#\s+(\(.*)$", re.M)


@pytest.fixture(scope="module")
def quickstart_server(model_repository):
    proc = ServerProcess(model_repository)
    yield proc
    proc.stop()


def _pointed_at(code: str, server: ServerProcess) -> str:
    for host in ("localhost", "127.0.0.1"):
        code = code.replace(f"{host}:8001", server.address).replace(f"{host}:8000", server.http_address)
    return code.replace(".venv/bin/", f"{Path(sys.executable).parent}/")


def test_the_readme_has_the_blocks_this_test_runs():
    kinds = [kind for kind, _ in BLOCKS]
    assert kinds.count("python") >= 3 and kinds.count("bash") >= 2, kinds
    assert any("curl" in code for _, code in BLOCKS) and any("attnserve batch" in code for _, code in BLOCKS)


@pytest.mark.parametrize("index", range(len(BLOCKS)), ids=lambda i: f"{BLOCKS[i][0]}-{i}")
def test_readme_block_runs_against_a_real_server(index, quickstart_server, tmp_path):
    kind, code = BLOCKS[index]
    code = _pointed_at(code, quickstart_server)
    if "in.npz" in code:  # the batch job's input, as the README describes it
        rng = np.random.default_rng(0)
        np.savez(tmp_path / "in.npz", query=rng.standard_normal((6, 10, 512), dtype=np.float32),
                 key=rng.standard_normal((6, 12, 512), dtype=np.float32),
                 value=rng.standard_normal((6, 12, 512), dtype=np.float32))
    argv = [sys.executable, "-c", code] if kind == "python" else ["bash", "-euo", "pipefail", "-c", code]
    done = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"README block {index} failed:\n{code}\n--- stderr:\n{done.stderr}"
    for expected in EXPECTED_PRINT.findall(code):
        assert expected.strip() in done.stdout, (expected, done.stdout)
    if "curl" in code:
        assert '{"ready":true}' in done.stdout.replace(" ", "")
        assert '"outputs"' in done.stdout and '"cross_attention"' in done.stdout, done.stdout
    if "attnserve batch" in code:
        with np.load(tmp_path / "out.npz") as out:
            assert out["output"].shape == (6, 10, 512) and out["attn_probs"].shape == (6, 8, 10, 12)
