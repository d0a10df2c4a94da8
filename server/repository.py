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
from attnserve.ranges import BATCH_SIZE, CROSSOVER_LENGTH, LENGTH, QUEUE_DELAY_MS, VERSION, WIDTH, Range


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
            n = VERSION.check("version_policy.latest.num_versions", args.get("num_versions", 1))
            return cls("latest", num_versions=n)
        if kind == "all":
            return cls("all")
        if kind == "specific":
            versions = args.get("versions")
            if not isinstance(versions, list) or not versions:
                raise ValueError(f"version_policy.specific.versions must be a non-empty list of integers >= 1, "
                                 f"got {versions!r}")
            for v in versions:
                VERSION.check("version_policy.specific.versions[]", v)
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
    except (OSError, ValueError) as err:
        raise ModelLoadError(f"{where}: unreadable ({type(err).__name__}: {err})") from None
    # Every value against the range the whole server takes, native plane included (server.config's
    # ranges): one that passed here and not there failed later, at the plane's hand-over or a call.
    try:
        if not isinstance(config, dict):
            raise ValueError(f"must be a JSON object, got {type(config).__name__}")
        attention = _object(config, "attention", required=True)
        dims = {name: _number(attention, "attention", name, WIDTH, required=True)
                for name in ("query_dim", "kv_dim", "out_dim", "num_heads")}
        d_model = _number(attention, "attention", "d_model", WIDTH)
        if d_model is not None and d_model % dims["num_heads"]:
            raise ValueError(f"attention.d_model must be a multiple of attention.num_heads ({dims['num_heads']}: "
                             f"num_heads x head_dim), got {d_model}")
        platform = config.get("platform", PLATFORM)
        if platform != PLATFORM:  # the only runtime this server has: another would be served by the wrong one
            raise ValueError(f"platform must be {PLATFORM!r} (ONNX Runtime serves every model), got {platform!r}")
        serving = ServingDefaults(**_section(config, "batching", {"max_batch_size": BATCH_SIZE,
                                                                  "max_queue_delay_ms": QUEUE_DELAY_MS}),
                                  **_section(config, "limits", {"max_q_len": LENGTH, "max_kv_len": LENGTH}))
        inputs, outputs = _tensors(config, "inputs"), _tensors(config, "outputs")
        crossover = _crossover(config)
        policy = VersionPolicy.from_config(config.get("version_policy"))
        queue_policy = QueuePolicy.from_config(config.get(DYNAMIC_BATCHING))
    except ValueError as err:
        raise ModelLoadError(f"{where}: {err}") from None
    if tuple(t.name for t in inputs) != INPUT_NAMES or tuple(t.name for t in outputs) != OUTPUT_NAMES:
        raise ModelLoadError(f"{where}: expected inputs {INPUT_NAMES} and outputs {OUTPUT_NAMES}")
    if (inputs, outputs) != tensor_specs(**dims):
        raise ModelLoadError(f"{where}: its inputs and outputs disagree with its attention dims {dims}")
    inputs, outputs = tensor_specs(**dims)  # the contract's own (equal) values: ints, never 32.0 or true
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
        platform=platform,
        **dims,
        inputs=inputs,
        outputs=outputs,
        max_batch_size=serving.max_batch_size,
        max_queue_delay_ms=float(serving.max_queue_delay_ms),
        max_q_len=serving.max_q_len,
        max_kv_len=serving.max_kv_len,
        available_versions=available,
        crossover=crossover,
        d_model=d_model,
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
    section = _object(config, CROSSOVER)
    return tuple((kind, section[kind]) for kind in FUSED_KINDS
                 if _number(section, CROSSOVER, kind, CROSSOVER_LENGTH) is not None)


def _object(config: dict[str, Any], name: str, required: bool = False) -> dict[str, Any]:
    if name not in config and not required:
        return {}
    value = config.get(name)
    if not isinstance(value, dict):
        raise ValueError(f"{name} must be an object, got {'nothing' if value is None else type(value).__name__}")
    return value


def _number(section: dict[str, Any], where: str, name: str, allowed: Range, required: bool = False) -> Any:
    """section[name] checked against its range (None where absent and not required)."""
    if name not in section and not required:
        return None
    return allowed.check(f"{where}.{name}", section.get(name))


def _section(config: dict[str, Any], section: str, ranges: dict[str, Range]) -> dict[str, Any]:
    """The fields of config[section] that are given, each in its range (the contract's defaults fill the rest)."""
    values = _object(config, section)
    return {name: _number(values, section, name, allowed) for name, allowed in ranges.items() if name in values}


def _tensors(config: dict[str, Any], kind: str) -> tuple[TensorSpec, ...]:
    """config.json's inputs or outputs, each field of its own type (compared with the contract's next)."""
    tensors = config.get(kind)
    if not isinstance(tensors, list):
        raise ValueError(f"{kind} must be a list, got {type(tensors).__name__}")
    found = []
    for i, t in enumerate(tensors):
        at = f"{kind}[{i}]"
        if not isinstance(t, dict):
            raise ValueError(f"{at} must be an object, got {type(t).__name__}")
        name, datatype, shape, optional = t.get("name"), t.get("datatype"), t.get("shape"), t.get("optional", False)
        if not isinstance(name, str) or not isinstance(datatype, str):
            raise ValueError(f"{at}.name and .datatype must be strings, got {name!r} and {datatype!r}")
        if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) for d in shape):
            raise ValueError(f"{at}.shape must be a list of integers, got {shape!r}")
        if not isinstance(optional, bool):
            raise ValueError(f"{at}.optional must be true or false, got {optional!r}")
        found.append(TensorSpec(name, datatype, tuple(shape), optional) if kind == "inputs"
                     else TensorSpec(name, datatype, tuple(shape)))
    return tuple(found)
