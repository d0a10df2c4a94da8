"""`attnserve batch` with Parquet input and output, and split without an engine: `--shard i/n` in
n processes, joined by `--merge`. A real server; answers checked against eager PyTorch (the
seeds' math: tests/test_runtime.py proves the exported graphs equal the seed modules)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from attnserve.client.batch import BatchError, BatchJob, run_batch, tables
from attnserve.client.batch.assemble import merge_outputs
from attnserve.client.batch.shards import discover_shards, take_share
from attnserve.client.options import ClientOptions

from tests.test_batch_job import assert_matches_eager, cli, eager, inference_count, make_input, summary_of

TOLERANCE = 1e-5


def parquet_input(path: Path, arrays: dict[str, np.ndarray], ids: np.ndarray | None = None) -> None:
    columns = dict(arrays) if ids is None else {"id": ids, **arrays}
    tables.write_parquet(path, columns)


def test_parquet_in_parquet_out_keeps_ids_in_order(server, eager_modules, tmp_path):
    """A table with string ids and masks -> a table with the same ids, in input order, answers
    equal to eager; a rerun sees the job key in the output's metadata and sends nothing."""
    arrays = make_input(tmp_path / "unused.npz", "cross_attention", 90, 5, 7, seed=41)
    ids = np.array([f"item-{i:03d}" for i in range(90)])
    parquet_input(tmp_path / "in.parquet", arrays, ids)
    out = tmp_path / "out.parquet"
    job = BatchJob(model="cross_attention", input_path=tmp_path / "in.parquet", output_path=out,
                   outputs=("output", "attn_probs"), batch_size=16)
    summary = run_batch(job, ClientOptions(url=server.address))
    assert (summary.items, summary.computed, summary.errors) == (90, 90, 0)
    got = tables.read_parquet(out)
    assert list(got) == ["id", "output", "attn_probs"] and got["id"].tolist() == ids.tolist()
    want = eager(eager_modules["cross_attention"], arrays)
    for name in ("output", "attn_probs"):
        assert float(np.max(np.abs(got[name] - want[name]))) <= TOLERANCE, name

    before = inference_count(server.address, "cross_attention")
    again = run_batch(job, ClientOptions(url=server.address))
    assert (again.computed, again.resumed, again.requests) == (0, 90, 0)
    assert inference_count(server.address, "cross_attention") == before


def test_a_table_without_ids_is_numbered_and_tensors_as_lists_are_read(server, eager_modules, tmp_path):
    """Tensor columns written as plain nested lists (not Arrow's tensor type) read the same; the
    output's ids are the items' numbers."""
    pa = tables.pyarrow()
    arrays = make_input(tmp_path / "unused.npz", "cross_attention", 20, 3, 4, seed=42, masked=False)
    table = pa.table({name: pa.array(array.tolist()) for name, array in arrays.items()})
    pa.parquet.write_table(table, tmp_path / "in.parquet")
    out = tmp_path / "out.parquet"
    run_batch(BatchJob(model="cross_attention", input_path=tmp_path / "in.parquet", output_path=out),
              ClientOptions(url=server.address))
    got = tables.read_parquet(out)
    assert got["id"].tolist() == list(range(20))
    want = eager(eager_modules["cross_attention"], arrays)["output"]
    assert float(np.max(np.abs(got["output"] - want))) <= TOLERANCE


def test_a_table_missing_a_column_is_refused_naming_the_columns(server, tmp_path):
    arrays = make_input(tmp_path / "unused.npz", "cross_attention", 4, 3, 4, seed=43, masked=False)
    parquet_input(tmp_path / "in.parquet", {"query": arrays["query"], "key": arrays["key"]})
    with pytest.raises(BatchError) as exc:
        run_batch(BatchJob(model="cross_attention", input_path=tmp_path / "in.parquet",
                           output_path=tmp_path / "out.parquet"), ClientOptions(url=server.address))
    assert "missing columns ['value']" in str(exc.value)


def test_shares_cover_every_item_once_in_order(tmp_path):
    """take_share over shards of 7 and 5 items: 3 shares, contiguous, rows mapped into the files."""
    make_input(tmp_path / "a.npz", "cross_attention", 7, 2, 2, seed=1)
    make_input(tmp_path / "b.npz", "cross_attention", 5, 2, 2, seed=2)
    shards, _ = discover_shards(tmp_path)
    covered = []
    for index in range(3):
        share, first = take_share(shards, index, 3)
        assert first == len(covered)
        for shard in share:
            covered += [(shard.path.name, shard.first_row + i) for i in range(shard.count)]
    assert covered == [("a.npz", i) for i in range(7)] + [("b.npz", i) for i in range(5)]
    with pytest.raises(BatchError) as exc:
        take_share(shards, 0, 13)  # 12 items: share 0 of 13 is [0, 0)
    assert "leave this share empty" in str(exc.value)


@pytest.mark.parametrize("suffix", [".npz", ".parquet"])
def test_shard_over_three_processes_equals_the_unsharded_job(server, eager_modules, tmp_path, suffix):
    """Three `attnserve batch --shard i/3` processes at once over one input of two files, joined
    by `--merge`: the unsharded job's answers, in input order (ids too, for Parquet)."""
    inp = tmp_path / "in"
    inp.mkdir()
    first = make_input(tmp_path / "a.npz", "self_attention", 50, 6, 5, seed=44)
    second = make_input(tmp_path / "b.npz", "self_attention", 31, 6, 5, seed=45)
    for name, arrays in (("a", first), ("b", second)):
        if suffix == ".npz":
            np.savez(inp / f"{name}.npz", **arrays)
        else:
            parquet_input(inp / f"{name}.parquet", arrays)
    whole = tmp_path / f"whole{suffix}"
    done = cli("--url", server.address, "--model", "self_attention", "--input", str(inp), "--output", str(whole),
               "--batch-size", "8")
    assert done.returncode == 0, done.stderr
    before = inference_count(server.address, "self_attention")
    parts = [tmp_path / f"part{i}{suffix}" for i in range(3)]
    procs = [cli("--url", server.address, "--model", "self_attention", "--input", str(inp), "--output", str(part),
                 "--batch-size", "8", "--shard", f"{i}/3", wait=False) for i, part in enumerate(parts)]
    items = []
    for proc in procs:
        stdout, stderr = proc.communicate(timeout=120)
        assert proc.returncode == 0, stderr
        items.append(summary_of(stdout)["computed"])
    assert items == [27, 27, 27]  # 81 items cut into three contiguous shares
    assert inference_count(server.address, "self_attention") == before + 81  # each item sent once
    merged = tmp_path / f"merged{suffix}"
    done = cli("--merge", *map(str, parts), "--output", str(merged))
    assert done.returncode == 0, done.stderr
    assert "merged 3 outputs, 81 items" in done.stdout
    if suffix == ".npz":
        assert_matches_eager(merged, eager_modules["self_attention"], [first, second])
        with np.load(merged) as got, np.load(whole) as want:
            assert np.max(np.abs(got["output"] - want["output"])) <= TOLERANCE
    else:
        got, want = tables.read_parquet(merged), tables.read_parquet(whole)
        assert got["id"].tolist() == want["id"].tolist() == list(range(81))
        assert np.max(np.abs(got["output"] - want["output"])) <= TOLERANCE
        reference = np.concatenate([eager(eager_modules["self_attention"], a)["output"] for a in (first, second)])
        assert np.max(np.abs(got["output"] - reference)) <= TOLERANCE


def test_bad_shard_and_merge_arguments_exit_2_or_1_saying_why(server, tmp_path):
    make_input(tmp_path / "in.npz", "cross_attention", 4, 2, 2, seed=46)
    common = ("--url", server.address, "--model", "cross_attention", "--input", str(tmp_path / "in.npz"),
              "--output", str(tmp_path / "out.npz"))
    done = cli(*common, "--shard", "3/3")
    assert done.returncode == 2 and "shard must be i/n with 0 <= i < n, got 3/3" in done.stderr
    done = cli(*common, "--shard", "one/3")
    assert done.returncode == 2 and "--shard must be I/N" in done.stderr
    done = cli("--merge", str(tmp_path / "in.npz"), str(tmp_path / "x.parquet"), "--output", str(tmp_path / "m.npz"))
    assert done.returncode == 1 and "all be .npz or all .parquet" in done.stderr


def test_merge_refuses_parts_of_different_jobs(tmp_path):
    make_input(tmp_path / "a.npz", "cross_attention", 4, 2, 2, seed=47, masked=False)
    make_input(tmp_path / "b.npz", "cross_attention", 4, 3, 2, seed=48, masked=False)
    with pytest.raises(BatchError) as exc:
        merge_outputs([tmp_path / "a.npz", tmp_path / "b.npz"], tmp_path / "m.npz")
    assert "differ from" in str(exc.value)
