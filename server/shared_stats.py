"""ModelStatistics for the whole server when several worker processes serve (server.workers).

    shared = StatisticsFile(directory)       # this worker's file, DIR/stats_<pid>.db
    shared.publish(model, stats, rows)       # after each change of that model's statistics
    totals = gather(directory)               # model -> ModelStatistics summed over every worker
    gather_by_pid(directory)                 # pid -> model -> ModelStatistics (balance figures)

Each worker keeps its statistics in memory (server.metrics) and copies what changed into its
own memory-mapped file (prometheus_client's MmapedDict, the file format of its multiprocess
mode: 8-byte doubles written in place, no system call per write). Whichever worker a
ModelStatistics call reaches reads every worker's file and answers the sum, at once and
without asking the others. A dead worker's file stays: its counts are part of the server's
(counts never go backwards when a worker is replaced). Counts and nanoseconds are doubles:
exact up to 2**53 (about 104 days of summed durations per field).
"""

from __future__ import annotations

from pathlib import Path

from attnserve.server.metrics import BatchDurations, Duration, ModelStatistics
from prometheus_client.mmap_dict import MmapedDict

_DURATIONS = ("success", "fail", "queue", "compute_input", "compute_infer", "compute_output")
_BATCH_DURATIONS = ("compute_input", "compute_infer", "compute_output")
_SEP = "\x1f"  # between the model's name and the field's in a key (never in a model name)


class StatisticsFile:
    def __init__(self, directory: Path, pid: int) -> None:
        self._file = MmapedDict(str(directory / f"stats_{pid}.db"))

    def publish(self, model: str, s: ModelStatistics, rows: int | None = None) -> None:
        """Copy model's counters (and those of batches of `rows` rows, if given) into the file."""
        write = self._file.write_value
        p = model + _SEP
        write(p + "last_inference_ms", s.last_inference_ms, 0.0)
        write(p + "inference_count", s.inference_count, 0.0)
        write(p + "execution_count", s.execution_count, 0.0)
        for name in _DURATIONS:
            d = getattr(s, name)
            write(f"{p}{name}.count", d.count, 0.0)
            write(f"{p}{name}.ns", d.ns, 0.0)
        if rows is not None and rows in s.batches:
            b = s.batches[rows]
            for name in _BATCH_DURATIONS:
                d = getattr(b, name)
                write(f"{p}batch.{rows}.{name}.count", d.count, 0.0)
                write(f"{p}batch.{rows}.{name}.ns", d.ns, 0.0)

    def close(self) -> None:
        self._file.close()


def gather(directory: Path) -> dict[str, ModelStatistics]:
    """Every worker's statistics in `directory`, summed per model (last_inference: the latest)."""
    totals: dict[str, ModelStatistics] = {}
    for path in sorted(directory.glob("stats_*.db")):
        _read(path, totals)
    return totals


def gather_by_pid(directory: Path) -> dict[int, dict[str, ModelStatistics]]:
    """Each worker's own statistics (pid -> model -> statistics): the benchmark's balance figures."""
    return {int(path.stem.split("_")[1]): _read(path, {}) for path in sorted(directory.glob("stats_*.db"))}


def _read(path: Path, into: dict[str, ModelStatistics]) -> dict[str, ModelStatistics]:
    for key, value, _ts, _pos in MmapedDict.read_all_values_from_file(str(path)):
        model, _, field = key.partition(_SEP)
        _add(into.setdefault(model, ModelStatistics()), field, int(value))
    return into


def _add(s: ModelStatistics, field: str, value: int) -> None:
    if field == "last_inference_ms":
        s.last_inference_ms = max(s.last_inference_ms, value)
    elif field in ("inference_count", "execution_count"):
        setattr(s, field, getattr(s, field) + value)
    elif field.startswith("batch."):
        _, rows, name, part = field.split(".")
        _add_duration(getattr(s.batches.setdefault(int(rows), BatchDurations()), name), part, value)
    else:
        name, part = field.split(".")
        _add_duration(getattr(s, name), part, value)


def _add_duration(d: Duration, part: str, value: int) -> None:
    if part == "count":
        d.count += value
    else:
        d.ns += value
