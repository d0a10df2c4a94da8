"""What a batch job is, what it reports and how it fails: the types the caller sees.

    job = BatchJob(model="self_attention", input_path=Path("in.npz"), output_path=Path("out.npz"))
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from attnserve.contract import OUTPUT_NAMES

DEFAULT_BATCH_SIZE = 32  # the server's default max_batch_size: one request fills one run
DEFAULT_CONCURRENCY = 4
SHARED_MEMORY_MODES = ("auto", "off")


@dataclass(slots=True)
class BatchSummary:
    """How far a run got; counted as it goes and returned (or attached to the BatchError)."""

    items: int = 0  # in the input
    computed: int = 0  # sent to the server by this run
    resumed: int = 0  # found finished (parts or a complete output) and not recomputed
    seconds: float = 0.0  # the whole run: reading, computing, writing the output
    compute_seconds: float = 0.0  # computing alone: the progress's interval, which its rate is over
    requests: int = 0
    retries: int = 0
    errors: int = 0
    trace_id: str = ""  # the W3C trace its calls were sent in (client.tracecontext); "": none sent
    shared_memory: bool = False  # tensors went through system shared memory (--shared-memory auto)
    rounded: int = 0  # input values float32 rounds (float64's extra digits, integers past 2**24)

    @property
    def items_per_s(self) -> float:
        """Items computed per second of computing: the rate the progress showed."""
        return self.computed / self.compute_seconds if self.computed and self.compute_seconds > 0 else 0.0

    def line(self) -> str:
        rate = (f"{self.items_per_s:.1f} items/s over {self.compute_seconds:.2f} s computing" if self.computed
                else "nothing to compute")
        return (f"batch: {self.items} items ({self.computed} computed, {self.resumed} resumed) "
                f"in {self.seconds:.2f} s, {rate}, {self.requests} requests, "
                f"{self.retries} retries, {self.errors} errors"
                + (f", trace {self.trace_id}" if self.trace_id else "")
                + (", tensors through shared memory" if self.shared_memory else ""))


class BatchError(Exception):
    """The job cannot go on; the message says why and what to do. Finished parts stay."""

    summary: BatchSummary | None = None  # set by run_batch: how far the job got


class InputRefused(BatchError):
    """An input item the job will not send (a value float32 cannot hold, a mask outside {0, 1}):
    the message names the file, the array and the item."""


@dataclass(frozen=True)
class BatchJob:
    model: str
    input_path: Path
    output_path: Path
    outputs: tuple[str, ...] = ("output",)
    batch_size: int = DEFAULT_BATCH_SIZE  # items per request
    concurrency: int = DEFAULT_CONCURRENCY  # requests in flight
    model_version: str = ""  # empty: the server's default, pinned after the first response
    timeout_s: float | None = None  # per request, retries included; None: the client's default
    # (index, count): this process computes share `index` of `count` (`--shard index/count`,
    # shards.take_share) and writes it alone to output_path; None: every item.
    shard: tuple[int, int] | None = None
    # auto: tensors through system shared memory when the server is on this host and allows it
    # (docs/shared-memory.md); off: always in the messages.
    shared_memory: str = "off"
    # Triton's schedule policy, on every request: 1 the highest priority, and the longest wait in
    # the server's queue in microseconds; 0: the model's defaults (docs/scheduling.md).
    priority: int = 0
    timeout_us: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "input_path", Path(self.input_path))
        object.__setattr__(self, "output_path", Path(self.output_path))
        object.__setattr__(self, "outputs", tuple(self.outputs))
        if not self.model:
            raise ValueError("model must not be empty")
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {self.batch_size}")
        if self.shared_memory not in SHARED_MEMORY_MODES:
            raise ValueError(f"shared_memory must be one of {', '.join(SHARED_MEMORY_MODES)}, "
                             f"got {self.shared_memory!r}")
        if self.concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {self.concurrency}")
        for name in ("priority", "timeout_us"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0 (0: the model's default), got {getattr(self, name)}")
        if self.shard is not None:
            index, count = self.shard
            if not (count >= 1 and 0 <= index < count):
                raise ValueError(f"shard must be i/n with 0 <= i < n, got {index}/{count}")
        unknown = [name for name in self.outputs if name not in OUTPUT_NAMES]
        if not self.outputs or unknown or len(set(self.outputs)) != len(self.outputs):
            raise ValueError(f"outputs must be distinct names from {list(OUTPUT_NAMES)}, got {list(self.outputs)}")

    @property
    def parts_dir(self) -> Path:
        """The work directory beside the output: `<output>.parts/`."""
        return parts_dir_of(self.output_path)


def parts_dir_of(output_path: Path) -> Path:
    """The work directory of the job writing `output_path`: `<output>.parts/` beside it."""
    return output_path.with_name(output_path.name + ".parts")
