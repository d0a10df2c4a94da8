"""`attnserve batch` refuses what would change numbers silently (values float32 cannot hold, masks
outside {0, 1}) and every path it cannot read or write, with one line, a non-zero exit, no output
and nothing sent; and says once how many values float32 rounded. Against a real server."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from tests.test_batch_job import cli, inference_count, parts_in, summary_of

WIDTH = 32  # cross_attention
MODEL = "cross_attention"


def items(n: int = 4, dtype=np.float32, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"query": rng.standard_normal((n, 3, WIDTH)).astype(dtype),
            "key": rng.standard_normal((n, 5, WIDTH)).astype(dtype),
            "value": rng.standard_normal((n, 5, WIDTH)).astype(dtype)}


def error_line(stderr: str) -> str:
    lines = [line for line in stderr.strip().splitlines() if not line.startswith("batch progress:")]
    assert len(lines) == 1, f"expected one line, got {stderr!r}"
    assert "Traceback" not in stderr
    return lines[0]


def batch(server, inp: Path, out: Path, *extra: str):
    return cli("--url", server.address, "--model", MODEL, "--input", str(inp), "--output", str(out),
               "--retries", "0", *extra)


def _overflow(a):
    a["query"] = a["query"].astype(np.float64)
    a["query"][2, 1, 4] = 1e39


def _nan(a):
    a["key"][1, 0, 0] = np.nan


def _inf(a):
    a["value"][3, 0, 0] = -np.inf


def _mask_7(a):
    a["mask"] = np.ones((4, 3, 5), np.int64)
    a["mask"][1, 2, 0] = 7


def _mask_minus_3(a):
    a["mask"] = np.ones((4, 3, 5), np.int8)
    a["mask"][3, 0, 4] = -3


@pytest.mark.parametrize(("spoil", "message"), [
    (_overflow, "query of item 2, at [2, 1, 4], is 1e+39, beyond float32's range"),
    (_nan, "key of item 1, at [1, 0, 0], is nan; expected finite numbers"),
    (_inf, "value of item 3, at [3, 0, 0], is -inf; expected finite numbers"),
    (_mask_7, "mask of item 1, at [1, 2, 0], is 7; expected bool (True = attend) or integer 0/1"),
    (_mask_minus_3, "mask of item 3, at [3, 0, 4], is -3; expected bool"),
], ids=["overflow", "nan", "inf", "mask-7", "mask-minus-3"])
def test_a_value_float32_or_the_mask_cannot_hold_is_refused_naming_the_item(server, tmp_path, spoil, message):
    arrays = items()
    spoil(arrays)
    inp, out = tmp_path / "in.npz", tmp_path / "out.npz"
    np.savez(inp, **arrays)
    before = inference_count(server.address, MODEL)
    result = batch(server, inp, out)
    assert result.returncode == 1, result.stderr
    line = error_line(result.stderr)
    assert line.startswith(f"error: {inp}: {message}") and line.endswith("; no request was sent for items 0..3")
    assert not out.exists() and not (tmp_path / "out.npz.parts").exists()  # a new job leaves no trace
    assert inference_count(server.address, MODEL) == before  # nothing was sent


def test_a_bad_item_after_finished_chunks_keeps_them_and_a_rerun_says_the_same(server, tmp_path):
    arrays = items(6)
    arrays["query"][4, 0, 0] = np.nan
    inp, out = tmp_path / "in.npz", tmp_path / "out.npz"
    parts = tmp_path / "out.npz.parts"
    np.savez(inp, **arrays)
    args = ("--batch-size", "2", "--concurrency", "1")
    first = batch(server, inp, out, *args)
    assert first.returncode == 1
    line = error_line(first.stderr)
    assert line.startswith(f"error: {inp}: query of item 4, at [4, 0, 0], is nan")
    assert "no request was sent for items 4..5" in line and f"finished parts are kept in {parts}" in line
    assert parts_in(parts) == [(0, 2), (2, 4)] and not out.exists()

    before = inference_count(server.address, MODEL)
    again = batch(server, inp, out, *args)  # resumes: computes nothing, refuses the same item
    assert again.returncode == 1 and error_line(again.stderr) == line
    assert summary_of(again.stdout)["resumed"] == 4 and parts_in(parts) == [(0, 2), (2, 4)]
    assert inference_count(server.address, MODEL) == before and not out.exists()


def test_values_float32_only_rounds_are_sent_with_one_warning_counting_them(server, tmp_path):
    arrays = items(dtype=np.float64)
    big = np.array([2**24 + 1, 2**24, 3, -(2**40) - 1], dtype=np.int64)  # two change in float32
    arrays["key"] = arrays["key"].astype(np.int64)
    arrays["key"][0, 0, :4] = big
    changed = int(np.count_nonzero(arrays["query"].astype(np.float32) != arrays["query"])
                  + np.count_nonzero(arrays["value"].astype(np.float32) != arrays["value"])) + 2
    inp, out = tmp_path / "in.npz", tmp_path / "out.npz"
    np.savez(inp, **arrays)
    result = batch(server, inp, out)
    assert result.returncode == 0, result.stderr
    warnings = [line for line in result.stderr.splitlines() if "WARNING" in line]
    assert len(warnings) == 1 and f"{changed} input values were rounded to float32" in warnings[0], result.stderr
    with np.load(out) as npz:
        assert npz["output"].shape == (4, 3, WIDTH) and np.isfinite(npz["output"]).all()


@pytest.mark.parametrize("case", ["proc", "proc-file", "sys", "directory", "fifo", "no-parent", "parts-is-a-file",
                                  "inside-the-input"])
def test_an_output_path_that_cannot_work_is_refused_before_anything_is_read_or_sent(server, tmp_path, case):
    inp = tmp_path / "in.npz"
    np.savez(inp, **items())
    out, message = {
        "proc": (Path("/proc/out.npz"), "error: cannot write output /proc/out.npz: "),
        "proc-file": (Path("/proc/self/out.npz"), "error: cannot write output /proc/self/out.npz: "),
        "sys": (Path("/sys/out.npz"), "error: cannot write output /sys/out.npz: "),
        "directory": (tmp_path / "d", f"error: cannot write output {tmp_path / 'd'}: not a regular file (a "
                                      "directory); name a file in it"),
        "fifo": (tmp_path / "f.npz", f"error: cannot write output {tmp_path / 'f.npz'}: not a regular file (a FIFO)"),
        "no-parent": (tmp_path / "nowhere" / "out.npz", f"error: cannot write output {tmp_path / 'nowhere' / 'out.npz'}"
                                                        f": its directory {tmp_path / 'nowhere'} does not exist"),
        "parts-is-a-file": (tmp_path / "out.npz", f"error: {tmp_path / 'out.npz.parts'} (the job's work directory"),
        "inside-the-input": (tmp_path / "in" / "out.npz", f"error: output {tmp_path / 'in' / 'out.npz'} is inside "
                                                          f"the input directory {tmp_path / 'in'}"),
    }[case]
    if case == "directory":
        out.mkdir()
    elif case == "fifo":
        os.mkfifo(out)  # reading its zip comment would block forever
    elif case == "parts-is-a-file":
        (tmp_path / "out.npz.parts").write_text("not a directory")
    elif case == "inside-the-input":
        (tmp_path / "in").mkdir()
        np.savez(tmp_path / "in" / "a.npz", **items())
        inp = tmp_path / "in"
    before = sorted(p.name for p in tmp_path.iterdir())
    sent = inference_count(server.address, MODEL)
    result = batch(server, inp, out)
    assert result.returncode == 1
    assert error_line(result.stderr).startswith(message), result.stderr
    assert result.stdout == ""
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # nothing written, no work directory
    assert not Path(f"{out}.parts").is_dir() and inference_count(server.address, MODEL) == sent


@pytest.mark.parametrize("case", ["fifo", "device", "fifo-in-directory", "broken-link-in-directory"])
def test_an_input_that_is_not_a_regular_file_says_so(server, tmp_path, case):
    directory = tmp_path / "in"
    directory.mkdir()
    np.savez(directory / "a.npz", **items())
    if case == "fifo":
        inp = bad = tmp_path / "in.npz"
        os.mkfifo(inp)
        reason = "not a regular file (a FIFO)"
    elif case == "device":
        inp = bad = Path("/dev/null")
        reason = "not a regular file (a character device)"
    elif case == "fifo-in-directory":  # was skipped: its items dropped silently
        inp, bad = directory, directory / "b.npz"
        os.mkfifo(bad)
        reason = "not a regular file (a FIFO)"
    else:
        inp, bad = directory, directory / "b.npz"
        bad.symlink_to(tmp_path / "gone.npz")
        reason = "it does not exist (a link to nothing)"
    out = tmp_path / "out.npz"
    result = batch(server, inp, out)
    assert result.returncode == 1
    assert error_line(result.stderr) == f"error: cannot read input {bad}: {reason}"
    assert not out.exists() and not (tmp_path / "out.npz.parts").exists()


def test_merge_checks_its_parts_and_output_before_reading_any(tmp_path):
    good = tmp_path / "a.npz"
    np.savez(good, output=np.zeros((2, 3, WIDTH), np.float32))
    fifo = tmp_path / "b.npz"
    os.mkfifo(fifo)  # reading it would block forever
    for parts, out, message in [
        ([good, fifo], tmp_path / "m.npz", f"error: cannot read merge part {fifo}: not a regular file (a FIFO)"),
        ([good], Path("/proc/m.npz"), "error: cannot write output /proc/m.npz: "),
    ]:
        result = cli("--merge", *map(str, parts), "--output", str(out))
        assert result.returncode == 1 and error_line(result.stderr).startswith(message), result.stderr
        assert not out.exists()
