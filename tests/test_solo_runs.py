"""Solo runs through a real server (server.batcher, "Solo runs"; server.engine, "Solo sessions"):
a lone request runs on the spinning sessions and is counted; --spin-when-alone false turns them
off. Which batches may run solo, and that both sessions answer alike, is tested in process
(test_batcher, test_engine, test_gate)."""

from __future__ import annotations

import re
import urllib.request

import numpy as np
import pytest
from attnserve.client import InferenceClient

from tests.server_process import ServerProcess


def _solo_batches(metrics_port: int, model: str) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as r:
        text = r.read().decode()
    found = re.search(rf'^attnserve_solo_batches_total{{model="{model}"}} (\S+)$', text, re.M)
    return float(found.group(1)) if found else 0.0


@pytest.mark.parametrize("spin", ["true", "false"])
def test_a_lone_request_runs_solo_unless_switched_off(model_repository, spin):
    rng = np.random.default_rng(3)
    x = rng.standard_normal((1, 10, 512), dtype=np.float32)
    server = ServerProcess(model_repository, "--spin-when-alone", spin)
    try:
        with InferenceClient(server.address, timeout_s=30) as client:
            # The first call of a fresh server arrives after a quiet spell by construction.
            first = client.infer("self_attention", x, x, x)["output"]
            again = client.infer("self_attention", x, x, x)["output"]
        solo = _solo_batches(server.metrics_port, "self_attention")
    finally:
        server.stop()
    np.testing.assert_array_equal(first, again)  # solo or not, the same answer
    if spin == "true":
        assert solo >= 1  # the first at least (the second too, unless it came within QUIET_S)
    else:
        assert solo == 0
