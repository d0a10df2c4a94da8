"""The tensor contract every model serves, and the model repository's layout on disk.

A leaf: the standard library only. export writes what this says, the server reads and checks it,
the client builds requests from it, the tests hold all three to it.

Shapes (the symbols are the graphs' dynamic axes):
    query   (batch, q_len, query_dim)  FP32
    key     (batch, k_len, kv_dim)     FP32
    value   (batch, k_len, kv_dim)     FP32
    mask    (batch, q_len, k_len)      BOOL, optional; True = attend, False = masked; also
            (q_len, k_len), (batch, 1, q_len, k_len), (batch, heads, q_len, k_len): MASK_SHAPES
    output      (batch, q_len, out_dim)         FP32
    attn_probs  (batch, heads, q_len, k_len)    FP32

Masking is the seeds' own: a masked score (the seeds' `mask == 0`) is filled with MASK_FILL
(-1e10, not -inf) before the softmax, so a row whose keys are all masked is a uniform
distribution over them instead of NaN. Without a mask every key is attended.

Layout: <repository>/<name>/config.json, and per version <repository>/<name>/<version>/ with the
graphs of GRAPH_FILES and export.json (docs/export.md lists them). A version is an integer
directory holding model.onnx; the fused and head-mask graphs are optional (older repositories
have none, fp16 exports no fused ones).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from attnserve.ranges import BATCH_SIZE, LENGTH, QUEUE_DELAY_MS, VERSION

# -- tensors -----------------------------------------------------------------------------------

BATCH, Q_LEN, K_LEN = "batch", "q_len", "k_len"  # the variable dims, by name
VARIABLE = -1  # how a variable dim is written in shapes (config.json, model metadata)

INPUT_NAMES = ("query", "key", "value", "mask")  # the order of the graphs' inputs
REQUIRED_INPUTS = ("query", "key", "value")
OPTIONAL_INPUTS = ("mask",)
OUTPUT_NAMES = ("output", "attn_probs")
ITEM_ID = "id"  # a batch table's item id column (client.batch.tables, attnserve.runtime)
DATATYPES = {"query": "FP32", "key": "FP32", "value": "FP32", "mask": "BOOL",
             "output": "FP32", "attn_probs": "FP32"}

# Symbolic shape of each tensor: a name is a variable dim, an int a fixed one.
# "heads" and the widths are filled in per model by tensor_contract().
SYMBOLIC_SHAPES: dict[str, tuple[str, ...]] = {
    "query": (BATCH, Q_LEN, "query_dim"),
    "key": (BATCH, K_LEN, "kv_dim"),
    "value": (BATCH, K_LEN, "kv_dim"),
    "mask": (BATCH, Q_LEN, K_LEN),
    "output": (BATCH, Q_LEN, "out_dim"),
    "attn_probs": (BATCH, "num_heads", Q_LEN, K_LEN),
}
_VARIABLE_DIMS = (BATCH, Q_LEN, K_LEN)

# The seeds fill masked scores with -1e10 before the softmax; False in the mask = masked.
MASK_FILL = -1e10
MASKED = False

# Graph-side only (never on the wire): the fused key-padding graph's mask, one entry per key,
# int32 (batch, k_len), 1 = attend, 0 = masked (ONNX Runtime's MultiHeadAttention
# key_padding_mask). A contract mask whose rows are all alike, mask[b, i, :] == mask[b, 0, :],
# is this mask for every query row.
KEY_PADDING_MASK = "key_padding_mask"
KEY_PADDING_SHAPE = (BATCH, K_LEN)

# The shapes a request's `mask` may take, as the seeds' `masked_fill(mask == 0, ...)` broadcasts
# them against the scores (batch, heads, q_len, k_len). The metadata's (and config.json's) mask
# shape is the first, canonical one; the server reads (q_len, k_len) as the same mask for every
# item, (batch, 1, q_len, k_len) as (batch, q_len, k_len), and a (batch, heads, q_len, k_len) mask
# whose heads are alike as its first head. One whose heads differ runs on the head-mask graphs.
MASK_SHAPES: tuple[tuple[str, ...], ...] = (
    (BATCH, Q_LEN, K_LEN), (Q_LEN, K_LEN), (BATCH, 1, Q_LEN, K_LEN), (BATCH, "num_heads", Q_LEN, K_LEN))
# Graph-side only: the head-mask graphs' mask, bool (batch, heads, q_len, k_len), True = attend.
HEAD_MASK = "head_mask"
HEAD_MASK_SHAPE = (BATCH, "num_heads", Q_LEN, K_LEN)


@dataclass(frozen=True)
class TensorSpec:
    name: str
    datatype: str  # Open Inference Protocol datatype: FP32, BOOL
    shape: tuple[int, ...]  # VARIABLE (-1) for batch, q_len, k_len
    optional: bool = False


def tensor_specs(query_dim: int, kv_dim: int, out_dim: int, num_heads: int
                 ) -> tuple[tuple[TensorSpec, ...], tuple[TensorSpec, ...]]:
    """(inputs, outputs) of a model with these widths, in contract order."""
    widths = {"query_dim": query_dim, "kv_dim": kv_dim, "out_dim": out_dim, "num_heads": num_heads}

    def spec(name: str) -> TensorSpec:
        shape = tuple(VARIABLE if d in _VARIABLE_DIMS else widths[d] for d in SYMBOLIC_SHAPES[name])
        return TensorSpec(name, DATATYPES[name], shape, name in OPTIONAL_INPUTS)

    return tuple(spec(n) for n in INPUT_NAMES), tuple(spec(n) for n in OUTPUT_NAMES)


def tensor_contract(query_dim: int, kv_dim: int, out_dim: int, num_heads: int) -> dict[str, list[dict[str, Any]]]:
    """The contract as config.json records it: {"inputs": [...], "outputs": [...]}."""
    inputs, outputs = tensor_specs(query_dim, kv_dim, out_dim, num_heads)

    def entry(t: TensorSpec) -> dict[str, Any]:
        d = {"name": t.name, "datatype": t.datatype, "shape": list(t.shape)}
        return d | {"optional": True} if t.optional else d

    return {"inputs": [entry(t) for t in inputs], "outputs": [entry(t) for t in outputs]}


def dynamic_axes(names: tuple[str, ...] = INPUT_NAMES) -> dict[str, dict[int, str]]:
    """{tensor: {axis: symbol}} for the variable dims of `names` (torch.onnx's dynamic_axes)."""
    return {n: {i: d for i, d in enumerate(SYMBOLIC_SHAPES[n]) if d in _VARIABLE_DIMS} for n in names}


# -- serving defaults (config.json's "batching" and "limits"; the server's flags override) ------


@dataclass(frozen=True)
class ServingDefaults:
    max_batch_size: int = 32  # sequences (rows) merged into one ONNX Runtime run
    max_queue_delay_ms: float = 1.0  # longest a request waits for company while the model is busy
    max_q_len: int = 8192  # longest query accepted
    max_kv_len: int = 8192  # longest key/value accepted

    def __post_init__(self) -> None:
        # The server's own ranges, so export never writes a config.json that a server refuses.
        BATCH_SIZE.check("max_batch_size", self.max_batch_size)
        QUEUE_DELAY_MS.check("max_queue_delay_ms", self.max_queue_delay_ms)
        LENGTH.check("max_q_len", self.max_q_len)
        LENGTH.check("max_kv_len", self.max_kv_len)

    def batching(self) -> dict[str, Any]:
        return {"max_batch_size": self.max_batch_size, "max_queue_delay_ms": self.max_queue_delay_ms}

    def limits(self) -> dict[str, Any]:
        return {"max_q_len": self.max_q_len, "max_kv_len": self.max_kv_len}

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# -- the repository on disk ----------------------------------------------------------------------

CONFIG_FILE = "config.json"
EXPORT_FILE = "export.json"
GRAPH_ALL_OUTPUTS = "model.onnx"
GRAPH_OUTPUT_ONLY = "model_output_only.onnx"
GRAPH_FUSED = "model_fused.onnx"
GRAPH_FUSED_KEY_PADDING = "model_fused_key_padding.onnx"
GRAPH_HEAD_MASK = "model_head_mask.onnx"
GRAPH_HEAD_MASK_OUTPUT_ONLY = "model_head_mask_output_only.onnx"
PLATFORM = "onnxruntime_onnx"

# The graphs of a version by kind, as config.json's "graphs" names them. all_outputs is the one
# every version has; the others are optional. Inputs of each kind, in graph order:
ALL_OUTPUTS, OUTPUT_ONLY, FUSED, FUSED_KEY_PADDING = "all_outputs", "output_only", "fused", "fused_key_padding"
HEAD_MASK_ALL_OUTPUTS, HEAD_MASK_OUTPUT_ONLY = "head_mask_all_outputs", "head_mask_output_only"
GRAPH_FILES = {ALL_OUTPUTS: GRAPH_ALL_OUTPUTS, OUTPUT_ONLY: GRAPH_OUTPUT_ONLY,
               FUSED: GRAPH_FUSED, FUSED_KEY_PADDING: GRAPH_FUSED_KEY_PADDING,
               HEAD_MASK_ALL_OUTPUTS: GRAPH_HEAD_MASK, HEAD_MASK_OUTPUT_ONLY: GRAPH_HEAD_MASK_OUTPUT_ONLY}
_HEAD_MASK_INPUTS = (*REQUIRED_INPUTS, HEAD_MASK)
GRAPH_INPUTS = {ALL_OUTPUTS: INPUT_NAMES, OUTPUT_ONLY: INPUT_NAMES,
                FUSED: REQUIRED_INPUTS, FUSED_KEY_PADDING: (*REQUIRED_INPUTS, KEY_PADDING_MASK),
                HEAD_MASK_ALL_OUTPUTS: _HEAD_MASK_INPUTS, HEAD_MASK_OUTPUT_ONLY: _HEAD_MASK_INPUTS}
GRAPH_OUTPUTS = {ALL_OUTPUTS: OUTPUT_NAMES, OUTPUT_ONLY: ("output",), FUSED: ("output",),
                 FUSED_KEY_PADDING: ("output",), HEAD_MASK_ALL_OUTPUTS: OUTPUT_NAMES,
                 HEAD_MASK_OUTPUT_ONLY: ("output",)}
FUSED_KINDS = (FUSED, FUSED_KEY_PADDING)
HEAD_MASK_KINDS = (HEAD_MASK_ALL_OUTPUTS, HEAD_MASK_OUTPUT_ONLY)
# The row-chunk graphs (export.chunked): a long fused run computed a chunk of query rows at a
# time over key/value projected once, so that a cancelled run stops between chunks. Optional, beside
# the fused graphs (a version without them runs unchunked); graph-side only, like the masks above.
ROWS_KV, FUSED_ROWS, FUSED_ROWS_KEY_PADDING = "rows_kv", "fused_rows", "fused_rows_key_padding"
KEY_PROJ, VALUE_PROJ = "key_proj", "value_proj"  # (batch, k_len, d_model): key/value projected, biases added
ROW_GRAPH_FILES = {ROWS_KV: "model_rows_kv.onnx", FUSED_ROWS: "model_fused_rows.onnx",
                   FUSED_ROWS_KEY_PADDING: "model_fused_rows_key_padding.onnx"}
ROW_GRAPH_INPUTS = {ROWS_KV: ("key", "value"), FUSED_ROWS: ("query", KEY_PROJ, VALUE_PROJ),
                    FUSED_ROWS_KEY_PADDING: ("query", KEY_PROJ, VALUE_PROJ, KEY_PADDING_MASK)}
ROW_GRAPH_OUTPUTS = {ROWS_KV: (KEY_PROJ, VALUE_PROJ), FUSED_ROWS: ("output",), FUSED_ROWS_KEY_PADDING: ("output",)}
# The fused graph whose runs each row-chunk graph computes in chunks.
ROWS_OF = {FUSED: FUSED_ROWS, FUSED_KEY_PADDING: FUSED_ROWS_KEY_PADDING}


def row_chunks(q_len: int, chunk_rows: int) -> list[tuple[int, int]]:
    """[start, end) of each chunk of at most `chunk_rows` query rows, as even as they split
    (the server's chunked runs and the export's parity of them split alike)."""
    if chunk_rows < 1:
        raise ValueError(f"chunk_rows must be >= 1, got {chunk_rows}")
    chunks = max(1, -(-q_len // chunk_rows))
    size = max(1, -(-q_len // chunks))
    return [(start, min(start + size, q_len)) for start in range(0, q_len, size)]


# config.json's "crossover": {"fused": L, "fused_key_padding": L, ...}. A fused graph runs when
# sqrt(Lq * Lk) >= its L (below it the unfused graph was measured faster); a kind without an L
# runs at every length.
CROSSOVER = "crossover"
# config.json's priorities and queue timeout, under Triton's names (server.scheduling reads it;
# an export keeps what the user wrote there).
DYNAMIC_BATCHING = "dynamic_batching"


# Versions are Triton's int64: 1 up to this, in ASCII digits.
MAX_VERSION = VERSION.high


def parse_version(text: str) -> int | None:
    """The version `text` names (a request's, where "01" is 1 as in Triton), or None: ASCII
    digits only (str.isdigit takes "²" and "١"), 1..MAX_VERSION."""
    if not (text.isascii() and text.isdigit()) or len(text.lstrip("0")) > 19:
        return None
    version = int(text)
    return version if 1 <= version <= MAX_VERSION else None


def versions(model_dir: Path) -> list[int]:
    """The model's complete versions, ascending: version directories holding the full graph,
    named as str(version) writes them (so "01" and "1" never both claim version 1)."""
    found = []
    model_dir = Path(model_dir)
    if model_dir.is_dir():
        for entry in model_dir.iterdir():
            version = parse_version(entry.name)
            if version is not None and str(version) == entry.name and entry.is_dir() \
                    and (entry / GRAPH_ALL_OUTPUTS).exists():
                found.append(version)
    return sorted(found)


def model_names(root: Path) -> list[str]:
    """The repository's models: sub-directories holding a config.json, sorted."""
    return sorted(p.name for p in Path(root).iterdir() if p.is_dir() and (p / CONFIG_FILE).exists())
