"""A batch job's progress off a terminal (a file, a pipe: CI, nohup, Kubernetes jobs), the rate
its summary reports, and a run that only resumes. The Progress tests run on a clock the test
moves, so they do not depend on this machine's speed."""

from __future__ import annotations

import io
import re

from attnserve.client.batch.progress import Progress
from attnserve.client.batch.spec import BatchSummary

from tests.test_batch_job import cli, make_input, summary_of

PROGRESS_LINE = re.compile(r"^batch progress: (\d+)/(\d+) items ([\d.]+) items/s eta (\S+) s? ?retries (\d+)$")


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_line_every_few_seconds_off_a_terminal():
    clock, out = _Clock(), io.StringIO()  # StringIO is not a TTY, as a pipe or a file
    progress = Progress(total=1000, done=200, stream=out, every_s=5.0, clock=clock)
    clock.now += 1
    progress.advance(100)
    assert out.getvalue() == ""  # 1 s: too soon
    clock.now += 4
    progress.advance(100)  # 5 s: 200 computed by this run (the 200 resumed do not count)
    assert out.getvalue() == "batch progress: 400/1000 items 40.0 items/s eta 15 s retries 0\n"
    clock.now += 1
    progress.advance(100)
    assert out.getvalue().count("\n") == 1
    clock.now += 4
    progress.retries = 2
    progress.advance(100)  # 10 s, 400 computed
    assert out.getvalue().splitlines()[-1] == "batch progress: 600/1000 items 40.0 items/s eta 10 s retries 2"
    clock.now += 10
    progress.advance(400)
    progress.close()  # the last line: the rate of the whole run's computing, as the summary has it
    assert out.getvalue().splitlines()[-1] == "batch progress: 1000/1000 items 40.0 items/s eta 0 s retries 2"
    assert progress.rate() == 40.0 and progress.seconds == 20.0
    assert "\r" not in out.getvalue() and "\x1b" not in out.getvalue()


def test_a_run_that_only_resumes_reports_no_rate():
    clock, out = _Clock(), io.StringIO()
    progress = Progress(total=100, done=100, stream=out, clock=clock)
    clock.now += 3
    progress.close()
    assert out.getvalue() == "" and progress.rate() == 0.0
    summary = BatchSummary(items=100, resumed=100, seconds=0.5, compute_seconds=progress.seconds)
    assert "0.0 items/s" not in summary.line() and "nothing to compute" in summary.line()


def test_batch_to_a_pipe_logs_progress_and_its_summary_agrees(server, tmp_path):
    """`attnserve batch` with stderr a pipe: progress lines (every chunk with --progress-every-s
    0), the summary's rate equal to the last one's; rerun (all resumed): no 0.0 items/s."""
    make_input(tmp_path / "in.npz", "cross_attention", n=96, lq=8, lk=6, seed=5)
    args = ("--url", server.address, "--model", "cross_attention", "--input", str(tmp_path / "in.npz"),
            "--output", str(tmp_path / "out.npz"), "--batch-size", "16", "--progress-every-s", "0")
    result = cli(*args)
    assert result.returncode == 0, result.stderr
    lines = [PROGRESS_LINE.match(line) for line in result.stderr.splitlines() if line.startswith("batch progress")]
    assert len(lines) >= 6 and all(lines), result.stderr  # one per chunk of 16, and the last
    assert lines[-1].group(1, 2) == ("96", "96")
    rate = re.search(r"in [\d.]+ s, ([\d.]+) items/s over [\d.]+ s computing", result.stdout)
    assert rate, result.stdout
    assert rate.group(1) == lines[-1].group(3)
    assert summary_of(result.stdout)["computed"] == 96

    again = cli(*args)
    assert again.returncode == 0, again.stderr
    assert summary_of(again.stdout)["resumed"] == 96
    assert "nothing to compute" in again.stdout and "0.0 items/s" not in again.stdout
    assert "batch progress" not in again.stderr
