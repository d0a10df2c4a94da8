"""The model repository on disk: its layout, and reading it. Knows nothing of gRPC or torch.

    <repository>/<name>/config.json               the model: dims, tensors, batching, limits
    <repository>/<name>/<version>/model.onnx      graph with outputs `output` and `attn_probs`
    <repository>/<name>/<version>/model_output_only.onnx   graph with `output` alone
    <repository>/<name>/<version>/export.json     that version's parity figures and weights' source

`python -m export` writes it (a version directory appears whole, by rename); the server reads it.
Directories whose names are not integers (such as an export's temporary directory) are ignored.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

CONFIG_FILE = "config.json"
EXPORT_FILE = "export.json"
GRAPH_ALL_OUTPUTS = "model.onnx"
GRAPH_OUTPUT_ONLY = "model_output_only.onnx"
PLATFORM = "onnxruntime_onnx"

# Tensor contract (float32 unless said): names are part of the public API.
INPUT_NAMES = ("query", "key", "value", "mask")
OUTPUT_NAMES = ("output", "attn_probs")


def versions(model_dir: Path) -> list[int]:
    """The model's complete versions, ascending: integer directories holding the full graph."""
    found = []
    if model_dir.is_dir():
        for entry in model_dir.iterdir():
            if entry.is_dir() and entry.name.isdigit() and (entry / GRAPH_ALL_OUTPUTS).exists():
                found.append(int(entry.name))
    return sorted(found)


def read_json(path: Path) -> dict[str, Any]:
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def write_json_atomic(path: Path, data: dict[str, Any]) -> None:
    """Write to a temporary file beside `path`, fsync, then rename over it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(data, f, indent=2, sort_keys=False)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)  # mkstemp makes it 0600; servers may run as another user
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def tensor_contract(query_dim: int, kv_dim: int, out_dim: int, num_heads: int) -> dict[str, list[dict[str, Any]]]:
    """The inputs and outputs every model serves; -1 marks a variable dim (batch, lq, lk)."""
    return {
        "inputs": [
            {"name": "query", "datatype": "FP32", "shape": [-1, -1, query_dim]},
            {"name": "key", "datatype": "FP32", "shape": [-1, -1, kv_dim]},
            {"name": "value", "datatype": "FP32", "shape": [-1, -1, kv_dim]},
            # Optional: without it every key is attended. False = masked.
            {"name": "mask", "datatype": "BOOL", "shape": [-1, -1, -1], "optional": True},
        ],
        "outputs": [
            {"name": "output", "datatype": "FP32", "shape": [-1, -1, out_dim]},
            {"name": "attn_probs", "datatype": "FP32", "shape": [-1, num_heads, -1, -1]},
        ],
    }


@dataclass(frozen=True)
class TensorSpec:
    name: str
    datatype: str  # Open Inference Protocol datatype: FP32, BOOL
    shape: tuple[int, ...]  # -1 = variable
    optional: bool = False


@dataclass(frozen=True)
class ModelSpec:
    """One model as config.json describes it, with the version the server will load."""

    name: str
    version: int
    version_dir: Path
    platform: str
    query_dim: int
    kv_dim: int
    out_dim: int
    num_heads: int
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    max_batch_size: int
    max_queue_delay_ms: float
    max_q_len: int
    max_kv_len: int
    available_versions: tuple[int, ...] = ()

    @property
    def graph_all_outputs(self) -> Path:
        return self.version_dir / GRAPH_ALL_OUTPUTS

    @property
    def graph_output_only(self) -> Path:
        return self.version_dir / GRAPH_OUTPUT_ONLY


class ModelLoadError(Exception):
    """A model in the repository that cannot be served; the message says why."""


def model_names(root: Path) -> list[str]:
    """Sub-directories holding a config.json, sorted."""
    if not root.is_dir():
        raise ModelLoadError(f"model repository {root} is not a directory")
    return sorted(p.name for p in root.iterdir() if p.is_dir() and (p / CONFIG_FILE).exists())


def read_model_spec(model_dir: Path, pinned_version: int | None = None) -> ModelSpec:
    """Read config.json and choose the version: the pinned one, else the highest."""
    try:
        config = read_json(model_dir / CONFIG_FILE)
        attention = config["attention"]
        batching = config.get("batching", {})
        limits = config.get("limits", {})
        inputs = tuple(TensorSpec(t["name"], t["datatype"], tuple(t["shape"]), bool(t.get("optional", False)))
                       for t in config["inputs"])
        outputs = tuple(TensorSpec(t["name"], t["datatype"], tuple(t["shape"])) for t in config["outputs"])
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise ModelLoadError(f"{model_dir / CONFIG_FILE}: unreadable ({type(err).__name__}: {err})") from None
    if tuple(t.name for t in inputs) != INPUT_NAMES or tuple(t.name for t in outputs) != OUTPUT_NAMES:
        raise ModelLoadError(f"{model_dir / CONFIG_FILE}: expected inputs {INPUT_NAMES} and outputs {OUTPUT_NAMES}")
    available = tuple(versions(model_dir))
    if pinned_version is not None:
        if pinned_version not in available:
            raise ModelLoadError(f"pinned version {pinned_version} of {model_dir.name} not found (have {list(available)})")
        version = pinned_version
    elif available:
        version = available[-1]
    else:
        raise ModelLoadError(f"{model_dir} has no version directory with {GRAPH_ALL_OUTPUTS}")
    return ModelSpec(
        name=model_dir.name,
        version=version,
        version_dir=model_dir / str(version),
        platform=config.get("platform", PLATFORM),
        query_dim=int(attention["query_dim"]),
        kv_dim=int(attention["kv_dim"]),
        out_dim=int(attention["out_dim"]),
        num_heads=int(attention["num_heads"]),
        inputs=inputs,
        outputs=outputs,
        max_batch_size=int(batching.get("max_batch_size", 32)),
        max_queue_delay_ms=float(batching.get("max_queue_delay_ms", 1.0)),
        max_q_len=int(limits.get("max_q_len", 4096)),
        max_kv_len=int(limits.get("max_kv_len", 4096)),
        available_versions=available,
    )
