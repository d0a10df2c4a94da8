"""The models a server process serves, and their changes: load, unload, rescan (Triton's model
repository API). Knows nothing of gRPC or HTTP: the servicer and the REST adapter call

    registry.get(name, version)   # the LoadedVersion to submit to (ModelNotFound / ModelUnavailable)
    await registry.load(name)     # (re)load from the repository; ModelControlDisabled, ModelLoadFailed
    await registry.unload(name)   # UNAVAILABLE from now; calls in flight finish
    registry.index()              # [IndexEntry(name, version, state, reason)]

and server.errors maps what they raise. Each version served has its own Batcher over its own
ONNX Runtime Engine (or what a RunBatchFactory makes: bench.floor's zeros).

A swap (a new version, a changed config.json) builds the new versions first, off the event
loop; if any of them fails, nothing changes and the index says why. Then the new set is
installed in one step: a call that looked its version up before submits to the old batcher
(there is no await between `get` and `batcher.submit`, so it cannot straddle the step), and the
old batchers are closed, which finishes everything queued and running on them; their sessions
go with the last reference, once their last call is done.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import numpy as np
from attnserve.server import priority
from attnserve.server.batcher import ArrivalSignal, Batcher, BatchPolicy, LoneCallSignal
from attnserve.server.codec import Limits
from attnserve.server.config import ServerConfig
from attnserve.server.engine import DeviceChoice
from attnserve.server.graphs import UNFUSED, GraphSet
from attnserve.server.memory import heap
from attnserve.server.memory.budget import MemoryBudget
from attnserve.server.memory.costs import AttentionDims, Cost, request_cost, run_working_set
from attnserve.server.metrics import Metrics
from attnserve.server.quoting import escaped, logged, quoted
from attnserve.server.repository import (
    ModelLoadError,
    ModelSpec,
    model_names,
    read_model_specs,
    repository_signature,
    same_model,
    version_fingerprint,
)
from attnserve.server.tensors import RunBatch, Work
from attnserve.server.tracing import Tracing
from attnserve.server.warmup import warm_request_path, warm_up, warm_up_plan

from attnserve.contract import (
    ALL_OUTPUTS,
    BATCH,
    CONFIG_FILE,
    FUSED_KINDS,
    HEAD_MASK,
    HEAD_MASK_KINDS,
    HEAD_MASK_SHAPE,
    K_LEN,
    KEY_PADDING_MASK,
    OUTPUT_ONLY,
    Q_LEN,
    SYMBOLIC_SHAPES,
    parse_version,
)
from attnserve.runtime import AttentionPredictor

logger = logging.getLogger(__name__)

# Triton's model states, as the index reports them, and WARMING: loaded, its graphs' first runs
# under way (server.warmup), not ready yet. Triton has no such state (its model_warmup runs inside
# LOADING); a state of its own tells a probe's reader why a model that loaded is not ready.
READY, UNAVAILABLE, WARMING = "READY", "UNAVAILABLE", "WARMING"


class ModelNotFound(LookupError):
    """No such model, or not that version."""


class ModelUnavailable(RuntimeError):
    """The model exists but is not served (failed to load, unloaded); the message says why."""


class ModelControlDisabled(RuntimeError):
    """Load or unload asked of a server whose model control mode is not explicit (Triton
    answers UNAVAILABLE too)."""


class ModelLoadFailed(RuntimeError):
    """A load that could not complete; what served before still serves. The message says why."""


# The blocking run of a model's batches, made from its spec. The default is an ONNX Runtime
# Engine on the chosen device; the one seam for running the server without a model. A factory
# whose `stoppable` attribute is true makes runs that take `stop=` (server.tensors.RunStop).
RunBatchFactory = Callable[[ModelSpec], RunBatch]
# Told after each change of a model: (name, whether it has a version ready).
StateListener = Callable[[str, bool], Awaitable[None]]
# Called on the warm-up's thread before each version's warm-up, (name, version): a test's hold.
WarmUpHold = Callable[[str, int], None]
# A version's warm-up (server.warmup), blocking: {(graph, session): runs}.
WarmUp = Callable[[], dict]


class GraphCosting:
    """server.memory's estimate for one version's graphs (batcher.Costing): each run on the graph
    server.graphs chooses for it, as the engine does."""

    def __init__(self, spec: ModelSpec, graphs: GraphSet) -> None:
        d_model = spec.d_model or max(spec.query_dim, spec.kv_dim, spec.out_dim)  # older config.json: a bound
        self.dims = AttentionDims(spec.query_dim, spec.kv_dim, d_model, spec.out_dim, spec.num_heads)
        self._graphs = graphs

    def cost(self, work: Work) -> Cost:
        kind = self._graphs.graph_for(work.masking, work.want_probs, work.q_len, work.k_len)
        return request_cost(kind, self.dims, work.rows, work.q_len, work.k_len, work.nbytes, work.want_probs)

    def batch_run(self, rows: int, q_len: int, k_len: int, masking: str, want_probs: bool) -> int:
        kind = self._graphs.graph_for(masking, want_probs, q_len, k_len)
        return run_working_set(kind, self.dims, rows, q_len, k_len)


@dataclass(eq=False)  # identity: a version being retired is tracked in a set
class LoadedVersion:
    spec: ModelSpec
    batcher: Batcher
    limits: Limits
    fingerprint: tuple = ()  # repository.version_fingerprint when it was loaded
    warm_up: WarmUp | None = None  # None: nothing to warm (a run_batch given, not ONNX Runtime)



class _Opened(NamedTuple):
    """One version's sessions opened (ModelRegistry._open), not yet installed."""

    run: RunBatch
    runs_on: str
    fingerprint: tuple
    graphs: GraphSet
    run_solo: RunBatch | None
    warm_up: WarmUp | None
    writes_into: bool  # its runs write outputs where they are told (server.tensors.compute_batch)


@dataclass(frozen=True)
class IndexEntry:
    name: str
    version: str  # "" for a model with no version to name
    state: str  # READY, WARMING or UNAVAILABLE
    reason: str = ""


@dataclass
class _Model:
    versions: dict[int, LoadedVersion] = field(default_factory=dict)  # served, ascending
    reason: str = ""  # why the last load failed (model-wide), or "unloaded"; "" after a good load
    failed_versions: dict[int, str] = field(default_factory=dict)  # of the last load
    unloaded_versions: tuple[int, ...] = ()
    seen: tuple = ()  # repository.repository_signature of the files this entry was made from
    warming: bool = False  # versions installed at start, not yet warmed: not ready

    @property
    def default(self) -> LoadedVersion | None:
        return self.versions[max(self.versions)] if self.versions else None


class ModelRegistry:
    def __init__(self, config: ServerConfig | None = None, device: DeviceChoice | None = None,
                 metrics: Metrics | None = None, arrivals: ArrivalSignal | None = None,
                 run_batch: RunBatchFactory | None = None, listener: StateListener | None = None,
                 budget: MemoryBudget | None = None, lone_call_signal: LoneCallSignal | None = None,
                 tracing: Tracing | None = None) -> None:
        """tracing: the process's tracer (server.tracing): each batcher's runs become spans.
        arrivals: requests received but not yet submitted (each batcher's hint of company).
        lone_call_signal: whether a call is the only one the server holds (a lone request's batch then
        runs on the engine's solo sessions: server.batcher, "Solo runs").
        run_batch: makes each model's run instead of an ONNX Runtime Engine (bench.floor).
        listener: told of each change (the server's health service).
        follow (attribute): called at once, before a change's ready lines are logged, by whatever
        serves calls off the event loop (the native data plane), so nothing that reads the log
        reaches a port still serving what was there before.
        budget: the process's memory budget, shared by every version's batcher."""
        self.config = config or ServerConfig()
        self._device = device
        self._metrics = metrics or Metrics()
        self._arrivals = arrivals
        self._lone_call_signal = lone_call_signal
        self._run_batch = run_batch
        self._budget = budget
        self._tracing = tracing
        self.listener = listener
        self.follow: Callable[[], None] | None = None
        self._models: dict[str, _Model] = {}
        self._lock = asyncio.Lock()  # one load or unload at a time
        self._retiring: set[LoadedVersion] = set()  # replaced or unloaded, finishing their calls
        self._retire_tasks: set[asyncio.Task] = set()
        self._poll_task: asyncio.Task | None = None
        self.reclaimed = 0  # versions retired and their memory given back (trimmed)
        self.warm_up_hold: WarmUpHold | None = None
        self._warming_loads: dict[str, tuple[int, ...]] = {}  # a load's new versions, warming before install
        self.started_at = time.monotonic()  # time-to-ready at start counts from here
        self._started = False
        self._closed = False

    @property
    def root(self) -> Path:
        return Path(self.config.model_repository)

    @classmethod
    def from_repository(cls, config: ServerConfig, device: DeviceChoice, metrics: Metrics,
                        arrivals: ArrivalSignal | None = None, run_batch: RunBatchFactory | None = None,
                        budget: MemoryBudget | None = None, lone_call_signal: LoneCallSignal | None = None,
                        tracing: Tracing | None = None) -> ModelRegistry:
        """Load every model of the repository, before serving (blocking); a model that fails is
        logged and kept with its reason."""
        registry = cls(config, device, metrics, arrivals, run_batch, budget=budget, lone_call_signal=lone_call_signal,
                       tracing=tracing)
        for name in model_names(registry.root):
            seen = repository_signature(registry.root / name)
            try:
                specs = registry._read(name)
            except ModelLoadError as err:
                registry._models[name] = _Model(reason=str(err), seen=seen)
                logger.error("model %s is not ready: %s", logged(name), escaped(err))
                continue
            built, failures = {}, {}
            for spec in specs:
                try:
                    built[spec.version] = registry._open(spec)
                except Exception as err:  # corrupt graphs raise onnxruntime's own exception types
                    failures[spec.version] = _reason(err)
            registry._models[name] = registry._install(name, specs, {}, built, failures)
            registry._models[name].seen = seen
            # Served once Server.start has bound its ports and warm_up_at_start has run.
            registry._models[name].warming = any(registry._warms(lv) for lv in registry._models[name].versions.values())
        for name in config.pinned_versions:
            if name not in registry._models:
                logger.warning("pinned model %s is not in the repository %s", logged(name), logged(registry.root))
        return registry

    # -- lookups -----------------------------------------------------------------------------

    def get(self, name: str, version: str = "") -> LoadedVersion:
        """The version to serve a call: `version`, or the highest served when it is "".
        Submit to its batcher before awaiting anything else (see the module's docstring)."""
        model = self._models.get(name)
        if model is None:
            raise ModelNotFound(f"unknown model {quoted(name)}{self.unknown_tail()}")
        if not model.versions:
            raise ModelUnavailable(f"model {name} is not ready: {self._why_not(model)}")
        if model.warming:
            raise ModelUnavailable(f"model {name} is not ready: warming up (its graphs' first runs, --warmup)")
        if not version:
            return model.default
        number = parse_version(version)
        loaded = None if number is None else model.versions.get(number)
        if loaded is None:
            raise ModelNotFound(f"model {name} version {quoted(version)}{self.not_loaded_tail(name)}")
        return loaded

    # The native data plane composes the same words around the client's text (server.native).
    def unknown_tail(self) -> str:
        """What follows "unknown model 'X'" in get()'s refusal."""
        return f"; serving {self.ready_names()}"

    def not_loaded_tail(self, name: str) -> str:
        """What follows "model NAME version 'V'" in get()'s refusal of a version `name` does not serve."""
        model = self._models[name]
        on_disk = list(model.default.spec.available_versions)
        return f" is not loaded (loaded: {sorted(model.versions)}, on disk: {on_disk})"

    def ready(self, name: str, version: str = "") -> bool:
        try:
            self.get(name, version)
        except ModelUnavailable:
            return False
        return True

    def versions(self, name: str) -> list[int]:
        """The versions of `name` served, ascending."""
        model = self._models.get(name)
        return sorted(model.versions) if model is not None else []

    def ready_names(self) -> list[str]:
        return sorted(name for name, model in self._models.items() if model.versions and not model.warming)

    def known_names(self) -> list[str]:
        return sorted(self._models)

    def known(self, name: str) -> bool:
        """A model the registry has met (served, failed or unloaded): a bounded set of names."""
        return name in self._models

    @property
    def loaded(self) -> dict[str, LoadedVersion]:
        """Each ready model's default (highest) version."""
        return {name: model.default for name, model in sorted(self._models.items()) if model.versions}

    @property
    def failed(self) -> dict[str, str]:
        """Each model with no version ready, and why."""
        return {name: self._why_not(model) for name, model in sorted(self._models.items()) if not model.versions}

    def index(self, ready_only: bool = False) -> list[IndexEntry]:
        """Every model, by name: one entry per version served (READY), one per version that failed
        its last load or was unloaded (UNAVAILABLE, with the reason), and, for a model with
        nothing to name a version for, one entry without a version. Models in the repository
        not loaded (explicit control) are listed as UNAVAILABLE too."""
        entries = []
        names = set(self._models)
        if not ready_only and self.config.model_control_mode != "none":
            try:
                names.update(model_names(self.root))
            except (ModelLoadError, OSError):
                pass
        for name in sorted(names):
            model = self._models.get(name)
            warming = [v for v in self._warming_loads.get(name, ()) if model is None or v not in model.versions]
            if not ready_only:
                entries += [IndexEntry(name, str(v), WARMING, "warming up: its graphs' first runs") for v in warming]
            if model is None:
                if not warming:
                    entries.append(IndexEntry(name, "", UNAVAILABLE, "not loaded"))
                continue
            if model.warming:
                if not ready_only:
                    entries += [IndexEntry(name, str(v), WARMING, "warming up: its graphs' first runs")
                                for v in sorted(model.versions)]
                continue
            for version in sorted(model.versions):
                entries.append(IndexEntry(name, str(version), READY))
            if ready_only:
                continue
            for version, reason in sorted(model.failed_versions.items()):
                if version not in model.versions:
                    entries.append(IndexEntry(name, str(version), UNAVAILABLE, reason))
            for version in model.unloaded_versions:
                entries.append(IndexEntry(name, str(version), UNAVAILABLE, model.reason))
            if model.reason and not model.unloaded_versions and not model.failed_versions:
                entries.append(IndexEntry(name, "", UNAVAILABLE, model.reason))
        return entries

    @staticmethod
    def _why_not(model: _Model) -> str:
        if model.reason:
            return model.reason
        return "; ".join(f"version {v}: {why}" for v, why in sorted(model.failed_versions.items())) or "not loaded"

    # -- changes -----------------------------------------------------------------------------

    async def load(self, name: str) -> list[int]:
        """Load `name` from the repository, or reload it: versions whose graphs and config are
        unchanged keep serving untouched, new or changed ones are built, the ones its version
        policy no longer names are retired. Returns the versions served. Raises
        ModelControlDisabled (not explicit mode), ModelNotFound (not in the repository),
        ModelLoadFailed (what served before still serves; the index says why)."""
        self._check_control("load")
        return await self._load(name)

    async def unload(self, name: str) -> None:
        """Stop serving `name`: it goes UNAVAILABLE at once, calls in flight and queued finish on
        their version. Raises ModelControlDisabled, ModelNotFound."""
        self._check_control("unload")
        await self._unload(name)

    def _check_control(self, what: str) -> None:
        mode = self.config.model_control_mode
        if mode != "explicit":
            raise ModelControlDisabled(
                f"explicit model {what} is not allowed in model control mode {mode} "
                "(start the server with --model-control-mode explicit)")

    async def _load(self, name: str) -> list[int]:
        async with self._lock:
            self._check_open()
            if name not in self._repository_names():
                raise ModelNotFound(f"no model {quoted(name)} in the repository {self.root}")
            old = self._models.get(name) or _Model()
            seen, specs = await self._read_off_loop(name)
            if isinstance(specs, ModelLoadError):
                why = str(specs)
                self._models[name] = _Model(old.versions, reason=why, seen=seen,
                                            unloaded_versions=() if old.versions else old.unloaded_versions)
                logger.error("model %s: load failed, %s: %s", logged(name), self._serving_note(old), escaped(why))
                raise ModelLoadFailed(f"load of model {name} failed ({self._serving_note(old)}): {why}") from None
            keep = {v: lv for v, lv in old.versions.items()
                    if v in {s.version for s in specs} and same_model(lv.spec, specs[0])
                    and lv.fingerprint == version_fingerprint(lv.spec)}
            started = time.monotonic()
            built, failures = {}, {}
            for spec in specs:
                if spec.version in keep:
                    continue
                try:
                    built[spec.version] = await _off_loop(self._open, spec)
                except Exception as err:
                    failures[spec.version] = _reason(err)
            warms = not failures and self.config.warmup != "none"
            if warms:
                # Warmed before it is installed: what served before serves meanwhile (a hot swap).
                self._warming_loads[name] = tuple(sorted(built))
                try:
                    for version, opened in sorted(built.items()):
                        if opened.warm_up is not None:
                            await _off_loop(self._warm, name, version, opened.warm_up)
                except Exception as err:  # a run of a graph that check_servable's tiny run passed
                    failures[min(built)] = f"warm-up failed: {_reason(err)}"
                    del self._warming_loads[name]
            self._check_open()
            if failures:
                self._models[name] = _Model(old.versions, failed_versions=failures, seen=seen)
                why = "; ".join(f"version {v}: {r}" for v, r in sorted(failures.items()))
                logger.error("model %s: load failed, %s: %s", logged(name), self._serving_note(old), escaped(why))
                raise ModelLoadFailed(f"load of model {name} failed ({self._serving_note(old)}): {why}")
            ready_lines: list = []  # said once the new versions serve, not while their request path warms
            new = self._install(name, specs, keep, built, {}, ready_lines)
            new.seen = seen
            if warms:
                try:  # the new batchers' request path, before they serve (no caller reaches them yet)
                    for version in sorted(built):
                        if self._warms(new.versions[version]):
                            await self._warm_request_path(new.versions[version])
                finally:
                    del self._warming_loads[name]
            retired = [lv for v, lv in old.versions.items() if keep.get(v) is not lv]
            self._models[name] = new
            try:
                self._followed()
            except Exception as err:  # the native plane refused the new versions: the old ones go on serving
                why = f"the data plane refused it: {_reason(err)}"
                self._models[name] = _Model(old.versions, reason=why, seen=seen)
                self._followed()
                for version in built:
                    self._retire(new.versions[version])
                logger.exception("model %s: load failed, %s: %s", logged(name), self._serving_note(old), escaped(why))
                raise ModelLoadFailed(f"load of model {name} failed ({self._serving_note(old)}): {why}") from None
            for line in ready_lines:
                logger.info(*line)
            for lv in retired:
                self._retire(lv)
            self._record_ready(name, time.monotonic() - started, "its load began")
        await self._tell(name)
        return sorted(new.versions)

    async def _unload(self, name: str) -> None:
        async with self._lock:
            self._check_open()
            model = self._models.get(name)
            if model is None:
                if name not in self._repository_names():
                    raise ModelNotFound(f"unknown model {quoted(name)}; serving {self.ready_names()}")
                model = _Model()  # in the repository, never loaded: unloaded already
            self._models[name] = _Model(reason="unloaded",
                                        unloaded_versions=tuple(sorted(model.versions)) or model.unloaded_versions)
            for lv in model.versions.values():
                self._retire(lv)
            self._followed()
            logger.info("model %s unloaded (versions %s)", logged(name), sorted(model.versions))
        await self._tell(name)

    async def poll(self) -> None:
        """One rescan (--model-control-mode poll): load the models that are new or whose files
        changed since they were last read (a failed one is tried again once its files change),
        unload the ones gone from the repository. Failures are logged and kept in the index."""
        try:
            on_disk = set(self._repository_names())
        except (ModelLoadError, OSError) as err:
            logger.error("repository poll: %s", escaped(err))
            return
        for name in sorted(on_disk):
            model = self._models.get(name)
            if model is not None and model.seen == repository_signature(self.root / name):
                continue
            try:
                await self._load(name)
            except (ModelLoadFailed, ModelNotFound):
                pass  # logged, and in the index
        for name in sorted(set(self._models) - on_disk):
            if self._models[name].versions:
                await self._unload(name)

    async def _poll_forever(self) -> None:
        while True:
            await asyncio.sleep(self.config.repository_poll_secs)
            try:
                await self.poll()
            except Exception:  # the poller must outlive any one bad rescan
                logger.exception("repository poll failed")

    # -- building and retiring ---------------------------------------------------------------

    def _repository_names(self) -> list[str]:
        return model_names(self.root)

    def _read(self, name: str) -> tuple[ModelSpec, ...]:
        """The specs of `name` (blocking); ModelLoadError whatever went wrong: at startup one bad
        model is not ready while the others serve, never a server that does not start."""
        try:
            return read_model_specs(self.root / name, self.config.pinned_versions.get(name))
        except ModelLoadError:
            raise
        except Exception as err:  # a check that missed a case: still this model's fault alone
            logger.exception("model %s: reading its config.json failed", logged(name))
            where = self.root / name / CONFIG_FILE
            raise ModelLoadError(f"{where}: unreadable ({type(err).__name__}: {err})") from None

    async def _read_off_loop(self, name: str) -> tuple[tuple, tuple[ModelSpec, ...] | ModelLoadError]:
        """(repository_signature, the specs or why not) of `name`, read on a thread of its own
        within _READ_TIMEOUT_S: a file system that hangs (NFS, FUSE) keeps neither the event loop
        nor, past the bound, the registry's lock."""
        def read() -> tuple[tuple, tuple[ModelSpec, ...] | ModelLoadError]:
            seen = repository_signature(self.root / name)
            try:
                return seen, self._read(name)
            except ModelLoadError as err:
                return seen, err

        try:
            return await asyncio.wait_for(_off_loop(read), _READ_TIMEOUT_S)
        except TimeoutError:
            return (), ModelLoadError(f"{self.root / name / CONFIG_FILE}: not read within {_READ_TIMEOUT_S:.0f}s "
                                      "(a file system that does not answer?)")

    def _open(self, spec: ModelSpec) -> _Opened:
        """Blocking: the run of one version (its ONNX Runtime sessions), what it runs on, its
        fingerprint as read before opening (a change while opening is seen next time), the
        graphs it runs (a run_batch without an Engine: UNFUSED, every run counts its whole matrix)
        its run on solo sessions (None without them: a run_batch given, CUDA, or switched off), its
        warm-up (None with a run_batch given: no ONNX Runtime sessions to warm) and whether its
        runs write outputs where they are told (the Engine's on the CPU)."""
        fingerprint = version_fingerprint(spec)
        if self._run_batch is not None:
            return _Opened(self._run_batch(spec), "a run_batch given to the server, no ONNX Runtime", fingerprint,
                           UNFUSED, None, None, False)
        device = self._device
        if device is None:
            raise RuntimeError("ModelRegistry has no device to open models on")
        # Opened on a thread of the compute priority: ONNX Runtime's pool threads inherit it.
        # The same loader and run as the batch adapters' (attnserve.runtime).
        predictor = priority.run_lowered(self.config.compute_nice, lambda: AttentionPredictor.from_spec(
            spec, device, self.config.intra_op_threads, solo=self.config.spin_when_alone,
            chunk_rows=self.config.chunk_query_rows))
        engine = predictor.engine
        check_servable(spec, engine.sessions)  # READY means servable: never READY, then INTERNAL on every call
        runs = warm_up_plan(engine.graphs, spec)
        ran = self._metrics.warm_up_ran(spec.name)

        def warm() -> dict:
            return warm_up(engine, spec, runs, ran)

        return _Opened(predictor.run_feeds, ",".join(engine.providers), fingerprint, engine.graphs, predictor.run_solo,
                       warm, engine.writes_into)

    def _warms(self, lv: LoadedVersion) -> bool:
        return lv.warm_up is not None and self.config.warmup != "none"

    def _warm(self, name: str, version: int, warm: WarmUp) -> None:
        """Blocking: one version's warm-up, at the compute priority (after the test's hold, if any)."""
        if self.warm_up_hold is not None:
            self.warm_up_hold(name, version)
        started = time.monotonic()
        done = priority.run_lowered(self.config.compute_nice, warm)
        logger.info("model %s version %d warmed up in %.2fs: %d run(s) (%s)", logged(name), version,
                    time.monotonic() - started, sum(done.values()),
                    ", ".join(f"{graph} {session} x{n}" for (graph, session), n in sorted(done.items())))

    async def _warm_request_path(self, lv: LoadedVersion) -> None:
        """A version's request path warmed (server.warmup.warm_request_path), its batcher started.
        A refusal (a memory budget too small for the request, say) only costs the first caller
        that first use: its graphs have run already, so the version serves all the same."""
        try:
            done = await warm_request_path(lv.spec, lv.limits, lv.batcher, self._metrics.warm_up_sent(lv.spec.name))
        except Exception as err:
            logger.warning("model %s version %d: the request path's warm-up was refused, serving without it: %s",
                           logged(lv.spec.name), lv.spec.version, escaped(_reason(err)))
            return
        logger.info("model %s version %d: request path warmed up: %s", logged(lv.spec.name), lv.spec.version,
                    ", ".join(f"{session} x{n}" for session, n in sorted(done.items())))

    async def warm_up_at_start(self) -> None:
        """Warm every model installed at start (Server.start, once its ports are bound), one
        after another; each turns ready as its warm-up ends. A model whose warm-up fails is not
        served, with the reason in the index."""
        for name, model in sorted(self._models.items()):
            if not model.warming:
                if model.versions:
                    self._record_ready(name, time.monotonic() - self.started_at, "the server's start")
                continue
            try:
                for version, lv in sorted(model.versions.items()):
                    await asyncio.to_thread(self._warm, name, version, lv.warm_up)
                    await self._warm_request_path(lv)
            except Exception as err:  # a run of a graph that check_servable's tiny run passed
                reason = f"warm-up failed: {_reason(err)}"
                logger.error("model %s is not ready: %s", logged(name), escaped(reason))
                for lv in model.versions.values():
                    self._retire(lv)
                self._models[name] = _Model(reason=reason, seen=model.seen)
            else:
                model.warming = False
                self._followed()
                self._record_ready(name, time.monotonic() - self.started_at, "the server's start")
            await self._tell(name)

    def _record_ready(self, name: str, seconds: float, since: str) -> None:
        """Time-to-ready: logged, and the gauge attnserve_model_ready_seconds."""
        self._metrics.model_ready(name, seconds)
        logger.info("model %s ready: time-to-ready %.2fs since %s (--warmup %s)", logged(name), seconds, since,
                    self.config.warmup)

    def _install(self, name: str, specs: tuple[ModelSpec, ...], keep: dict[int, LoadedVersion],
                 built: dict[int, tuple], failures: dict[int, str], ready_lines: list | None = None) -> _Model:
        """A model entry serving `keep` and the versions in `built` (batchers made and, once the
        registry has started, started); failures are logged and kept. ready_lines: where each
        version's "ready" log line waits (its caller logs them once the entry serves), else logged now."""
        cfg = self.config
        versions = dict(keep)
        for spec in specs:
            if spec.version not in built:
                continue
            run, runs_on, fingerprint, graphs, run_solo, warm, writes_into = built[spec.version]  # an _Opened
            policy = BatchPolicy(
                max_batch_size=cfg.max_batch_size or spec.max_batch_size,
                max_queue_delay_s=(cfg.max_queue_delay_ms if cfg.max_queue_delay_ms is not None
                                   else spec.max_queue_delay_ms) / 1000.0,
                max_queue_size=cfg.max_queue_size,
                max_padding_ratio=cfg.max_padding_ratio,
                batches_in_flight=cfg.batches_in_flight,
                max_queued_bytes=cfg.max_queued_bytes,
                # A merged batch's attention matrix obeys the same bound as one request's.
                max_batch_scores=max(cfg.max_attention_bytes // (4 * spec.num_heads), 1),
                priority_aging_batches=cfg.priority_aging_batches,
            )
            label = name if len(specs) == 1 else f"{name}-v{spec.version}"
            # A merged batch's run, like a request's, is bounded by what the graph that runs it holds.
            batcher = Batcher(label, run, policy, self._metrics.observer(name), self._arrivals,
                              scores_of=graphs.scores_held, budget=self._budget,
                              costing=None if self._budget is None else GraphCosting(spec, graphs),
                              run_solo=run_solo, lone_call_signal=self._lone_call_signal, compute_nice=cfg.compute_nice,
                              tracer=None if self._tracing is None else self._tracing.batch_tracer(
                                  name, spec.version, graphs),
                              writes_into=writes_into,
                              stoppable_runs=self._run_batch is None or getattr(self._run_batch, "stoppable", False))
            limits = Limits(spec.max_q_len, spec.max_kv_len, cfg.max_attention_bytes,
                            max_response_bytes=cfg.max_message_bytes, max_typed_bytes=cfg.max_typed_bytes,
                            graphs=graphs)
            if self._started:
                batcher.start()
            versions[spec.version] = LoadedVersion(spec, batcher, limits, fingerprint, warm)
            line = ("model %s version %d ready on %s (max_batch_size=%d, max_queue_delay_ms=%.2f, graphs=%s)",
                    logged(name), spec.version, runs_on, policy.max_batch_size, policy.max_queue_delay_s * 1000,
                    _describe(graphs))
            if ready_lines is None:
                logger.info(*line)
            else:
                ready_lines.append(line)
        for version, reason in sorted(failures.items()):
            logger.error("model %s is not ready: version %d: %s", logged(name), version, escaped(reason))
        if failures:  # at startup: a model serves its whole policy or nothing (as a reload)
            versions = {}
        return _Model(dict(sorted(versions.items())), failed_versions=failures)

    def _retire(self, lv: LoadedVersion) -> None:
        """Close lv's batcher in the background: what is queued and running on it finishes."""
        self._retiring.add(lv)

        name, version = lv.spec.name, lv.spec.version

        async def finish() -> None:
            nonlocal lv
            await lv.batcher.close()
            self._retiring.discard(lv)
            lv = None  # the last reference: its sessions and their arenas are freed now
            # ONNX Runtime's freed arenas and weights stay in the process's heaps until trimmed:
            # without this, every reload kept its whole working set (docs/hardening-grpc-workers.md).
            await asyncio.to_thread(heap.reclaim)
            self.reclaimed += 1
            logger.info("model %s version %d retired: its last call is done, its sessions released", logged(name),
                        version)

        task = asyncio.get_running_loop().create_task(finish(), name=f"retire-{name}-{version}")
        self._retire_tasks.add(task)
        task.add_done_callback(self._retire_tasks.discard)

    def _followed(self) -> None:
        if self.follow is not None:
            self.follow()

    async def _tell(self, name: str) -> None:
        if self.listener is not None:
            await self.listener(name, self.ready(name) if name in self._models else False)

    def _check_open(self) -> None:
        if self._closed:
            raise ModelUnavailable("the server is shutting down: models are not loaded or unloaded any more")

    @staticmethod
    def _serving_note(old: _Model) -> str:
        return f"still serving version(s) {sorted(old.versions)}" if old.versions else "nothing served"

    # -- lifetime ----------------------------------------------------------------------------

    def start(self) -> None:
        self._started = True
        for model in self._models.values():
            for lv in model.versions.values():
                lv.batcher.start()
        if self.config.model_control_mode == "poll":
            self._poll_task = asyncio.get_running_loop().create_task(self._poll_forever(), name="repository-poll")

    async def close(self, abandon_queued: bool = False) -> None:
        """No more changes; finish (or, abandon_queued, refuse) what every batcher holds,
        those of versions being retired included."""
        self._closed = True
        if self._poll_task is not None:
            self._poll_task.cancel()
            await asyncio.gather(self._poll_task, return_exceptions=True)
        try:  # a load under way completes (or fails) first, unless it is stuck
            await asyncio.wait_for(self._lock.acquire(), _CLOSE_WAITS_FOR_LOAD_S)
        except TimeoutError:
            logger.warning("a model load or unload still under way after %.0fs: closing without it",
                           _CLOSE_WAITS_FOR_LOAD_S)
            locked = False
        else:
            locked = True
        try:
            batchers = [lv.batcher for model in self._models.values() for lv in model.versions.values()]
            batchers += [lv.batcher for lv in list(self._retiring)]
            for batcher in batchers:
                await batcher.close(abandon_queued)
            if self._retire_tasks:
                await asyncio.gather(*self._retire_tasks, return_exceptions=True)
        finally:
            if locked:
                self._lock.release()


# A config.json (and its model directory's listing) read within this, or the load fails: only a
# file system that does not answer takes longer, and the load holds the registry's lock meanwhile.
_READ_TIMEOUT_S = 30.0
# At shutdown, a load still running after this is left behind (its thread is a daemon): a stop
# never waits forever behind a load stuck in a file system or in ONNX Runtime.
_CLOSE_WAITS_FOR_LOAD_S = 10.0


async def _off_loop(fn: Callable, *args: object) -> object:
    """fn(*args) on a daemon thread of its own, awaited. Not asyncio.to_thread: the default
    executor's threads are joined at exit, so one stuck in a read or in ONNX Runtime would keep
    the process from ever exiting after SIGTERM."""
    loop = asyncio.get_running_loop()
    future = loop.create_future()

    def settle(result: object, error: BaseException | None) -> None:
        if future.done():  # cancelled (a time bound ran out, a stop)
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)

    def run() -> None:
        try:
            result, error = fn(*args), None
        except BaseException as err:  # handed to the awaiting caller
            result, error = None, err
        try:
            loop.call_soon_threadsafe(settle, result, error)
        except RuntimeError:  # the loop closed meanwhile: nobody awaits it any more
            pass

    threading.Thread(target=run, name=f"model-{getattr(fn, '__name__', 'work')}", daemon=True).start()
    return await future


# The warm-up's sizes: distinct, so that a graph that swaps two of them answers the wrong shape.
_WARM_UP_DIMS = {BATCH: 1, Q_LEN: 2, K_LEN: 3}
_SHAPES = {**SYMBOLIC_SHAPES, KEY_PADDING_MASK: (BATCH, K_LEN), HEAD_MASK: HEAD_MASK_SHAPE}
_ORT_TYPES = {"tensor(float)": np.float32, "tensor(float16)": np.float16, "tensor(bool)": np.bool_,
              "tensor(int32)": np.int32, "tensor(int64)": np.int64}


def check_servable(spec: ModelSpec, sessions: dict) -> None:
    """Raise ModelLoadError, naming the graph, the tensor and both shapes, unless every graph
    (kind -> onnxruntime session) takes and gives the tensors config.json declares, with its
    widths, and a warm-up run (zeros, every mask open) answers the shapes those widths make."""
    widths = {"query_dim": spec.query_dim, "kv_dim": spec.kv_dim, "out_dim": spec.out_dim,
              "num_heads": spec.num_heads}

    def concrete(name: str) -> tuple[int, ...]:
        return tuple(_WARM_UP_DIMS.get(d, widths.get(d, -1)) for d in _SHAPES[name])

    declared = {t.name for t in (*spec.inputs, *spec.outputs)}
    for kind, session in sorted(sessions.items()):
        where = f"version {spec.version}: graph {spec.graph_path(kind).name} does not match config.json"
        feeds = {}
        for role, args in (("input", session.get_inputs()), ("output", session.get_outputs())):
            for arg in args:
                if arg.name not in _SHAPES or (arg.name not in declared
                                                              and arg.name not in (HEAD_MASK, KEY_PADDING_MASK)):
                    raise ModelLoadError(f"{where}: it has an {role} {arg.name!r} that config.json does not "
                                         f"declare (declared: {', '.join(sorted(declared))})")
                want = concrete(arg.name)
                got = tuple(arg.shape)
                fixed = [(i, w, g) for i, (w, g) in enumerate(zip(want, got, strict=True))
                         if isinstance(g, int) and _SHAPES[arg.name][i] not in _WARM_UP_DIMS and g != w]
                if len(got) != len(want) or fixed:
                    raise ModelLoadError(f"{where}: {role} {arg.name!r} has shape {list(got)}, config.json's widths "
                                         f"make it {_symbolic(arg.name, widths)}")
                if role == "input":
                    dtype = _ORT_TYPES.get(arg.type, np.float32)
                    feeds[arg.name] = np.ones(want, dtype) if dtype in (np.bool_, np.int32, np.int64) else np.zeros(
                        want, dtype)
        try:
            answers = session.run(None, feeds)
        except Exception as err:  # onnxruntime's own exception types
            raise ModelLoadError(f"{where}: a warm-up run failed: {type(err).__name__}: {err}") from None
        for arg, answer in zip(session.get_outputs(), answers, strict=True):
            if tuple(answer.shape) != concrete(arg.name):
                raise ModelLoadError(f"{where}: a warm-up run answered {arg.name!r} of shape {list(answer.shape)} "
                                     f"for {_WARM_UP_DIMS}; config.json's widths make it {list(concrete(arg.name))}")


def _symbolic(name: str, widths: dict[str, int]) -> list:
    return [widths.get(d, d) for d in _SHAPES[name]]


def _reason(err: Exception) -> str:
    return str(err) if isinstance(err, ModelLoadError) else f"{type(err).__name__}: {err}"


def _describe(graphs: GraphSet) -> str:
    """The graphs a model runs, and from which length the fused ones do, for the startup line."""
    parts = []
    for kind in (ALL_OUTPUTS, OUTPUT_ONLY, *FUSED_KINDS, *HEAD_MASK_KINDS):
        if kind in graphs.kinds:
            length = graphs.crossover.get(kind) if kind in FUSED_KINDS else None
            parts.append(kind if length is None else f"{kind} from sqrt(Lq*Lk) >= {length}")
    return ", ".join(parts)
