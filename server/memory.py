"""How much memory a request costs the process, and how much the process may use.

    kind = GraphKind.UNFUSED_OUTPUT_ONLY
    run_working_set(kind, dims, rows, q_len, k_len)   # peak bytes of one ONNX Runtime run
    request_cost(kind, dims, rows, q_len, k_len, ...) # what a request holds from queue to answer sent
    default_memory_limit()                            # the budget when --memory-limit-bytes is not given

Knows nothing of gRPC, batching or ONNX Runtime: arithmetic on shapes, and /proc and cgroup files.

The estimate is measured (tests/test_memory.py) against
the real peak RSS of one run, ONNX Runtime's CPU arena off (server.engine), over a grid of shapes
of both presets and both unfused graphs. With S = B*H*Lq*Lk*4 (the attention matrix) the unfused
graph holds about 3.5 S at its peak (scores, the scaled and masked copies, the softmax), plus its
projections, inputs and outputs, and with attn_probs another 0.5 S; times SAFETY. Measured, each
graph in a fresh process: the estimate is 1.14x to 1.47x the peak (it must never be below it).
"""

from __future__ import annotations

import enum
import gc
from dataclasses import dataclass
from pathlib import Path

FLOAT = 4  # bytes of a float32
# What the estimate is allowed to be, as a multiple of a measured peak (tests/test_memory.py).
MEASURED_FACTOR_RANGE = (1.0, 2.0)
# Over the fitted figure: measured in fresh processes the fit was 1.04x to 1.33x the peak.
SAFETY = 1.1


class GraphKind(enum.Enum):
    """Which graph a run uses; its working set depends on it."""

    UNFUSED_WITH_PROBS = "unfused_with_probs"  # model.onnx: MatMul/Softmax, writes attn_probs
    UNFUSED_OUTPUT_ONLY = "unfused_output_only"  # model_output_only.onnx
    # com.microsoft.MultiHeadAttention graphs (not exported on this branch): memory grows with
    # L, not L^2. See fused_working_set.
    FUSED = "fused"


@dataclass(frozen=True)
class AttentionDims:
    query_dim: int
    kv_dim: int
    d_model: int  # projection width (= num_heads * head_dim)
    out_dim: int
    num_heads: int


def run_working_set(kind: GraphKind, dims: AttentionDims, rows: int, q_len: int, k_len: int) -> int:
    """Peak bytes one run of `kind` holds for feeds query (rows, q_len, query_dim), key/value
    (rows, k_len, kv_dim), mask (rows, q_len, k_len): its inputs, projections, scores,
    probabilities and outputs (attn_probs included when the graph writes it)."""
    if kind is GraphKind.FUSED:
        return fused_working_set(dims, rows, q_len, k_len)
    scores = FLOAT * rows * dims.num_heads * q_len * k_len  # (B, H, Lq, Lk)
    mask = rows * q_len * k_len  # (B, Lq, Lk) bool, and its negation inside the graph
    inputs = FLOAT * rows * (q_len * dims.query_dim + 2 * k_len * dims.kv_dim)
    projections = FLOAT * rows * (q_len + 2 * k_len) * dims.d_model  # Q, K, V
    outputs = FLOAT * rows * q_len * (dims.d_model + dims.out_dim)  # context and output
    working = 3.5 * scores + 2 * mask + inputs + projections + outputs
    if kind is GraphKind.UNFUSED_WITH_PROBS:
        working += 0.5 * scores  # attn_probs is an output: the softmax's buffer outlives the run
    return int(SAFETY * working)


def fused_working_set(dims: AttentionDims, rows: int, q_len: int, k_len: int) -> int:
    """The hook for fused graphs (com.microsoft.MultiHeadAttention). Not measured yet: until it
    is, it answers the unfused output-only figure, an upper bound (the fused kernel never holds
    more than the unfused graph's scores). Replace with a measured function of L, not L^2."""
    return run_working_set(GraphKind.UNFUSED_OUTPUT_ONLY, dims, rows, q_len, k_len)


def answer_bytes(dims: AttentionDims, rows: int, q_len: int, k_len: int, want_probs: bool) -> int:
    """Tensor bytes of one answer: output (rows, q_len, out_dim), attn_probs (rows, H, q_len, k_len)."""
    output = FLOAT * rows * q_len * dims.out_dim
    probs = FLOAT * rows * dims.num_heads * q_len * k_len if want_probs else 0
    return output + probs


@dataclass(frozen=True)
class Cost:
    """What one request holds, in bytes, from admission until its answer is sent."""

    inputs: int  # its arrays in the queue, and their copy in a merged batch
    run: int  # its run alone (run_working_set)
    answer: int  # its answer encoded, until the transport has sent it

    @property
    def total(self) -> int:
        return self.inputs + self.run + self.answer


def request_cost(kind: GraphKind, dims: AttentionDims, rows: int, q_len: int, k_len: int,
                 input_bytes: int, want_probs: bool) -> Cost:
    """input_bytes: the request's arrays as decoded (Work.nbytes). The answer is counted twice:
    the split outputs it keeps alive and the encoded message (raw bytes or typed contents)."""
    return Cost(inputs=2 * input_bytes, run=run_working_set(kind, dims, rows, q_len, k_len),
                answer=2 * answer_bytes(dims, rows, q_len, k_len, want_probs))


# -- the limit ---------------------------------------------------------------------------------

# The share of the memory the process may use that the budget takes; the rest is headroom for
# what is not counted (messages gRPC is still receiving, the interpreter, allocator slack).
DEFAULT_SHARE = 0.6
_NO_LIMIT = 1 << 60  # cgroup v1 says "no limit" with a number near 2^63


def process_memory_bytes(cgroup_root: Path = Path("/sys/fs/cgroup"), meminfo: Path = Path("/proc/meminfo")) -> int:
    """The memory this process may use: its cgroup's limit (v2 memory.max, v1
    memory.limit_in_bytes) when there is one, else the machine's (MemTotal), whichever is less."""
    machine = _mem_total(meminfo)
    for limit_file in (cgroup_root / "memory.max", cgroup_root / "memory" / "memory.limit_in_bytes"):
        try:
            text = limit_file.read_text().strip()
        except OSError:
            continue
        if text.isdigit() and int(text) < _NO_LIMIT:
            return min(int(text), machine)
    return machine


def _mem_total(meminfo: Path) -> int:
    for line in meminfo.read_text().splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no MemTotal in {meminfo}")


def default_memory_limit(share: float = DEFAULT_SHARE, **paths: Path) -> int:
    """The budget above idle when --memory-limit-bytes is not given: `share` of what the process
    may use, less what it holds now (its idle RSS)."""
    return max(int(share * process_memory_bytes(**paths)) - resident_bytes(), 1 << 26)


def resident_bytes(pid: int | str = "self") -> int:
    """VmRSS of a process, from /proc."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


# Blocks from this size up get their own mapping, returned to the system when freed. glibc
# raises its threshold to the largest block freed (up to 32 MiB), so after one large run the
# buffers of later ones stay in its heaps for good; a fixed threshold keeps them out.
MMAP_THRESHOLD_BYTES = 1 << 20
# A run whose attention matrix is at least this large is followed by trim_heap().
TRIM_AFTER_SCORES_BYTES = 16 << 20
_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter numbers
_libc = None


def _glibc():
    global _libc
    if _libc is None:
        try:
            import ctypes

            _libc = ctypes.CDLL("libc.so.6")
            _libc.malloc_trim  # noqa: B018 - glibc, not musl
        except (OSError, AttributeError):
            _libc = False
    return _libc or None


def configure_allocator() -> None:
    """Once at startup: large blocks mapped on their own (see MMAP_THRESHOLD_BYTES); no-op off glibc."""
    libc = _glibc()
    if libc is not None:
        libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)


def trim_heap() -> None:
    """Give freed heap memory back to the system (glibc's malloc_trim, every arena); no-op off glibc."""
    libc = _glibc()
    if libc is not None:
        libc.malloc_trim(0)


def reclaim() -> None:
    """After a large use of the budget: collect reference cycles (a refused request's exception
    holds its frames, and they its request's tensors, until the cyclic collector runs), then
    trim_heap(). Measured: without the collection RSS stayed 120-190 MB above idle after 40 large
    refused calls."""
    gc.collect()
    trim_heap()


__all__ = ["AttentionDims", "Cost", "GraphKind", "MEASURED_FACTOR_RANGE", "answer_bytes", "default_memory_limit",
           "fused_working_set", "process_memory_bytes", "request_cost", "resident_bytes", "run_working_set",
           "trim_heap"]
