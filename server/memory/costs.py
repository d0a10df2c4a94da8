"""How much memory a request costs the process, and how much the process may use.

    run_working_set(kind, dims, rows, q_len, k_len)   # peak bytes of one ONNX Runtime run of graph `kind`
    request_cost(kind, dims, rows, q_len, k_len, ...) # what a request holds from queue to answer sent
    default_memory_limit()                            # the budget when --memory-limit-bytes is not given

`kind` is the graph the run takes (contract's ALL_OUTPUTS, OUTPUT_ONLY, FUSED, FUSED_KEY_PADDING:
server.graphs chooses it). Knows nothing of gRPC, batching or ONNX Runtime: arithmetic on
shapes, and /proc and cgroup files.

The estimate is measured (tests/test_memory.py) against the real peak RSS of one run, ONNX
Runtime's CPU arena off (server.engine), over a grid of shapes of both presets and both unfused
graphs. With S = B*H*Lq*Lk*4 (the attention matrix) the unfused graph holds about 3.5 S at its
peak (scores, the scaled and masked copies, the softmax), plus its projections, inputs and
outputs, and with attn_probs another 0.5 S; times SAFETY. The estimate must never be below the
peak (tests/test_memory.py checks it; docs/memory.md, "Memory", has the factors found). The fused
graphs are not fitted: they are given the unfused output-only figure (fused_working_set), an
upper bound.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from attnserve.contract import ALL_OUTPUTS, FUSED_KINDS, HEAD_MASK_ALL_OUTPUTS, HEAD_MASK_KINDS

FLOAT = 4  # bytes of a float32
# What the estimate is allowed to be, as a multiple of a measured peak (tests/test_memory.py):
# never below the peak, and not so far above it that the budget turns away what would fit.
MEASURED_FACTOR_RANGE = (1.0, 2.2)
SAFETY = 1.1  # over the fitted figure, which a fresh process's peak may pass by a little
# Runs of this much or more get their blocks on 2 MiB huge pages (server.memory.heap, "Roomy"), which
# round each block's last page up, so the peaks of such runs can pass the fitted figure by a few
# MiB (tests/test_memory.py's grid). They get HUGE_PAGE_SLACK_BYTES more.
HUGE_PAGE_SLACK_FROM_BYTES = 16 << 20
HUGE_PAGE_SLACK_BYTES = 8 << 20
# The fitted figures (tests/test_memory.py): copies of the (B, H, Lq, Lk) scores an unfused run
# holds at its peak, more with attn_probs as an output, and copies of its mask.
SCORES_HELD = 3.5
PROBS_HELD = 0.5
MASK_HELD = 2
# A request's inputs are held twice (the message and the arrays; the batch's copy), its answer
# twice (the split outputs and the encoded message).
INPUT_COPIES = 2
ANSWER_COPIES = 2


@dataclass(frozen=True)
class AttentionDims:
    query_dim: int
    kv_dim: int
    d_model: int  # projection width (= num_heads * head_dim)
    out_dim: int
    num_heads: int


def run_working_set(kind: str, dims: AttentionDims, rows: int, q_len: int, k_len: int) -> int:
    """Peak bytes one run of graph `kind` holds for feeds query (rows, q_len, query_dim),
    key/value (rows, k_len, kv_dim), mask (rows, q_len, k_len) (the head-mask graphs: (rows, H,
    q_len, k_len)): its inputs, projections, scores, probabilities and outputs (attn_probs
    included when the graph writes it)."""
    if kind in FUSED_KINDS:
        return fused_working_set(dims, rows, q_len, k_len)
    return _unfused_working_set(dims, rows, q_len, k_len, with_probs=kind in (ALL_OUTPUTS, HEAD_MASK_ALL_OUTPUTS),
                                mask_heads=dims.num_heads if kind in HEAD_MASK_KINDS else 1)


def _unfused_working_set(dims: AttentionDims, rows: int, q_len: int, k_len: int, with_probs: bool,
                         mask_heads: int = 1) -> int:
    scores = FLOAT * rows * dims.num_heads * q_len * k_len  # (B, H, Lq, Lk)
    # (B, Lq, Lk) bool, or (B, H, Lq, Lk) on the head-mask graphs, and its negation inside the graph
    mask = rows * mask_heads * q_len * k_len
    inputs = FLOAT * rows * (q_len * dims.query_dim + 2 * k_len * dims.kv_dim)
    projections = FLOAT * rows * (q_len + 2 * k_len) * dims.d_model  # Q, K, V
    outputs = FLOAT * rows * q_len * (dims.d_model + dims.out_dim)  # context and output
    working = SCORES_HELD * scores + MASK_HELD * mask + inputs + projections + outputs
    if with_probs:
        working += PROBS_HELD * scores  # attn_probs is an output: the softmax's buffer outlives the run
    return int(SAFETY * working) + (HUGE_PAGE_SLACK_BYTES if working >= HUGE_PAGE_SLACK_FROM_BYTES else 0)


def fused_working_set(dims: AttentionDims, rows: int, q_len: int, k_len: int) -> int:
    """The fused graphs (com.microsoft.MultiHeadAttention: flash attention, and the key padding
    kernel). Not measured yet: until they are, the unfused output-only figure, taken as an upper
    bound (flash attention holds no scores, the key padding kernel one (B, H, Lq, Lk) copy where
    the unfused graph holds about 3.5: server.graphs.scores_held). Replace with a measured
    function (of L, not L^2, for flash attention)."""
    return _unfused_working_set(dims, rows, q_len, k_len, with_probs=False)


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


def request_cost(kind: str, dims: AttentionDims, rows: int, q_len: int, k_len: int,
                 input_bytes: int, want_probs: bool) -> Cost:
    """input_bytes: the request's arrays as decoded (Work.nbytes). The answer is counted twice:
    the split outputs it keeps alive and the encoded message (raw bytes or typed contents)."""
    return Cost(inputs=INPUT_COPIES * input_bytes, run=run_working_set(kind, dims, rows, q_len, k_len),
                answer=ANSWER_COPIES * answer_bytes(dims, rows, q_len, k_len, want_probs))


def native_cost_terms() -> dict[str, float | int]:
    """The figures above as the native data plane takes them (server.native): it computes
    request_cost with them per call, never writing them out again (tests/test_native_limits.py
    checks its figures against request_cost's)."""
    return {"safety": SAFETY, "scores": SCORES_HELD, "probs": PROBS_HELD, "mask": MASK_HELD,
            "slack_from_bytes": HUGE_PAGE_SLACK_FROM_BYTES, "slack_bytes": HUGE_PAGE_SLACK_BYTES,
            "input_copies": INPUT_COPIES, "answer_copies": ANSWER_COPIES}


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


__all__ = ["AttentionDims", "Cost", "MEASURED_FACTOR_RANGE", "answer_bytes", "default_memory_limit",
           "fused_working_set", "native_cost_terms", "process_memory_bytes", "request_cost", "resident_bytes",
           "run_working_set"]
