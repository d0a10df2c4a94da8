"""`attnserve` health / models / infer against a real server (the batch command: test_batch_job.py)."""

from __future__ import annotations

import json
import os
import shutil
import socket
from pathlib import Path

import numpy as np
import pytest
import torch
from attnserve.client import InferenceClient
from attnserve.client.__main__ import main

from tests.server_process import ServerProcess

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _inputs(width: int, b: int = 2, lq: int = 5, lk: int = 7, seed: int = 0):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((b, lq, width), dtype=np.float32)
    k = rng.standard_normal((b, lk, width), dtype=np.float32)
    v = rng.standard_normal((b, lk, width), dtype=np.float32)
    mask = rng.random((b, lq, lk)) > 0.3
    return q, k, v, mask


def _eager(module, q, k, v, mask):
    with torch.no_grad():
        out, probs = module(*(torch.from_numpy(x) for x in (q, k, v)), mask=torch.from_numpy(mask))
    return out.numpy(), probs.numpy()


def test_health(server, capsys):
    assert main(["health", "--url", server.address, "--model", "cross_attention"]) == 0
    assert capsys.readouterr().out.splitlines() == [
        "live: true", "ready: true", "health: SERVING", "model cross_attention ready: true"]


def test_channels_and_compression_flags_reach_the_client(server, capsys):
    assert main(["health", "--url", server.address, "--channels", "3", "--compression", "gzip"]) == 0
    assert capsys.readouterr().out.splitlines()[:3] == ["live: true", "ready: true", "health: SERVING"]
    assert main(["health", "--url", server.address, "--channels", "0"]) == 2
    assert "channels must be in 1..256, got 0" in capsys.readouterr().err


def test_health_probes_each_server_of_a_list(server, capsys):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{s.getsockname()[1]}"
    assert main(["health", "--url", f"{server.address},{dead}", "--timeout", "2"]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert lines[:3] == [f"{server.address} live: true", f"{server.address} ready: true",
                         f"{server.address} health: SERVING"]
    assert lines[3].startswith(f"{dead} error: UNAVAILABLE")


def test_health_of_nothing_listening_fails(capsys):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert main(["--url", f"127.0.0.1:{port}", "--timeout", "2", "health"]) == 1
    assert "error: UNAVAILABLE" in capsys.readouterr().err


def test_models_lists_what_the_server_serves_and_url_comes_from_the_environment(server, capsys, monkeypatch):
    monkeypatch.setenv("ATTNSERVE_URL", server.address)
    assert main(["models", "--json"]) == 0
    models = json.loads(capsys.readouterr().out)
    assert [(m["name"], m["state"], m["version"]) for m in models] == [
        ("cross_attention", "READY", "1"), ("self_attention", "READY", "1")]
    assert models[0]["metadata"]["outputs"][1] == {"name": "attn_probs", "datatype": "FP32", "shape": [-1, 2, -1, -1]}
    assert main(["models", "--model", "cross_attention"]) == 0
    text = capsys.readouterr().out
    assert text.startswith("cross_attention  READY  versions 1  platform onnxruntime_onnx")
    assert "input  query      FP32  [-1, -1, 32]" in text
    assert "self_attention" not in text
    assert main(["models", "--model", "nope"]) == 1
    assert "error: NOT_FOUND" in capsys.readouterr().err


def test_models_of_a_repository_without_the_presets(model_repository, tmp_path, capsys):
    """A repository holding `my_attn` and a model that fails to load: both are listed, by the
    server's own index (no built-in names), the failed one with its reason."""
    shutil.copytree(model_repository / "cross_attention", tmp_path / "my_attn")
    (tmp_path / "broken" / "1").mkdir(parents=True)
    shutil.copy(model_repository / "cross_attention" / "config.json", tmp_path / "broken" / "config.json")
    (tmp_path / "broken" / "1" / "model.onnx").write_bytes(b"not an onnx graph")
    proc = ServerProcess(tmp_path)
    try:
        assert main(["models", "--url", proc.address]) == 0
        lines = capsys.readouterr().out.splitlines()
        assert lines[0].startswith("broken  UNAVAILABLE: ") and "model.onnx" in lines[0]
        assert lines[1] == "my_attn  READY  versions 1  platform onnxruntime_onnx"
        assert not any("self_attention" in line or "cross_attention" in line for line in lines)
        assert main(["models", "--url", proc.address, "--json", "--model", "my_attn"]) == 0
        (entry,) = json.loads(capsys.readouterr().out)
        assert entry["name"] == "my_attn" and entry["metadata"]["inputs"][0]["shape"] == [-1, -1, 32]
        with InferenceClient(proc.address) as client:
            assert [m.name for m in client.repository_index(ready_only=True)] == ["my_attn"]
    finally:
        proc.stop()


def test_infer_npz_to_npz_with_a_plot(server, eager_modules, tmp_path, capsys):
    q, k, v, mask = _inputs(512)
    np.savez(tmp_path / "in.npz", query=q, key=k, value=v, mask=mask)
    png = tmp_path / "heads.png"
    code = main(["--url", server.address, "infer", "--model", "self_attention", "--input", str(tmp_path / "in.npz"),
                 "--output", str(tmp_path / "out.npz"), "--plot", str(png), "--plot-item", "1"])
    assert code == 0, capsys.readouterr().err
    want_out, want_probs = _eager(eager_modules["self_attention"], q, k, v, mask)
    with np.load(tmp_path / "out.npz") as out:
        assert out.files == ["output", "attn_probs"]  # attn_probs asked for the plot
        np.testing.assert_allclose(out["output"], want_out, atol=1e-5, rtol=0)
        np.testing.assert_allclose(out["attn_probs"], want_probs, atol=1e-5, rtol=0)
    assert png.read_bytes()[:8] == PNG_MAGIC
    import matplotlib.image

    image = matplotlib.image.imread(png)
    assert image.ndim == 3 and image.shape[0] > 200 and image.shape[1] > 400  # 8 heads: 2 rows of 4 panels
    assert "wrote attention heatmaps of item 1" in capsys.readouterr().out


def test_plot_item_out_of_range_is_refused_before_inferring(server, tmp_path, capsys):
    """--plot-item 9 on a batch of 4: a bad argument (exit 2) before any request is sent (the
    server's inference count does not move) and no file is written."""
    q, k, v, mask = _inputs(32, b=4)
    np.savez(tmp_path / "in.npz", query=q, key=k, value=v, mask=mask)
    with InferenceClient(server.address) as client:
        before = client.model_statistics("cross_attention")[0].inference_count
    code = main(["infer", "--url", server.address, "--model", "cross_attention", "--input", str(tmp_path / "in.npz"),
                 "--output", str(tmp_path / "out.npz"), "--plot", str(tmp_path / "heads.png"), "--plot-item", "9"])
    assert code == 2
    assert "--plot-item 9 is out of range for a batch of 4" in capsys.readouterr().err
    with InferenceClient(server.address) as client:
        assert client.model_statistics("cross_attention")[0].inference_count == before
    assert not (tmp_path / "out.npz").exists() and not (tmp_path / "heads.png").exists()


def test_infer_separate_npy_files_prints_the_outputs(server, eager_modules, tmp_path, capsys):
    q, k, v, mask = _inputs(32, b=1, lq=2, lk=3)
    for name, array in dict(q=q, k=k, v=v, m=mask).items():
        np.save(tmp_path / f"{name}.npy", array)
    code = main(["infer", "--url", server.address, "--model", "cross_attention", "--query", str(tmp_path / "q.npy"),
                 "--key", str(tmp_path / "k.npy"), "--value", str(tmp_path / "v.npy"), "--mask",
                 str(tmp_path / "m.npy"),
                 "--outputs", "attn_probs"])
    assert code == 0
    text = capsys.readouterr().out
    assert text.startswith("attn_probs: float32 [1, 2, 2, 3]\n")
    _, probs = _eager(eager_modules["cross_attention"], q, k, v, mask)
    assert f"{probs[0, 0, 0, 0]:.5f}"[:6] in text


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--input", "x.npz", "--query", "q.npy"], "either --input IN.npz or --query"),
        (["--query", "q.npy"], "missing --key, --value"),
        (["--input", "missing.npz"], "cannot read --input"),
        (["--input", "x.npz", "--outputs", ","], "--outputs needs at least one name"),
    ],
)
def test_infer_usage_errors_exit_2(server, tmp_path, capsys, monkeypatch, extra, message):
    monkeypatch.chdir(tmp_path)
    q, k, v, _ = _inputs(32)
    np.savez("x.npz", query=q, key=k, value=v)
    np.save("q.npy", q)
    assert main(["infer", "--url", server.address, "--model", "cross_attention", *extra]) == 2
    assert message in capsys.readouterr().err


def test_infer_input_validation_is_a_usage_error(server, tmp_path, capsys):
    q, k, v, _ = _inputs(32)
    np.savez(tmp_path / "x.npz", query=q, key=k[:1], value=v[:1])
    assert main(["infer", "--url", server.address, "--model", "cross_attention", "--input",
                 str(tmp_path / "x.npz")]) == 2
    assert "batch sizes disagree" in capsys.readouterr().err


def test_server_refusal_exits_1_with_code_and_details(server, tmp_path, capsys):
    q, k, v, _ = _inputs(32)
    np.savez(tmp_path / "x.npz", query=q, key=k, value=v)
    assert main(["infer", "--url", server.address, "--model", "self_attention", "--input",
                 str(tmp_path / "x.npz")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: INVALID_ARGUMENT:") and "512" in err


@pytest.mark.parametrize(("spoil", "message"), [
    (lambda a: a["query"].__setitem__((1, 2, 3), 1e39), "query of item 1, at [1, 2, 3], is 1e+39, beyond float32's"),
    (lambda a: a["key"].__setitem__((0, 0, 0), np.nan), "key of item 0, at [0, 0, 0], is nan; expected finite"),
    (lambda a: a.__setitem__("mask", np.where(a["mask"], 7, 0)), "mask of item 0, at [0, 0, 0], is 7; expected bool"),
], ids=["overflow", "nan", "mask-7"])
def test_infer_refuses_values_float32_or_the_mask_cannot_hold_before_sending(server, tmp_path, capsys, spoil,
                                                                              message):
    q, k, v, mask = _inputs(32)
    arrays = {"query": q.astype(np.float64), "key": k, "value": v, "mask": mask}
    arrays["mask"][0, 0, 0] = True
    spoil(arrays)
    np.savez(tmp_path / "x.npz", **arrays)
    with InferenceClient(server.address) as c:
        before = c.model_statistics("cross_attention")[0].inference_count
    assert main(["infer", "--url", server.address, "--model", "cross_attention", "--input",
                 str(tmp_path / "x.npz"), "--output", str(tmp_path / "out.npz")]) == 2
    assert capsys.readouterr().err.startswith(f"error: {message}")
    assert not (tmp_path / "out.npz").exists()
    with InferenceClient(server.address) as c:
        assert c.model_statistics("cross_attention")[0].inference_count == before


def test_infer_says_once_how_many_values_float32_rounded(server, tmp_path, capsys, caplog):
    q, k, v, _ = _inputs(32)
    q64 = q.astype(np.float64) + 1e-12  # every value gains digits float32 drops
    np.savez(tmp_path / "x.npz", query=q64, key=k, value=v)
    assert main(["infer", "--url", server.address, "--model", "cross_attention", "--input",
                 str(tmp_path / "x.npz"), "--output", str(tmp_path / "out.npz")]) == 0
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and f"{q.size} input values were rounded to float32" in warnings[0]


@pytest.mark.parametrize("case", ["proc", "directory", "fifo-output", "plot-directory", "fifo-input", "fifo-token"])
def test_infer_paths_are_checked_before_anything_is_sent(server, tmp_path, capsys, case):
    q, k, v, _ = _inputs(32)
    np.savez(tmp_path / "x.npz", query=q, key=k, value=v)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)  # opening it to read would block forever
    (tmp_path / "d").mkdir()
    extra, message = {
        "proc": (["--output", "/proc/out.npz"], "cannot write --output /proc/out.npz: "),
        "directory": (["--output", str(tmp_path / "d")],
                      f"cannot write --output {tmp_path / 'd'}: not a regular file (a directory)"),
        "fifo-output": (["--output", str(fifo)], f"cannot write --output {fifo}: not a regular file (a FIFO)"),
        "plot-directory": (["--plot", str(tmp_path / "d")],
                           f"cannot write --plot {tmp_path / 'd'}: not a regular file (a directory)"),
        "fifo-input": (["--query", str(fifo), "--key", str(fifo), "--value", str(fifo)],
                       f"cannot read --query {fifo}: not a regular file (a FIFO)"),
        "fifo-token": (["--token-file", str(fifo)], f"cannot read --token-file {fifo}: not a regular file (a FIFO)"),
    }[case]
    inputs = [] if case == "fifo-input" else ["--input", str(tmp_path / "x.npz")]
    with InferenceClient(server.address) as c:
        before = c.model_statistics("cross_attention")[0].inference_count
    assert main(["infer", "--url", server.address, "--model", "cross_attention", *inputs, *extra]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {message}") and err.count("\n") == 1, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d", "fifo", "x.npz"]
    with InferenceClient(server.address) as c:
        assert c.model_statistics("cross_attention")[0].inference_count == before


def test_infer_output_is_written_at_the_path_given(server, tmp_path, capsys):
    q, k, v, _ = _inputs(32)
    np.savez(tmp_path / "x.npz", query=q, key=k, value=v)
    out = tmp_path / "out.data"  # np.savez would have written out.data.npz
    assert main(["infer", "--url", server.address, "--model", "cross_attention", "--input",
                 str(tmp_path / "x.npz"), "--output", str(out)]) == 0
    assert f"to {out}" in capsys.readouterr().out
    with np.load(out) as npz:
        assert npz["output"].shape == (2, 5, 32)
    assert not Path(f"{out}.npz").exists()
