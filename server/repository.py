"""Reading the model repository (its layout: attnserve.contract). Knows nothing of gRPC or torch.

`attnserve export` writes it (a version directory appears whole, by rename); the server reads it
here, checks config.json against the tensor contract, and chooses the version to serve.
Directories whose names are not integers (such as an export's temporary directory) are ignored.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from attnserve.contract import (
    CONFIG_FILE,
    GRAPH_ALL_OUTPUTS,
    GRAPH_OUTPUT_ONLY,
    INPUT_NAMES,
    OUTPUT_NAMES,
    PLATFORM,
    ServingDefaults,
    TensorSpec,
    versions,
)
from attnserve.contract import model_names as _model_names
from attnserve.files import read_json


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


DEFAULTS = ServingDefaults()


class ModelLoadError(Exception):
    """A model in the repository that cannot be served; the message says why."""


def model_names(root: Path) -> list[str]:
    """Sub-directories holding a config.json, sorted."""
    if not root.is_dir():
        raise ModelLoadError(f"model repository {root} is not a directory")
    return _model_names(root)


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
        max_batch_size=int(batching.get("max_batch_size", DEFAULTS.max_batch_size)),
        max_queue_delay_ms=float(batching.get("max_queue_delay_ms", DEFAULTS.max_queue_delay_ms)),
        max_q_len=int(limits.get("max_q_len", DEFAULTS.max_q_len)),
        max_kv_len=int(limits.get("max_kv_len", DEFAULTS.max_kv_len)),
        available_versions=available,
    )
