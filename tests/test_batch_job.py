"""The resumable batch job against real servers: order, parity with eager PyTorch, kill -9 and resume,
refusing to mix inputs, failing over between servers, and stopping cleanly when it cannot go on."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from attnserve.client import InferenceClient
from attnserve.client.batch import BatchError, BatchJob, run_batch
from attnserve.client.options import ClientOptions, RetryPolicy

from tests.gated_proxy import GatedProxy
from tests.server_process import REPO_ROOT, ServerProcess

TOLERANCE = 1e-5
WIDTH = {"self_attention": 512, "cross_attention": 32}
SUMMARY = re.compile(r"batch: (\d+) items \((\d+) computed, (\d+) resumed\) in [\d.]+ s, "
                     r"(?:[\d.]+ items/s over [\d.]+ s computing|nothing to compute), "
                     r"(\d+) requests, (\d+) retries, (\d+) errors")


def make_input(path: Path, model: str, n: int, lq: int, lk: int, seed: int, masked: bool = True,
               compressed: bool = False) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    arrays = {
        "query": rng.standard_normal((n, lq, WIDTH[model]), dtype=np.float32),
        "key": rng.standard_normal((n, lk, WIDTH[model]), dtype=np.float32),
        "value": rng.standard_normal((n, lk, WIDTH[model]), dtype=np.float32),
    }
    if masked:
        arrays["mask"] = rng.random((n, lq, lk)) > 0.3
    (np.savez_compressed if compressed else np.savez)(path, **arrays)
    return arrays


def eager(module, arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    mask = arrays.get("mask")
    with torch.no_grad():
        out, probs = module(torch.from_numpy(arrays["query"]), torch.from_numpy(arrays["key"]),
                            torch.from_numpy(arrays["value"]), mask=None if mask is None else torch.from_numpy(mask))
    return {"output": out.numpy(), "attn_probs": probs.numpy()}


def assert_matches_eager(out_path: Path, module, shards: list[dict[str, np.ndarray]], names=("output",)):
    with np.load(out_path) as out:
        assert out.files == list(names)
        got = {name: out[name] for name in names}
    want = [eager(module, shard) for shard in shards]
    for name in names:
        expected = np.concatenate([w[name] for w in want])
        assert got[name].shape == expected.shape, name
        err = float(np.max(np.abs(got[name] - expected)))
        assert err <= TOLERANCE, f"{name}: max abs error {err}"


def inference_count(address: str, model: str) -> int:
    with InferenceClient(address) as c:
        return c.model_statistics(model)[0].inference_count


def cli(*args: str, wait: bool = True, **kw):
    command = [sys.executable, "-m", "attnserve", "batch", *args]
    if not wait:
        return subprocess.Popen(command, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=120, **kw)


def summary_of(stdout: str) -> dict[str, int]:
    match = SUMMARY.search(stdout)
    assert match, f"no summary line in {stdout!r}"
    keys = ("items", "computed", "resumed", "requests", "retries", "errors")
    return dict(zip(keys, map(int, match.groups()), strict=True))


def parts_in(parts_dir: Path) -> list[tuple[int, int]]:
    if not parts_dir.exists():
        return []
    names = (p.name for p in parts_dir.iterdir())
    return sorted(tuple(map(int, m.groups())) for m in map(re.compile(r"^(\d+)-(\d+)\.npz$").match, names) if m)


def wait_for_parts(proc: subprocess.Popen, parts_dir: Path, count: int, timeout_s: float = 60) -> None:
    """Poll until `count` parts exist (a state, not a guess of how long they take)."""
    deadline = time.monotonic() + timeout_s
    while len(parts_in(parts_dir)) < count:
        assert proc.poll() is None, f"the job ended before {count} parts existed: {proc.communicate()}"
        assert time.monotonic() < deadline, f"{len(parts_in(parts_dir))} parts after {timeout_s}s, not {count}"
        time.sleep(0.005)


# ---------------------------------------------------------------------------


def test_shards_in_order_with_both_outputs(server, eager_modules, tmp_path):
    """A directory of shards (one compressed, one without mask) -> one output in global order."""
    shard_dir = tmp_path / "in"
    shard_dir.mkdir()
    shards = [
        make_input(shard_dir / "a.npz", "cross_attention", 700, 4, 6, seed=1),
        make_input(shard_dir / "b.npz", "cross_attention", 500, 4, 6, seed=2, masked=False),
        make_input(shard_dir / "c.npz", "cross_attention", 800, 4, 6, seed=3, compressed=True),
    ]
    out = tmp_path / "out.npz"
    job = BatchJob(model="cross_attention", input_path=shard_dir, output_path=out,
                   outputs=("output", "attn_probs"), batch_size=32, concurrency=4)
    summary = run_batch(job, ClientOptions(url=server.address))
    assert (summary.items, summary.computed, summary.resumed, summary.errors) == (2000, 2000, 0, 0)
    assert summary.requests == 22 + 16 + 25  # chunks never straddle shards
    assert_matches_eager(out, eager_modules["cross_attention"], shards, names=("output", "attn_probs"))
    assert not job.parts_dir.exists()

    # Run again: the output's key says it is complete; nothing is sent.
    before = inference_count(server.address, "cross_attention")
    again = run_batch(job, ClientOptions(url=server.address))
    assert (again.computed, again.resumed, again.requests) == (0, 2000, 0)
    assert inference_count(server.address, "cross_attention") == before


def test_killed_midway_then_resumed_without_recomputing(server, eager_modules, tmp_path):
    n = 3000
    inp = tmp_path / "in.npz"
    arrays = make_input(inp, "self_attention", n, 4, 4, seed=4)
    out = tmp_path / "out.npz"
    parts_dir = tmp_path / "out.npz.parts"
    job_args = ("--model", "self_attention", "--input", str(inp), "--output", str(out),
                "--batch-size", "8", "--concurrency", "2")
    args = ("--url", server.address, *job_args)

    # Through a proxy that answers 40 requests and holds the rest: the job cannot finish before
    # it is killed, and exactly 40 parts (one per request of 8 items) exist when it is.
    proxy = GatedProxy(server.address, infer_budget=40)
    try:
        proc = cli("--url", proxy.address, *job_args, wait=False)
        wait_for_parts(proc, parts_dir, 40)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
    finally:
        proxy.stop()  # the held requests fail there, never computed
    done = parts_in(parts_dir)
    done_items = sum(b - a for a, b in done)
    assert done_items == 40 * 8 and not out.exists()

    # Other inputs with the same output: refused, nothing touched.
    other = tmp_path / "other.npz"
    make_input(other, "self_attention", n, 4, 4, seed=5)
    refused = cli(*args[:4], "--input", str(other), *args[6:])
    assert refused.returncode == 1 and "holds a job for other inputs" in refused.stderr
    assert parts_in(parts_dir) == done

    before = inference_count(server.address, "self_attention")
    resumed = cli(*args)
    assert resumed.returncode == 0, resumed.stderr
    summary = summary_of(resumed.stdout)
    assert summary == {"items": n, "computed": n - done_items, "resumed": done_items,
                       "requests": summary["requests"], "retries": 0, "errors": 0}
    # The server computed exactly the items the first run had not finished.
    assert inference_count(server.address, "self_attention") - before == n - done_items
    assert_matches_eager(out, eager_modules["self_attention"], [arrays])
    assert not parts_dir.exists()


def test_failover_when_one_of_two_servers_dies(server, model_repository, eager_modules, tmp_path):
    doomed = ServerProcess(model_repository)
    try:
        inp = tmp_path / "in.npz"
        arrays = make_input(inp, "cross_attention", 3000, 3, 5, seed=6)
        out = tmp_path / "out.npz"
        before = inference_count(server.address, "cross_attention")
        proc = cli("--url", f"{doomed.address},{server.address}", "--model", "cross_attention",
                   "--input", str(inp), "--output", str(out), "--batch-size", "8", "--concurrency", "2",
                   wait=False)
        # Kill one server (no drain) once both have had work; round robin carries on with the other.
        deadline = time.monotonic() + 30
        while inference_count(doomed.address, "cross_attention") < 80:
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.005)
        doomed.signal(signal.SIGKILL)
        stdout, stderr = proc.communicate(timeout=60)
        assert proc.returncode == 0, stderr
        summary = summary_of(stdout)
        assert summary["computed"] == 3000 and summary["errors"] == 0
        assert inference_count(server.address, "cross_attention") > before
        assert_matches_eager(out, eager_modules["cross_attention"], [arrays])
    finally:
        doomed.stop()


def test_stops_with_a_clear_message_and_resumes_later(server, model_repository, tmp_path):
    lone = ServerProcess(model_repository)
    try:
        inp = tmp_path / "in.npz"
        make_input(inp, "cross_attention", 2000, 3, 5, seed=7)
        out = tmp_path / "out.npz"
        parts_dir = tmp_path / "out.npz.parts"
        args = ("--model", "cross_attention", "--input", str(inp), "--output", str(out),
                "--batch-size", "8", "--concurrency", "2", "--retries", "1", "--timeout", "60")
        # Through a proxy that answers 20 requests, then holds the next ones until the server is
        # dead: the job cannot finish first, and what it was waiting for then fails.
        proxy = GatedProxy(lone.address, infer_budget=20)
        try:
            proc = cli("--url", proxy.address, *args, wait=False)
            wait_for_parts(proc, parts_dir, 20)
            lone.signal(signal.SIGKILL)  # the only server dies: retries run out
            lone.wait(timeout=30)
            proxy.open()  # the held requests (and the retries) now meet the dead server
            stdout, stderr = proc.communicate(timeout=60)
        finally:
            proxy.stop()
        assert proc.returncode == 1
        assert "failed: UNAVAILABLE" in stderr and "rerun the same command to resume" in stderr
        failed = summary_of(stdout)
        assert failed["errors"] >= 1 and not out.exists()
        done_items = sum(b - a for a, b in parts_in(parts_dir))
        assert done_items == 20 * 8

        resumed = cli("--url", server.address, *args)  # the same job, another server
        assert resumed.returncode == 0, resumed.stderr
        assert summary_of(resumed.stdout)["resumed"] == done_items
        with np.load(out) as npz:
            assert npz["output"].shape == (2000, 3, 32)
    finally:
        lone.stop()


def test_refuses_before_sending_when_the_job_cannot_work(server, tmp_path):
    inp = tmp_path / "in.npz"
    make_input(inp, "cross_attention", 10, 3, 5, seed=8)
    out = tmp_path / "out.npz"
    options = ClientOptions(url=server.address, retry=RetryPolicy(max_attempts=1))
    cases = [
        (dict(model="no_such_model"), "NOT_FOUND"),
        (dict(model="cross_attention", model_version="9"), "version '9' is not loaded"),
        (dict(model="self_attention"), "input query has width 32 but model 'self_attention' takes 512"),
        (dict(model="cross_attention", batch_size=10**6), "over the 64 MiB limit; use --batch-size"),
    ]
    for settings, message in cases:
        with pytest.raises(BatchError) as exc:
            run_batch(BatchJob(input_path=inp, output_path=out, **settings), options)
        assert message in str(exc.value)
        assert exc.value.summary.computed == 0 and not out.exists()
    bad = tmp_path / "bad.npz"
    np.savez(bad, query=np.zeros((2, 3, 32)), key=np.zeros((2, 5, 32)))
    with pytest.raises(BatchError, match=r"missing arrays \['value'\]"):
        run_batch(BatchJob(model="cross_attention", input_path=bad, output_path=out), options)
