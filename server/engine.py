"""ONNX Runtime sessions for one model version: the graph with attn_probs and the one without.

Knows nothing of gRPC or batching. `run` is blocking and thread-safe (ONNX Runtime sessions
are), and releases the GIL while it computes, so callers run it off the event loop.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import onnxruntime as ort

from attnserve.server.memory import TRIM_AFTER_SCORES_BYTES, trim_heap
from attnserve.server.repository import ModelSpec

logger = logging.getLogger(__name__)

CUDA = "CUDAExecutionProvider"
CPU = "CPUExecutionProvider"


class DeviceUnavailable(RuntimeError):
    """--device cuda was asked for and CUDA cannot be used; the message says why."""


@dataclass(frozen=True)
class DeviceChoice:
    providers: tuple[str, ...]
    why_not_cuda: str | None  # set when CUDA was wanted (cuda/auto) but is not used


def choose_device(device: str) -> DeviceChoice:
    """The execution providers for --device, or DeviceUnavailable for 'cuda' without CUDA."""
    if device == "cpu":
        return DeviceChoice((CPU,), None)
    available = ort.get_available_providers()
    if CUDA in available:
        return DeviceChoice((CUDA, CPU), None)
    why_not_cuda = f"{CUDA} not in onnxruntime.get_available_providers() = {available} (onnxruntime {ort.__version__}; install onnxruntime-gpu)"
    if device == "cuda":
        raise DeviceUnavailable(why_not_cuda)
    return DeviceChoice((CPU,), why_not_cuda)


def session_options(intra_op_threads: int) -> ort.SessionOptions:
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.intra_op_num_threads = intra_op_threads
    options.inter_op_num_threads = 1
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    # ONNX Runtime's pool threads spin after each run waiting for the next; on a server whose
    # event loop shares the cores, that spinning starves the loop (measured: the pool thread
    # burned 7.2 s of CPU against the loop's 6.0 s in an 11 s run at concurrency 32).
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    # No CPU memory arena: with it RSS stays at the largest run's peak for good (measured, self_attention
    # (8, 512, 512): +416 MB after the run with the arena, +152 MB with its shrinkage run option,
    # +16 MB without it; peak 416 / 320 / 248 MB; small runs no slower). README, "Memory".
    options.enable_cpu_mem_arena = False
    return options


class Engine:
    """Both graphs of one model version, on the chosen device.

    On CUDA every run goes through I/O binding: inputs are bound from host memory and outputs
    are allocated by ONNX Runtime on the device, then copied back once. `io_binding=True` takes
    the same path on the CPU provider (how CI exercises it without a GPU)."""

    def __init__(self, spec: ModelSpec, device: DeviceChoice, intra_op_threads: int = 0,
                 io_binding: bool | None = None) -> None:
        self.spec = spec
        options = session_options(intra_op_threads)
        self._all_outputs = self._open(str(spec.graph_all_outputs), options, device)
        # The probability-free graph is an optimisation: serve without it if it is missing.
        self._output_only = None
        if spec.graph_output_only.exists():
            self._output_only = self._open(str(spec.graph_output_only), options, device)
        else:
            logger.warning("%s: %s missing; requests for `output` alone will compute attn_probs too",
                           spec.name, spec.graph_output_only.name)
        self.providers = tuple(self._all_outputs.get_providers())
        self.has_output_only = self._output_only is not None
        on_cuda = self.providers[0] == CUDA
        self._io_binding = on_cuda if io_binding is None else io_binding
        self._output_device = "cuda" if on_cuda else "cpu"

    @staticmethod
    def _open(path: str, options: ort.SessionOptions, device: DeviceChoice) -> ort.InferenceSession:
        session = ort.InferenceSession(path, sess_options=options, providers=list(device.providers))
        if device.providers[0] == CUDA and session.get_providers()[0] != CUDA:
            # ORT falls back to CPU silently when the CUDA libraries fail to load.
            raise DeviceUnavailable(f"{CUDA} is installed but the session for {path} runs on {session.get_providers()}")
        return session

    def run(self, feeds: dict[str, np.ndarray], want_probs: bool) -> tuple[np.ndarray, np.ndarray | None]:
        """feeds: query (B, Lq, q_dim), key/value (B, Lk, kv_dim), mask (B, Lq, Lk) bool.
        Returns output (B, Lq, out_dim) and attn_probs (B, H, Lq, Lk) or None."""
        try:
            if want_probs or self._output_only is None:
                output, attn_probs = self._run(self._all_outputs, feeds)
                return output, (attn_probs if want_probs else None)
            (output,) = self._run(self._output_only, feeds)
            return output, None
        finally:
            if feeds["mask"].size * 4 * self.spec.num_heads >= TRIM_AFTER_SCORES_BYTES:
                trim_heap()  # a large run's freed buffers go back to the system now

    def _run(self, session: ort.InferenceSession, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        if not self._io_binding:
            return session.run(None, feeds)
        binding = session.io_binding()
        for name, array in feeds.items():
            binding.bind_cpu_input(name, array)
        for output in session.get_outputs():
            binding.bind_output(output.name, self._output_device)
        session.run_with_iobinding(binding)
        return binding.copy_outputs_to_cpu()
