"""NVIDIA's tritonclient, unmodified, against our server: the wire protocol is the standard one."""

from __future__ import annotations

import json
import subprocess

import numpy as np
import pytest

from tests.oip import eager, random_inputs
from tests.server_process import REPO_ROOT

TRITONCLIENT_PYTHON = REPO_ROOT / ".venv-tritonclient" / "bin" / "python"
CASES = {  # case -> (model, b, lq, lk, masked)
    "a.self_attention": ("self_attention", 2, 10, 10, False),
    "b.self_attention": ("self_attention", 3, 7, 12, True),
    "c.cross_attention": ("cross_attention", 4, 256, 77, False),
    "d.cross_attention": ("cross_attention", 1, 256, 77, True),
}
WIDTHS = {"self_attention": 512, "cross_attention": 32}


def test_tritonclient_gets_eager_numbers(server, eager_modules, tmp_path):
    if not TRITONCLIENT_PYTHON.exists():
        pytest.fail(f"{TRITONCLIENT_PYTHON} is missing: `make install` creates it")
    rng = np.random.default_rng(42)
    arrays, expected = {}, {}
    for case, (model, b, lq, lk, masked) in CASES.items():
        x = random_inputs(rng, b, lq, lk, WIDTHS[model], WIDTHS[model], masked=masked, fully_masked_row=masked)
        arrays.update({f"{case}.{name}": a for name, a in x.items() if a is not None})
        expected[case] = eager(eager_modules[model], **x)
    np.savez(tmp_path / "in.npz", **arrays)
    subprocess.run([str(TRITONCLIENT_PYTHON), str(REPO_ROOT / "tests" / "compat" / "tritonclient_check.py"),
                    server.address, str(tmp_path / "in.npz"), str(tmp_path / "out.npz")],
                   check=True, timeout=120)
    got = np.load(tmp_path / "out.npz")
    for case, want in expected.items():
        for name in ("output", "attn_probs"):
            err = float(np.max(np.abs(got[f"{case}.{name}"] - want[name])))
            assert err <= 1e-5, f"{case} {name}: max abs error {err}"
    report = json.loads(str(got["report"]))
    assert report["live"] and report["ready"]
    assert report["server"]["name"] == "attnserve"
    for model, info in report["models"].items():
        assert info["ready"]
        assert [i["name"] for i in info["metadata"]["inputs"]] == ["query", "key", "value", "mask"]
        assert info["config"]["config"]["name"] == model
        assert int(info["config"]["config"].get("max_batch_size", 0)) == 0  # JSON omits a zero
        stats = info["statistics"]["model_stats"][0]
        assert int(stats["inference_count"]) >= sum(b for m, b, *_ in CASES.values() if m == model)
