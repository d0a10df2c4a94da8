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
    tensor_specs,
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
    d_model: int | None = None  # projection width (num_heads * head_dim); server.memory's estimate

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
    return _model_names(root)


def read_model_spec(model_dir: Path, pinned_version: int | None = None) -> ModelSpec:
    """Read config.json, check it, and choose the version: the pinned one, else the highest.
    Anything a server could not run with (a width or head count < 1, max_batch_size 0, a
    negative queue delay, tensors that disagree with the dims) is a ModelLoadError naming the
    field: that model is not ready, the others serve."""
    where = model_dir / CONFIG_FILE
    try:
        config = read_json(where)
        attention = config["attention"]
        dims = {name: _positive_int(attention, name) for name in ("query_dim", "kv_dim", "out_dim", "num_heads")}
        serving = ServingDefaults(**_section(config, "batching", ("max_batch_size", "max_queue_delay_ms")),
                                  **_section(config, "limits", ("max_q_len", "max_kv_len")))
        inputs = tuple(TensorSpec(t["name"], t["datatype"], tuple(t["shape"]), bool(t.get("optional", False)))
                       for t in config["inputs"])
        outputs = tuple(TensorSpec(t["name"], t["datatype"], tuple(t["shape"])) for t in config["outputs"])
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise ModelLoadError(f"{where}: unreadable ({type(err).__name__}: {err})") from None
    if tuple(t.name for t in inputs) != INPUT_NAMES or tuple(t.name for t in outputs) != OUTPUT_NAMES:
        raise ModelLoadError(f"{where}: expected inputs {INPUT_NAMES} and outputs {OUTPUT_NAMES}")
    if (inputs, outputs) != tensor_specs(**dims):
        raise ModelLoadError(f"{where}: its inputs and outputs disagree with its attention dims {dims}")
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
        **dims,
        inputs=inputs,
        outputs=outputs,
        max_batch_size=serving.max_batch_size,
        max_queue_delay_ms=float(serving.max_queue_delay_ms),
        max_q_len=serving.max_q_len,
        max_kv_len=serving.max_kv_len,
        available_versions=available,
        d_model=attention["d_model"] if isinstance(attention.get("d_model"), int) and attention["d_model"] > 0 else None,
    )


def _positive_int(section: dict[str, Any], name: str) -> int:
    value = section[name]
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"attention.{name} must be an integer >= 1, got {value!r}")
    return value


def _section(config: dict[str, Any], section: str, names: tuple[str, ...]) -> dict[str, Any]:
    """The fields of config[section] that are given (the contract's defaults fill the rest)."""
    values = config.get(section, {})
    if not isinstance(values, dict):
        raise ValueError(f"{section} must be an object, got {type(values).__name__}")
    return {name: values[name] for name in names if name in values}
