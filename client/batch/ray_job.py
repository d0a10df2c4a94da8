"""Batch inference on Ray Data (the optional extra `attnserve[ray]`): Parquet in, Parquet parts out.

    summary = run_ray_job(RayJob(input_path=Path("in.parquet"), output_dir=Path("out"),
                                 model="self_attention", model_dir=Path("models/self_attention")),
                          address="127.0.0.1:6379")

Two ways, one pipeline: `ray.data.read_parquet(input)` -> `map_batches(<actor class>)` on an
actor pool, each actor writing its batches' answers as Parquet parts itself:
    in process   (model_dir given) ONNX Runtime in each actor: attnserve.runtime.AttentionPredictor,
                 the server's own loader and run
    client fleet (urls given)      each actor calls attnserve servers over gRPC: the async client,
                 round robin over the urls, retries of UNAVAILABLE, `concurrency` calls in flight
Input rows are items with an `id` column (client.batch.tables). Each finished batch is one part,
`<output_dir>/part-<uuid>.parquet` (columns id and the outputs), written atomically, so a killed
job leaves whole parts only; a rerun reads their ids and skips those items (nothing already
written is sent again). `read_output` gives every part's rows sorted by id.
More: docs/ray.md.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from attnserve.client.batch import tables
from attnserve.client.batch.spec import BatchError

from attnserve.contract import ITEM_ID, OUTPUT_NAMES
from attnserve.files import remove_temporaries

logger = logging.getLogger(__name__)

PART_PREFIX = "part-"
# Fractions of a CPU: with Ray's default of one per task and actor, an actor pool can hold every
# CPU while the read tasks feeding it wait for one, a deadlock (docs/ray.md).
ACTOR_CPUS = 0.5
READ_CPUS = 0.25
BLOCKS_PER_ACTOR = 4


@dataclass(frozen=True)
class RayJob:
    input_path: Path  # a .parquet file or a directory of them
    output_dir: Path  # the parts, one per finished batch
    model: str
    model_dir: Path | None = None  # in process: the exported model's folder
    urls: tuple[str, ...] = ()  # client fleet: attnserve servers, round robin
    outputs: tuple[str, ...] = ("output",)
    batch_size: int = 32  # items per batch: per part, and per request of the fleet
    actors: int = 2
    concurrency: int = 2  # fleet: requests in flight per actor
    model_version: str = ""
    timeout_s: float = 60.0
    retries: int = 4
    actor_cpus: float = ACTOR_CPUS
    intra_op_threads: int = 1  # in process: ONNX Runtime threads per actor (the actors share the cores)
    # Fleet: Triton's schedule policy on every request (1 the highest priority; the longest wait in
    # the server's queue, microseconds); 0: the model's defaults. In process there is no queue to order.
    priority: int = 0
    timeout_us: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "input_path", Path(self.input_path))
        object.__setattr__(self, "output_dir", Path(self.output_dir))
        if (self.model_dir is None) == (not self.urls):
            raise ValueError("give either model_dir (in process) or urls (a client fleet), not both or neither")
        for name in ("batch_size", "actors", "concurrency"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("priority", "timeout_us"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0 (0: the model's default), got {getattr(self, name)}")
            if getattr(self, name) and self.model_dir is not None:
                raise ValueError(f"{name} is a server's schedule policy: give urls (a client fleet); in process "
                                 "each actor runs its own batches on ONNX Runtime, with no queue to order or time out")
        if not self.actor_cpus > 0:
            raise ValueError(f"actor_cpus must be > 0, got {self.actor_cpus}")
        if not self.outputs or any(name not in OUTPUT_NAMES for name in self.outputs):
            raise ValueError(f"outputs must be names from {list(OUTPUT_NAMES)}, got {list(self.outputs)}")


@dataclass
class RaySummary:
    items: int = 0  # rows of the input
    computed: int = 0  # computed and written by this run
    resumed: int = 0  # found written by an earlier run and skipped
    seconds: float = 0.0
    parts: list[str] = field(default_factory=list)

    @property
    def items_per_s(self) -> float:
        return self.computed / self.seconds if self.seconds > 0 else 0.0

    def line(self) -> str:
        return (f"batch (ray): {self.items} items ({self.computed} computed, {self.resumed} resumed) in "
                f"{self.seconds:.2f} s, {self.items_per_s:.1f} items/s")


# -- the output's parts ---------------------------------------------------------------------------

def part_paths(output_dir: Path) -> list[Path]:
    """The finished parts (a killed writer's temporaries are hidden files, never listed)."""
    if not output_dir.is_dir():
        return []
    return sorted(p for p in output_dir.iterdir() if p.name.startswith(PART_PREFIX) and p.suffix == tables.SUFFIX)


def written_ids(output_dir: Path) -> np.ndarray:
    """The ids every finished part holds."""
    pa = tables.pyarrow()
    ids = [pa.parquet.read_table(p, columns=[ITEM_ID]).column(ITEM_ID).to_numpy() for p in part_paths(output_dir)]
    return np.concatenate(ids) if ids else np.zeros(0, np.int64)


def read_output(output_dir: Path) -> dict[str, np.ndarray]:
    """Every part's rows, sorted by id: the job's answers in input order (for ids that count up)."""
    parts = [tables.read_parquet(p) for p in part_paths(output_dir)]
    if not parts:
        raise BatchError(f"{output_dir} holds no parts")
    columns = {name: np.concatenate([part[name] for part in parts]) for name in parts[0]}
    order = np.argsort(columns[ITEM_ID], kind="stable")
    return {name: column[order] for name, column in columns.items()}


def _write_part(output_dir: Path, columns: dict[str, np.ndarray]) -> None:
    tables.write_parquet(output_dir / f"{PART_PREFIX}{uuid.uuid4().hex}{tables.SUFFIX}", columns)


def _decode(batch: Any, skip: frozenset) -> dict[str, np.ndarray] | None:
    """An Arrow batch's items not written already, as numpy columns (None: nothing left)."""
    if ITEM_ID not in batch.column_names:
        raise BatchError(f"the input has no {ITEM_ID!r} column; the Ray engine needs one to write and resume "
                         f"by (columns: {batch.column_names})")
    columns = {name: tables.column_to_numpy(batch.column(name)) for name in batch.column_names
               if name in (ITEM_ID, *tables.TENSOR_COLUMNS)}
    if skip:
        keep = np.array([i not in skip for i in columns[ITEM_ID].tolist()], dtype=bool)
        if not keep.all():
            columns = {name: column[keep] for name, column in columns.items()}
    return columns if len(columns[ITEM_ID]) else None


def _counts(computed: int) -> dict[str, np.ndarray]:
    """What each batch hands back to the driver: the items it computed (its answers are in its part)."""
    return {"computed": np.array([computed], dtype=np.int64)}


# -- the two ways: actor classes for map_batches --------------------------------------------------

class PredictorActor:
    """In process: AttentionPredictor (the server's loader and run) on each batch, then its part."""

    def __init__(self, model_dir: str, output_dir: str, outputs: tuple[str, ...], skip: frozenset,
                 intra_op_threads: int = 1) -> None:
        from attnserve.runtime import AttentionPredictor

        self._predictor = AttentionPredictor(model_dir, intra_op_threads=intra_op_threads, outputs=outputs)
        self._output_dir = Path(output_dir)
        self._skip = skip

    def __call__(self, batch: Any) -> dict[str, np.ndarray]:
        columns = _decode(batch, self._skip)
        if columns is None:
            return _counts(0)
        answers = self._predictor(columns)
        _write_part(self._output_dir, answers)
        return _counts(len(columns[ITEM_ID]))


class FleetActor:
    """A client fleet member: each batch's items sent to attnserve servers over gRPC (the async
    client: round robin over the urls, UNAVAILABLE retried), then its part."""

    def __init__(self, urls: tuple[str, ...], model: str, output_dir: str, outputs: tuple[str, ...], skip: frozenset,
                 request_items: int, concurrency: int, model_version: str, timeout_s: float, retries: int,
                 priority: int = 0, timeout_us: int = 0) -> None:
        from attnserve.client.options import ClientOptions, RetryPolicy

        self._options = ClientOptions.build(",".join(urls), timeout_s=timeout_s,
                                            retry=RetryPolicy(max_attempts=retries + 1))
        self._model, self._version, self._outputs = model, model_version, outputs
        self._output_dir = Path(output_dir)
        self._skip = skip
        self._request_items, self._concurrency = request_items, concurrency
        self._priority, self._timeout_us = priority, timeout_us
        # One event loop per actor, kept across batches: the client's channel belongs to it.
        self._loop = asyncio.new_event_loop()
        self._client = self._loop.run_until_complete(self._open())

    async def _open(self) -> Any:
        from attnserve.client.aio import AsyncInferenceClient

        return AsyncInferenceClient(self._options)

    def __call__(self, batch: Any) -> dict[str, np.ndarray]:
        columns = _decode(batch, self._skip)
        if columns is None:
            return _counts(0)
        answers = self._loop.run_until_complete(self._infer(columns))
        _write_part(self._output_dir, {ITEM_ID: columns[ITEM_ID], **answers})
        return _counts(len(columns[ITEM_ID]))

    async def _infer(self, columns: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        n = len(columns[ITEM_ID])
        slots = asyncio.Semaphore(self._concurrency)

        async def one(start: int) -> dict[str, np.ndarray]:
            stop = min(start + self._request_items, n)
            mask = columns.get("mask")
            async with slots:
                result = await self._client.infer_result(
                    self._model, columns["query"][start:stop], columns["key"][start:stop],
                    columns["value"][start:stop], None if mask is None else mask[start:stop],
                    self._outputs, model_version=self._version, priority=self._priority, timeout_us=self._timeout_us)
            return result.outputs

        pieces = await asyncio.gather(*(one(start) for start in range(0, n, self._request_items)))
        return {name: np.concatenate([piece[name] for piece in pieces]) for name in self._outputs}


# -- the job ---------------------------------------------------------------------------------------

def run_ray_job(job: RayJob, address: str | None = None) -> RaySummary:
    """Run (or resume) the job on the Ray cluster at `address` (None: RAY_ADDRESS, else a local
    one started for the job). Blocks until every item's part is written."""
    try:
        import ray
    except ImportError:
        raise BatchError("the Ray engine needs Ray Data: pip install 'attnserve[ray]'") from None
    started = time.monotonic()
    summary = RaySummary()
    job.output_dir.mkdir(parents=True, exist_ok=True)
    remove_temporaries(job.output_dir)  # a killed writer's half-written parts
    done = written_ids(job.output_dir)
    skip = frozenset(done.tolist())
    if not ray.is_initialized():
        ray.init(address=address or os.environ.get("RAY_ADDRESS"), logging_level=logging.WARNING,
                 log_to_driver=False)
    context = ray.data.DataContext.get_current()
    context.enable_progress_bars = False  # the summary line says how it went
    context.print_on_execution_start = False
    context.raise_original_map_exception = True  # an actor's own error, not Ray's "UDF failed"
    # Blocks for every actor: one file is otherwise one block, and one block feeds one actor.
    ds = ray.data.read_parquet(str(job.input_path), num_cpus=READ_CPUS,
                               override_num_blocks=BLOCKS_PER_ACTOR * job.actors)
    if job.model_dir is not None:
        actor, kwargs = PredictorActor, {"model_dir": str(job.model_dir), "output_dir": str(job.output_dir),
                                         "outputs": job.outputs, "skip": skip,
                                         "intra_op_threads": job.intra_op_threads}
    else:
        actor, kwargs = FleetActor, {"urls": job.urls, "model": job.model, "output_dir": str(job.output_dir),
                                     "outputs": job.outputs, "skip": skip, "request_items": job.batch_size,
                                     "concurrency": job.concurrency, "model_version": job.model_version,
                                     "timeout_s": job.timeout_s, "retries": job.retries,
                                     "priority": job.priority, "timeout_us": job.timeout_us}
    counts = ds.map_batches(actor, fn_constructor_kwargs=kwargs, batch_size=job.batch_size, batch_format="pyarrow",
                            compute=ray.data.ActorPoolStrategy(size=job.actors), num_cpus=job.actor_cpus)
    try:
        for row in counts.iter_rows():
            summary.computed += int(row["computed"])
    except Exception as err:  # Ray wraps what an actor raised (RayTaskError): one message, parts kept
        raise BatchError(f"the Ray job failed: {_cause(err)}; the parts written are kept in {job.output_dir}: "
                         "rerun the same command to resume") from None
    summary.resumed = len(skip)
    summary.items = summary.computed + summary.resumed
    summary.parts = [p.name for p in part_paths(job.output_dir)]
    summary.seconds = time.monotonic() - started
    return summary


def _cause(err: BaseException) -> str:
    """What an actor raised, without Ray's wrapping (its traceback stays in the worker's log): the
    first exception of our own or the standard library's down the chain, else the remote
    traceback's last line naming an error."""
    seen, chain = set(), []
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        chain.append(err)
        err = getattr(err, "cause", None) or err.__cause__ or err.__context__
    for e in chain:
        if not type(e).__module__.startswith("ray"):
            text = str(e).strip()  # Ray appends lines of its own (how to configure retries)
            return f"{type(e).__name__}: {text.splitlines()[0] if text else ''}"
    lines = [line.strip() for line in str(chain[0]).splitlines()
             if re.match(r"^[\w.]+(Error|Exception): ", line.strip())]
    return lines[-1] if lines else f"{type(chain[0]).__name__}: {str(chain[0]).strip()[:500]}"
