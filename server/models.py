"""The models a server process serves: load each one, keep the ones that fail with their reason.

Knows nothing of gRPC: lookups raise ModelNotFound / ModelUnavailable, which server.errors maps.
Each model's batches are computed by an ONNX Runtime Engine, or by what a RunBatchFactory
given to `load` makes (bench.floor's zeros: the whole stack, without a model).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from attnserve.server.batcher import ArrivalSignal, Batcher, BatchPolicy, RunBatch, Work
from attnserve.server.codec import Limits
from attnserve.server.config import ServerConfig
from attnserve.server.echo import echo
from attnserve.server.engine import DeviceChoice, Engine
from attnserve.server.lifecycle import MemoryBudget
from attnserve.server.memory import AttentionDims, Cost, GraphKind, request_cost, run_working_set
from attnserve.server.metrics import Metrics
from attnserve.server.repository import ModelLoadError, ModelSpec, model_names, read_model_spec

logger = logging.getLogger(__name__)


class ModelNotFound(LookupError):
    """No such model, or not that version."""


class ModelUnavailable(RuntimeError):
    """The model exists but failed to load; the message says why."""


# The blocking run of a model's batches, made from its spec. ModelRegistry.load's default is an
# ONNX Runtime Engine on the chosen device; the one seam for running the server without a model.
RunBatchFactory = Callable[[ModelSpec], RunBatch]


class GraphCosting:
    """server.memory's estimate for one model's graphs (batcher.Costing)."""

    def __init__(self, spec: ModelSpec, has_output_only: bool = True, fused: bool = False) -> None:
        d_model = spec.d_model or max(spec.query_dim, spec.kv_dim, spec.out_dim)  # older config.json: a bound
        self.dims = AttentionDims(spec.query_dim, spec.kv_dim, d_model, spec.out_dim, spec.num_heads)
        self._has_output_only = has_output_only
        self._fused = fused  # the hook for com.microsoft.MultiHeadAttention graphs (server.memory)

    def kind(self, want_probs: bool) -> GraphKind:
        if self._fused:
            return GraphKind.FUSED
        if want_probs or not self._has_output_only:
            return GraphKind.UNFUSED_WITH_PROBS
        return GraphKind.UNFUSED_OUTPUT_ONLY

    def cost(self, work: Work) -> Cost:
        return request_cost(self.kind(work.want_probs), self.dims, work.rows, work.q_len, work.k_len,
                            work.nbytes, work.want_probs)

    def batch_run(self, rows: int, q_len: int, k_len: int, want_probs: bool) -> int:
        return run_working_set(self.kind(want_probs), self.dims, rows, q_len, k_len)


@dataclass
class LoadedModel:
    spec: ModelSpec
    batcher: Batcher
    limits: Limits


class ModelRegistry:
    def __init__(self) -> None:
        self.loaded: dict[str, LoadedModel] = {}
        self.failed: dict[str, str] = {}  # name -> why it is not ready

    @classmethod
    def load(cls, config: ServerConfig, device: DeviceChoice, metrics: Metrics,
             arrivals: ArrivalSignal | None = None, run_batch: RunBatchFactory | None = None,
             budget: MemoryBudget | None = None) -> "ModelRegistry":
        """Load every model of the repository; a model that fails is logged and kept as failed.
        arrivals: requests received but not yet submitted (each batcher's hint of company).
        run_batch: makes each model's run instead of an ONNX Runtime Engine (bench.floor).
        budget: the process's memory budget, shared by every model's batcher."""
        registry = cls()
        root = Path(config.model_repository)
        pins = config.pinned_versions
        for name in model_names(root):
            try:
                spec = read_model_spec(root / name, pins.get(name))
                if run_batch is None:
                    engine = Engine(spec, device, config.intra_op_threads)
                    run, runs_on = engine.run, ",".join(engine.providers)
                    costing = GraphCosting(spec, engine.has_output_only)
                else:
                    run, runs_on = run_batch(spec), "a run_batch given to the server, no ONNX Runtime"
                    costing = GraphCosting(spec, spec.graph_output_only.exists())
            except Exception as err:  # corrupt graphs raise onnxruntime's own exception types
                reason = f"{type(err).__name__}: {err}" if not isinstance(err, ModelLoadError) else str(err)
                registry.failed[name] = reason
                logger.error("model %s is not ready: %s", name, reason)
                continue
            policy = BatchPolicy(
                max_batch_size=config.max_batch_size or spec.max_batch_size,
                max_queue_delay_s=(config.max_queue_delay_ms if config.max_queue_delay_ms is not None
                                   else spec.max_queue_delay_ms) / 1000.0,
                max_queue_size=config.max_queue_size,
                max_padding_ratio=config.max_padding_ratio,
                batches_in_flight=config.batches_in_flight,
                max_queued_bytes=config.max_queued_bytes,
                # A merged batch's attention matrix obeys the same bound as one request's.
                max_batch_scores=max(config.max_attention_bytes // (4 * spec.num_heads), 1),
            )
            batcher = Batcher(name, run, policy, metrics.observer(name), arrivals,
                              budget=budget, costing=None if budget is None else costing)
            limits = Limits(spec.max_q_len, spec.max_kv_len, config.max_attention_bytes,
                            max_response_bytes=config.max_message_bytes)
            registry.loaded[name] = LoadedModel(spec, batcher, limits)
            logger.info("model %s version %d ready on %s (max_batch_size=%d, max_queue_delay_ms=%.2f)",
                        name, spec.version, runs_on, policy.max_batch_size, policy.max_queue_delay_s * 1000)
        for name in pins:
            if name not in registry.loaded and name not in registry.failed:
                logger.warning("pinned model %s is not in the repository %s", name, root)
        return registry

    def get(self, name: str, version: str = "") -> LoadedModel:
        model = self.loaded.get(name)
        if model is None:
            if name in self.failed:
                raise ModelUnavailable(f"model {name} is not ready: {self.failed[name]}")
            raise ModelNotFound(f"unknown model {echo(name)}; serving {sorted(self.loaded)}")
        if version and version != str(model.spec.version):
            raise ModelNotFound(f"model {name} version {echo(version)} is not loaded (loaded: {model.spec.version}, "
                                f"on disk: {list(model.spec.available_versions)})")
        return model

    def ready(self, name: str, version: str = "") -> bool:
        try:
            self.get(name, version)
        except ModelUnavailable:
            return False
        return True

    def start(self) -> None:
        for model in self.loaded.values():
            model.batcher.start()

    async def close(self, abandon_queued: bool = False) -> None:
        for model in self.loaded.values():
            await model.batcher.close(abandon_queued)
