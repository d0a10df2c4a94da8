"""Reading the model repository (its layout: attnserve.contract). Knows nothing of gRPC or torch.

`attnserve export` writes it (a version directory appears whole, by rename); the server reads it
here, checks config.json against the tensor contract, and chooses the version to serve.
Directories whose names are not integers (such as an export's temporary directory) are ignored.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from attnserve.server.scheduling import DYNAMIC_BATCHING, QueuePolicy

from attnserve.contract import (
    CONFIG_FILE,
    CROSSOVER,
    FUSED_KINDS,
    GRAPH_ALL_OUTPUTS,
    GRAPH_FILES,
    GRAPH_OUTPUT_ONLY,
    INPUT_NAMES,
    OUTPUT_NAMES,
    PLATFORM,
    ROW_GRAPH_FILES,
    ServingDefaults,
    TensorSpec,
    tensor_specs,
    versions,
)
from attnserve.contract import model_names as _model_names
from attnserve.files import FileRefused, check_regular, read_json


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
    # config.json's "crossover": fused graph kind -> sqrt(Lq * Lk) from which it runs (server.graphs)
    crossover: tuple[tuple[str, int], ...] = ()
    d_model: int | None = None  # projection width (num_heads * head_dim); server.memory's estimate
    # config.json's "dynamic_batching": priority levels and queue timeout (server.scheduling)
    queue_policy: QueuePolicy = QueuePolicy()

    @property
    def graph_all_outputs(self) -> Path:
        return self.version_dir / GRAPH_ALL_OUTPUTS

    @property
    def graph_output_only(self) -> Path:
        return self.version_dir / GRAPH_OUTPUT_ONLY

    def graph_path(self, kind: str) -> Path:
        """Where the version's graph of `kind` (contract.GRAPH_FILES or ROW_GRAPH_FILES) is; it may not exist."""
        return self.version_dir / (GRAPH_FILES | ROW_GRAPH_FILES)[kind]


class ModelLoadError(Exception):
    """A model in the repository that cannot be served; the message says why."""


@dataclass(frozen=True)
class VersionPolicy:
    """Which versions of a model are served: config.json's `version_policy`, as Triton's:
    {"latest": {"num_versions": N}} (the N highest; the default is latest 1), {"all": {}}, or
    {"specific": {"versions": [1, 3]}}. A pinned version (--model-versions) is specific [v]."""

    kind: str = "latest"  # latest | all | specific
    num_versions: int = 1  # latest
    versions: tuple[int, ...] = ()  # specific

    @classmethod
    def from_config(cls, value: Any) -> VersionPolicy:
        if value is None:
            return cls()
        if not isinstance(value, dict) or len(value) != 1:
            raise ValueError(f"version_policy must be one of {{\"latest\": {{\"num_versions\": N}}}}, "
                             f"{{\"all\": {{}}}} or {{\"specific\": {{\"versions\": [...]}}}}, got {value!r}")
        (kind, args), = value.items()
        if not isinstance(args, dict):
            raise ValueError(f"version_policy.{kind} must be an object, got {args!r}")
        if kind == "latest":
            n = args.get("num_versions", 1)
            if not isinstance(n, int) or isinstance(n, bool) or n < 1:
                raise ValueError(f"version_policy.latest.num_versions must be an integer >= 1, got {n!r}")
            return cls("latest", num_versions=n)
        if kind == "all":
            return cls("all")
        if kind == "specific":
            versions = args.get("versions")
            if (not isinstance(versions, list) or not versions
                    or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in versions)):
                raise ValueError(f"version_policy.specific.versions must be a non-empty list of integers >= 1, "
                                 f"got {versions!r}")
            return cls("specific", versions=tuple(sorted(set(versions))))
        raise ValueError(f"version_policy must be latest, all or specific, got {kind!r}")

    def select(self, available: tuple[int, ...], model: str) -> tuple[int, ...]:
        """The versions to serve, ascending, out of the complete ones on disk."""
        if not available:
            raise ModelLoadError(f"{model} has no version directory with {GRAPH_ALL_OUTPUTS}")
        if self.kind == "all":
            return available
        if self.kind == "latest":
            return available[-self.num_versions:]
        missing = [v for v in self.versions if v not in available]
        if missing:
            raise ModelLoadError(f"version(s) {missing} of {model} named by its version policy not found "
                                 f"(have {list(available)})")
        return self.versions


def model_names(root: Path) -> list[str]:
    """Sub-directories holding a config.json, sorted."""
    if not root.is_dir():
        raise ModelLoadError(f"model repository {root} is not a directory")
    return _model_names(root)


def read_model_spec(model_dir: Path, pinned_version: int | None = None) -> ModelSpec:
    """The spec of the highest version served (read_model_specs' last)."""
    return read_model_specs(model_dir, pinned_version)[-1]


def read_model_specs(model_dir: Path, pinned_version: int | None = None) -> tuple[ModelSpec, ...]:
    """Read config.json, check it, and choose the versions to serve, ascending: the pinned one,
    else those its version policy names (default: the highest).
    Anything a server could not run with (a width or head count < 1, max_batch_size 0, a
    negative queue delay, tensors that disagree with the dims, a policy naming a missing
    version) is a ModelLoadError naming the field: that model is not ready, the others serve."""
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
        crossover = _crossover(config)
        policy = VersionPolicy.from_config(config.get("version_policy"))
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise ModelLoadError(f"{where}: unreadable ({type(err).__name__}: {err})") from None
    try:
        queue_policy = QueuePolicy.from_config(config.get(DYNAMIC_BATCHING))
    except ValueError as err:
        raise ModelLoadError(f"{where}: {err}") from None
    if tuple(t.name for t in inputs) != INPUT_NAMES or tuple(t.name for t in outputs) != OUTPUT_NAMES:
        raise ModelLoadError(f"{where}: expected inputs {INPUT_NAMES} and outputs {OUTPUT_NAMES}")
    if (inputs, outputs) != tensor_specs(**dims):
        raise ModelLoadError(f"{where}: its inputs and outputs disagree with its attention dims {dims}")
    available = tuple(versions(model_dir))
    if pinned_version is not None:
        if pinned_version not in available:
            raise ModelLoadError(f"pinned version {pinned_version} of {model_dir.name} not found "
                                 f"(have {list(available)})")
        chosen: tuple[int, ...] = (pinned_version,)
    else:
        chosen = policy.select(available, str(model_dir))
    first = ModelSpec(
        name=model_dir.name,
        version=chosen[0],
        version_dir=model_dir / str(chosen[0]),
        platform=config.get("platform", PLATFORM),
        **dims,
        inputs=inputs,
        outputs=outputs,
        max_batch_size=serving.max_batch_size,
        max_queue_delay_ms=float(serving.max_queue_delay_ms),
        max_q_len=serving.max_q_len,
        max_kv_len=serving.max_kv_len,
        available_versions=available,
        crossover=crossover,
        d_model=attention["d_model"] if isinstance(attention.get("d_model"), int) and attention["d_model"] > 0
        else None,
        queue_policy=queue_policy,
    )
    return tuple(dataclasses.replace(first, version=v, version_dir=model_dir / str(v)) for v in chosen)


def check_version_files(version_dir: Path) -> None:
    """ModelLoadError unless every file in a version directory is a regular file (or a symlink to
    one): ONNX Runtime opens the graphs, and any external data they name, by path, and an open of
    a FIFO would wait for a writer forever (with the registry's lock held)."""
    try:
        entries = sorted(version_dir.iterdir())
    except OSError as err:
        raise ModelLoadError(f"{version_dir}: unreadable ({err.strerror or err})") from None
    for entry in entries:
        try:
            if not entry.is_dir():
                check_regular(entry)
        except FileRefused as err:
            raise ModelLoadError(f"{entry}: {err}; a version directory holds regular files only") from None
        except OSError:  # a dangling symlink: the engine takes it for a missing graph, as before
            continue


def same_model(a: ModelSpec, b: ModelSpec) -> bool:
    """Whether two specs describe the same model apart from the version (config.json unchanged
    in everything the server uses), so a version loaded for one serves for the other."""
    def key(spec: ModelSpec) -> ModelSpec:
        return dataclasses.replace(spec, version=0, version_dir=Path(), available_versions=())
    return key(a) == key(b)


def repository_signature(model_dir: Path) -> tuple:
    """What tells that a model's files changed on disk (a rescan's test): config.json's and each
    complete version's graphs' sizes and mtimes."""
    def stat(path: Path) -> tuple[int, int] | None:
        try:
            st = path.stat()
        except OSError:
            return None
        return st.st_size, st.st_mtime_ns

    return (stat(model_dir / CONFIG_FILE),
            tuple((v, *(stat(model_dir / str(v) / file) for file in (GRAPH_FILES | ROW_GRAPH_FILES).values()))
                  for v in versions(model_dir)))


def version_fingerprint(spec: ModelSpec) -> tuple[tuple[str, int, int], ...]:
    """What tells that a version's graphs changed on disk: each graph's size and mtime."""
    found = []
    for path in (spec.graph_path(kind) for kind in GRAPH_FILES | ROW_GRAPH_FILES):  # the fused ones may not exist
        try:
            st = path.stat()
        except OSError:
            continue
        found.append((path.name, st.st_size, st.st_mtime_ns))
    return tuple(found)


def _crossover(config: dict[str, Any]) -> tuple[tuple[str, int], ...]:
    """The fused graphs' crossover lengths (absent in repositories exported before them)."""
    section = config.get(CROSSOVER, {})
    if not isinstance(section, dict):
        raise ValueError(f"{CROSSOVER} must be an object, got {type(section).__name__}")
    found = []
    for kind in FUSED_KINDS:
        if kind in section:
            value = section[kind]
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{CROSSOVER}.{kind} must be an integer >= 0, got {value!r}")
            found.append((kind, value))
    return tuple(found)


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
