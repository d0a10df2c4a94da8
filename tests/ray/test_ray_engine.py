"""`attnserve batch --engine ray` on a real local Ray cluster (tests/ray/conftest.py), both ways:
in process (AttentionPredictor in each actor) and as a client fleet (actors calling real servers
over gRPC). Answers equal the seeds'; a job killed midway resumes and sends only what no part
holds, counted by the server's own statistics."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from attnserve.client.batch import BatchError, tables
from attnserve.client.batch.ray_job import RayJob, part_paths, read_output, run_ray_job, written_ids

from tests.gated_proxy import GatedProxy
from tests.server_process import REPO_ROOT, ServerProcess
from tests.test_batch_job import inference_count
from tests.test_runtime import assert_close, items, seed_answer, seeds  # noqa: F401  (seeds: a fixture)


def table(path: Path, x: dict, first_id: int = 0) -> None:
    """Items as a Parquet table with ids counting up from first_id (masks as (n, lq, lk))."""
    columns = {"id": np.arange(first_id, first_id + len(x["query"]), dtype=np.int64),
               **{k: v for k, v in x.items() if v is not None}}
    tables.write_parquet(path, columns)


def ray_cli(cluster, *args: str, wait: bool = True):
    command = [sys.executable, "-m", "attnserve", "batch", "--engine", "ray", "--address", cluster.address, *args]
    if not wait:
        return subprocess.Popen(command, cwd=REPO_ROOT, env=cluster.env, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
    return subprocess.run(command, cwd=REPO_ROOT, env=cluster.env, capture_output=True, text=True, timeout=300)


def test_in_process_equals_the_seed(ray_cluster, model_repository, seeds, eager_modules, tmp_path):  # noqa: F811
    """self_attention with masks (seed 000) through the API, attn_probs too."""
    x = items("self_attention", np.random.default_rng(51), 40, 6, 8, "b_q_k")
    table(tmp_path / "in.parquet", x, first_id=100)
    job = RayJob(tmp_path / "in.parquet", tmp_path / "out", "self_attention",
                 model_dir=model_repository / "self_attention", outputs=("output", "attn_probs"), batch_size=8)
    summary = run_ray_job(job)
    assert (summary.items, summary.computed, summary.resumed) == (40, 40, 0)
    assert len(part_paths(tmp_path / "out")) >= 5  # one part per batch of at most 8
    got = read_output(tmp_path / "out")
    assert got["id"].tolist() == list(range(100, 140))
    assert_close({"output": got["output"], "attn_probs": got["attn_probs"]},
                 seed_answer("self_attention", seeds, eager_modules, x))


def test_in_process_from_the_cli_equals_the_seed(ray_cluster, model_repository, seeds, eager_modules,  # noqa: F811
                                                  tmp_path):
    """cross_attention without a mask (seed 002 itself) through `attnserve batch --engine ray`."""
    x = items("cross_attention", np.random.default_rng(52), 30, 5, 9, None)
    table(tmp_path / "in.parquet", x)
    done = ray_cli(ray_cluster, "--model", "cross_attention", "--model-repository", str(model_repository),
                   "--input", str(tmp_path / "in.parquet"), "--output", str(tmp_path / "out"), "--batch-size", "8")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "batch (ray): 30 items (30 computed, 0 resumed)" in done.stdout
    got = read_output(tmp_path / "out")
    assert got["id"].tolist() == list(range(30))
    assert_close({"output": got["output"]}, seed_answer("cross_attention", seeds, eager_modules, x))


def test_client_fleet_round_robin_equals_the_seed(ray_cluster, model_repository, seeds, eager_modules,  # noqa: F811
                                                   tmp_path):
    """Actors calling two real servers: every answer the seed's, both servers used."""
    servers = [ServerProcess(model_repository) for _ in range(2)]
    try:
        x = items("self_attention", np.random.default_rng(53), 48, 4, 6, "q_k")
        x["mask"] = np.broadcast_to(x["mask"], (48, 4, 6)).copy()  # a table holds a mask per item
        table(tmp_path / "in.parquet", x)
        job = RayJob(tmp_path / "in.parquet", tmp_path / "out", "self_attention",
                     urls=tuple(s.address for s in servers), batch_size=4, concurrency=2)
        summary = run_ray_job(job)
        assert (summary.items, summary.computed) == (48, 48)
        counts = [inference_count(s.address, "self_attention") for s in servers]
        assert sum(counts) == 48 and min(counts) > 0, counts  # round robin: each server took some
        got = read_output(tmp_path / "out")
        assert got["id"].tolist() == list(range(48))
        assert_close({"output": got["output"]},
                     {"output": seed_answer("self_attention", seeds, eager_modules, x)["output"]})
    finally:
        for s in servers:
            s.stop()


def test_a_killed_fleet_job_resumes_sending_only_what_no_part_holds(ray_cluster, model_repository, seeds,  # noqa: F811
                                                                     eager_modules, tmp_path):
    """The first run's calls pass a gated proxy that forwards 8 requests (of at most 4 items) and
    holds the 9th: 8 parts exist, the driver is killed (SIGKILL), the held call is refused. The
    rerun, straight to the server, sends only the items no part holds: the server saw 48 in all."""
    server = ServerProcess(model_repository)
    proxy = GatedProxy(server.address, infer_budget=8)
    try:
        x = items("cross_attention", np.random.default_rng(54), 48, 3, 5, "b_q_k")
        table(tmp_path / "in.parquet", x)
        out = tmp_path / "out"
        args = ("--model", "cross_attention", "--input", str(tmp_path / "in.parquet"), "--output", str(out),
                "--batch-size", "4", "--actors", "1", "--concurrency", "1")
        doomed = ray_cli(ray_cluster, *args, "--url", proxy.address, "--retries", "0", wait=False)
        deadline = time.monotonic() + 240
        while not (len(part_paths(out)) == 8 and proxy.held >= 1):  # a state, not a guess of how long
            assert doomed.poll() is None, doomed.communicate()
            assert time.monotonic() < deadline, (len(part_paths(out)), proxy.held)
            time.sleep(0.01)
        doomed.send_signal(signal.SIGKILL)
        doomed.wait(timeout=30)
        proxy.close()  # the held call fails and never reaches the server
        written = len(written_ids(out))  # what the 8 answered requests held (Ray cuts the batches)
        assert 8 <= written <= 32 and inference_count(server.address, "cross_attention") == written
        assert len(part_paths(out)) == 8

        done = ray_cli(ray_cluster, *args, "--url", server.address)
        assert done.returncode == 0, done.stderr[-3000:]
        assert f"batch (ray): 48 items ({48 - written} computed, {written} resumed)" in done.stdout
        assert inference_count(server.address, "cross_attention") == 48  # nothing sent twice
        assert 48 - written < 48 / 2  # the rerun sent well under the whole input
        got = read_output(out)
        assert got["id"].tolist() == list(range(48))
        assert_close({"output": got["output"]},
                     {"output": seed_answer("cross_attention", seeds, eager_modules, x)["output"]})
    finally:
        proxy.stop()
        server.stop()


def test_an_input_without_ids_fails_saying_why(ray_cluster, model_repository, tmp_path):
    """The actor's error reaches the caller as one BatchError naming the missing column."""
    x = items("cross_attention", np.random.default_rng(55), 4, 3, 5, None)
    tables.write_parquet(tmp_path / "in.parquet", x)
    job = RayJob(tmp_path / "in.parquet", tmp_path / "out", "cross_attention",
                 model_dir=model_repository / "cross_attention", actors=1)
    with pytest.raises(BatchError) as exc:
        run_ray_job(job)
    assert "the input has no 'id' column" in str(exc.value) and "rerun the same command" in str(exc.value)
    assert part_paths(tmp_path / "out") == []
