"""The models a server process serves: load each one, keep the ones that fail with their reason.

Knows nothing of gRPC: lookups raise ModelNotFound / ModelUnavailable, which server.errors maps.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from attnserve.server.batcher import ArrivalSignal, Batcher, BatchPolicy
from attnserve.server.codec import Limits
from attnserve.server.config import ServerConfig
from attnserve.server.engine import DeviceChoice, Engine
from attnserve.server.metrics import Metrics
from attnserve.server.repository import ModelLoadError, ModelSpec, model_names, read_model_spec

logger = logging.getLogger(__name__)


class ModelNotFound(LookupError):
    """No such model, or not that version."""


class ModelUnavailable(RuntimeError):
    """The model exists but failed to load; the message says why."""


@dataclass
class LoadedModel:
    spec: ModelSpec
    engine: Engine
    batcher: Batcher
    limits: Limits


class ModelRegistry:
    def __init__(self) -> None:
        self.loaded: dict[str, LoadedModel] = {}
        self.failed: dict[str, str] = {}  # name -> why it is not ready

    @classmethod
    def load(cls, config: ServerConfig, device: DeviceChoice, metrics: Metrics,
             arrivals: ArrivalSignal | None = None) -> "ModelRegistry":
        """Load every model of the repository; a model that fails is logged and kept as failed.
        arrivals: requests received but not yet submitted (each batcher's hint of company)."""
        registry = cls()
        root = Path(config.model_repository)
        pins = config.pinned_versions
        for name in model_names(root):
            try:
                spec = read_model_spec(root / name, pins.get(name))
                engine = Engine(spec, device, config.intra_op_threads)
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
            batcher = Batcher(name, engine.run, policy, metrics.observer(name), arrivals)
            limits = Limits(spec.max_q_len, spec.max_kv_len, config.max_attention_bytes,
                            max_response_bytes=config.max_message_bytes)
            registry.loaded[name] = LoadedModel(spec, engine, batcher, limits)
            logger.info("model %s version %d ready on %s (max_batch_size=%d, max_queue_delay_ms=%.2f)",
                        name, spec.version, ",".join(engine.providers), policy.max_batch_size,
                        policy.max_queue_delay_s * 1000)
        for name in pins:
            if name not in registry.loaded and name not in registry.failed:
                logger.warning("pinned model %s is not in the repository %s", name, root)
        return registry

    def get(self, name: str, version: str = "") -> LoadedModel:
        model = self.loaded.get(name)
        if model is None:
            if name in self.failed:
                raise ModelUnavailable(f"model {name} is not ready: {self.failed[name]}")
            raise ModelNotFound(f"unknown model {name!r}; serving {sorted(self.loaded)}")
        if version and version != str(model.spec.version):
            raise ModelNotFound(f"model {name} version {version!r} is not loaded (loaded: {model.spec.version}, "
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
