"""ONNX Runtime sessions for one model version: every graph it has, and the choice among them.

Knows nothing of gRPC or batching. `run` is blocking and thread-safe (ONNX Runtime sessions
are), and releases the GIL while it computes, so callers run it off the event loop. Which graph
a run takes is server.graphs' choice (`Engine.graph_for`); `Engine.runs` counts them.
"""

from __future__ import annotations

import collections
import logging
from dataclasses import dataclass

import numpy as np
import onnxruntime as ort
from attnserve.server.cuda_probe import why_cuda_cannot_run
from attnserve.server.graphs import BYTES_PER_SCORE, GraphSet, masking_of
from attnserve.server.memory import heap
from attnserve.server.quoting import escaped, logged
from attnserve.server.repository import ModelSpec, check_version_files
from attnserve.server.tensors import INTO_ALIGNMENT, RunStop, RunStopped, dense_mask

from attnserve.contract import (
    ALL_OUTPUTS,
    FUSED_KINDS,
    GRAPH_INPUTS,
    GRAPH_OUTPUTS,
    HEAD_MASK,
    HEAD_MASK_KINDS,
    KEY_PADDING_MASK,
    OUTPUT_ONLY,
    REQUIRED_INPUTS,
    ROW_GRAPH_FILES,
    ROW_GRAPH_INPUTS,
    ROW_GRAPH_OUTPUTS,
    ROWS_KV,
    ROWS_OF,
    row_chunks,
)

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
    """The execution providers for --device, or DeviceUnavailable for 'cuda' without CUDA.

    CUDA is used when onnxruntime lists its provider and a probe session runs on it
    (server.cuda_probe): onnxruntime-gpu lists it even where its libraries cannot load."""
    if device == "cpu":
        return DeviceChoice((CPU,), None)
    available = ort.get_available_providers()
    if CUDA in available:
        why_not_cuda = why_cuda_cannot_run()
        if why_not_cuda is None:
            return DeviceChoice((CUDA, CPU), None)
        why_not_cuda = f"{CUDA} is listed but cannot run here: {why_not_cuda}"
    else:
        why_not_cuda = (f"{CUDA} not in onnxruntime.get_available_providers() = {available} "
                        f"(onnxruntime {ort.__version__}; install onnxruntime-gpu)")
    if device == "cuda":
        raise DeviceUnavailable(why_not_cuda)
    return DeviceChoice((CPU,), why_not_cuda)


# How long the solo sessions' pool threads spin after a run before they sleep: a lone client's next
# call still finds them awake, without ONNX Runtime's default 20-40 ms of spinning after each.
SOLO_SPIN_US = 2000


def session_options(intra_op_threads: int, spinning: bool = False) -> ort.SessionOptions:
    """spinning: the pool threads spin between and after runs, for SOLO_SPIN_US (ONNX Runtime's
    `spin_duration_us`), instead of sleeping; for the solo sessions (Engine, `solo`)."""
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.intra_op_num_threads = intra_op_threads
    options.inter_op_num_threads = 1
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    # ONNX Runtime's pool threads spin after each run waiting for the next; on a server whose
    # event loop shares the cores, that spinning starves the loop (docs/record/performance.md).
    options.add_session_config_entry("session.intra_op.allow_spinning", "1" if spinning else "0")
    if spinning:
        options.add_session_config_entry("session.intra_op.spin_duration_us", str(SOLO_SPIN_US))
    # No CPU memory arena: with it RSS stays at the largest run's peak for good, and small runs are
    # no slower without it (docs/record/server.md, "Memory goes back", has the figures).
    options.enable_cpu_mem_arena = False
    return options


class Engine:
    """Every graph of one model version, on the chosen device.

    The graph with attn_probs is required; the others are optimisations, served without when
    missing (an older export) or unloadable, with the reason logged once. Runs take numpy feeds
    and return numpy outputs on either provider (`session.run`): on CUDA, I/O binding (inputs
    bound from host memory, outputs allocated on the device and copied back) measured slower per
    call on an H200 (docs/record/performance.md, "On a GPU"). `io_binding=True` takes that path on
    either provider. The fused graphs are chosen by the same rule on CUDA as on CPU
    (server.graphs), with the crossover measured on CPU at export.

    Solo sessions (`solo=True`, CPU only): a second session of each unfused graph (those short
    sequences take, below the fused graphs' crossover) whose pool threads spin while idle, for
    `run(..., solo=True)`: the batcher's runs of a lone request (server.batcher, "Solo runs").
    After each such run ONNX Runtime's threads spin SOLO_SPIN_US before they sleep, so a lone
    client's next request finds its cores awake: a short run after an idle gap is otherwise
    slower than back to back. Up to one core's CPU while such requests keep coming; the same
    graphs, kernels and answers; those graphs' weights held twice. A run whose graph has no solo
    session takes the regular one. None on CUDA or with one intra-op thread.

    Row chunks (`chunk_rows`, CPU only): a fused run of more query rows than that is computed on the
    row-chunk graphs (export.chunked) a chunk of rows at a time over key/value projected once, each
    chunk's output written in place, so that a stopped run ends between two chunks: ONNX Runtime
    checks its terminate flag only between nodes, and the fused attention is one node
    (docs/scheduling.md, "Row chunks"). A version without those graphs runs unchunked."""

    def __init__(self, spec: ModelSpec, device: DeviceChoice, intra_op_threads: int = 0,
                 io_binding: bool = False, solo: bool = False, chunk_rows: int = 0) -> None:
        """chunk_rows: a fused run of more query rows than this is computed in chunks of at most
        this many (the row-chunk graphs, where the version has them; CPU only; 0: never)."""
        if chunk_rows < 0:
            raise ValueError(f"chunk_rows must be >= 0, got {chunk_rows}")
        self.spec = spec
        check_version_files(spec.version_dir)  # before ONNX Runtime opens anything by name (a FIFO would hang it)
        options = session_options(intra_op_threads)
        self._sessions = {ALL_OUTPUTS: self._open(str(spec.graph_all_outputs), options, device)}
        # The probability-free graph is an optimisation: serve without it if it is missing.
        if spec.graph_output_only.exists():
            self._sessions[OUTPUT_ONLY] = self._open(str(spec.graph_output_only), options, device)
        else:
            logger.warning("%s: %s missing; requests for `output` alone will compute attn_probs too",
                           logged(spec.name), logged(spec.graph_output_only.name))
        # Why a run cannot take a fused graph, by kind (None once it is loaded).
        self.why_not_fused: dict[str, str] = {}
        for kind in FUSED_KINDS:
            path = spec.graph_path(kind)
            if not path.exists():
                self.why_not_fused[kind] = (f"{path.name} not in version {spec.version} (exported before the fused "
                                            "graphs, or fp16)")
                continue
            try:
                self._sessions[kind] = self._open(str(path), options, device)
            except Exception as err:  # onnxruntime's own exception types; the unfused graphs still serve
                self.why_not_fused[kind] = f"{path.name} did not load: {type(err).__name__}: {err}"
        # The head-mask graphs run masks whose heads differ; without them such masks are refused.
        self.why_no_head_masks: str | None = None
        for kind in HEAD_MASK_KINDS:
            path = spec.graph_path(kind)
            if not path.exists():
                self.why_no_head_masks = f"{path.name} not in version {spec.version} (exported before them, or fp16)"
                break
            try:
                self._sessions[kind] = self._open(str(path), options, device)
            except Exception as err:  # onnxruntime's own exception types; the other graphs still serve
                self.why_no_head_masks = f"{path.name} did not load: {type(err).__name__}: {err}"
                break
        if self.why_no_head_masks is not None:
            for kind in HEAD_MASK_KINDS:
                self._sessions.pop(kind, None)
            logger.warning("%s: masks whose heads differ, (B, H, Lq, Lk), are refused: %s", logged(spec.name),
                           escaped(self.why_no_head_masks))
        self.graphs = GraphSet(frozenset(self._sessions), dict(spec.crossover))
        if self.why_not_fused:
            logger.warning("%s: runs without a mask or with a key padding mask take the unfused graph, whose "
                           "attention matrix grows with Lq*Lk, where the fused one is missing: %s",
                           logged(spec.name),
                           escaped("; ".join(f"{k}: {why}" for k, why in self.why_not_fused.items())))
        self.runs: collections.Counter[str] = collections.Counter()  # graph kind -> runs
        self.providers = tuple(self._sessions[ALL_OUTPUTS].get_providers())
        on_cuda = self.providers[0] == CUDA
        # Spinning CPU threads would not keep a GPU's work warm, and one intra-op thread is no pool
        # (nothing spins): then every run takes the regular sessions.
        self._solo_sessions: dict[str, ort.InferenceSession] = {}
        if solo and not on_cuda and intra_op_threads != 1:
            spinning = session_options(intra_op_threads, spinning=True)
            self._solo_sessions = {kind: self._open(str(spec.graph_path(kind)), spinning, device)
                                   for kind in (ALL_OUTPUTS, OUTPUT_ONLY) if kind in self._sessions}
        self.solo_runs = 0
        self.chunk_rows, self.row_chunks_run = chunk_rows, 0
        self._row_sessions: dict[str, ort.InferenceSession] = {}
        self.why_no_row_chunks = self._open_row_graphs(options, device, on_cuda) if chunk_rows else "chunk_rows is 0"
        self._io_binding = io_binding
        # Runs write into given host arrays on the CPU provider only: on CUDA that would be a
        # device-to-host copy ONNX Runtime makes, untested here (docs/shared-memory.md, CUDA).
        self._writes_into = not on_cuda
        self._output_device = "cuda" if on_cuda else "cpu"

    @staticmethod
    def _open(path: str, options: ort.SessionOptions, device: DeviceChoice) -> ort.InferenceSession:
        session = ort.InferenceSession(path, sess_options=options, providers=list(device.providers))
        if device.providers[0] == CUDA and session.get_providers()[0] != CUDA:
            # ORT falls back to CPU silently when the CUDA libraries fail to load.
            raise DeviceUnavailable(f"{CUDA} is installed but the session for {path} runs on {session.get_providers()}")
        return session

    def _open_row_graphs(self, options: ort.SessionOptions, device: DeviceChoice, on_cuda: bool) -> str | None:
        """Open the row-chunk graphs ("Row chunks"); why a long fused run cannot be chunked, or None."""
        if on_cuda:  # their outputs are written into host memory a chunk at a time: CPU only
            return "on CUDA runs are not chunked"
        why = None
        for kind in ROW_GRAPH_FILES:
            path = self.spec.graph_path(kind)
            if not path.exists():
                why = f"{path.name} not in version {self.spec.version} (exported before the row-chunk graphs, or fp16)"
                break
            try:
                self._row_sessions[kind] = self._open(str(path), options, device)
            except Exception as err:  # onnxruntime's own exception types; runs go unchunked
                why = f"{path.name} did not load: {type(err).__name__}: {err}"
                break
            why = self._row_graph_mismatch(kind, path.name)
            if why is not None:
                break
        if why is not None:
            self._row_sessions.clear()
            logger.warning("%s: long fused runs are not split into row chunks (a cancel stops them only after "
                           "their attention node): %s", logged(self.spec.name), escaped(why))
        return why

    def _row_graph_mismatch(self, kind: str, file: str) -> str | None:
        """Why a row-chunk graph cannot serve this version (widths other than config.json's), or None:
        its sessions are checked here since check_servable sees only the regular graphs."""
        session = self._row_sessions[kind]
        spec = self.spec
        widths = {"query": spec.query_dim, "key": spec.kv_dim, "value": spec.kv_dim, "output": spec.out_dim}
        if spec.d_model is not None:
            widths |= dict.fromkeys(ROW_GRAPH_OUTPUTS[ROWS_KV], spec.d_model)
        got = {t.name: t.shape[-1] for t in (*session.get_inputs(), *session.get_outputs())}
        wanted = {name: widths[name] for name in got if name in widths}
        names = [t.name for t in session.get_inputs()] + [t.name for t in session.get_outputs()]
        expected = list(ROW_GRAPH_INPUTS[kind]) + list(ROW_GRAPH_OUTPUTS[kind])
        if names != expected or any(got[name] != width for name, width in wanted.items()):
            return f"{file} does not match config.json: tensors {names}, widths {got}; expected {expected}, {wanted}"
        return None

    def chunks_for(self, kind: str, q_len: int) -> str | None:
        """The row-chunk graph a run of graph `kind` and `q_len` query rows takes, or None: unchunked."""
        rows_kind = ROWS_OF.get(kind)
        return rows_kind if rows_kind in self._row_sessions and q_len > self.chunk_rows else None

    def graph_for(self, feeds: dict[str, np.ndarray], want_probs: bool) -> str:
        """The graph kind (contract.GRAPH_FILES) a run of these feeds takes."""
        return self.graphs.graph_for(masking_of(feeds), want_probs, feeds["query"].shape[1], feeds["key"].shape[1])

    @property
    def sessions(self) -> dict[str, ort.InferenceSession]:
        """Graph kind -> its session (the regular ones): what the registry checks before serving."""
        return dict(self._sessions)

    @property
    def has_solo_sessions(self) -> bool:
        return bool(self._solo_sessions)

    @property
    def writes_into(self) -> bool:
        """Whether `run(..., into=...)` has ONNX Runtime write there (else it copies there)."""
        return self._writes_into

    @property
    def solo_kinds(self) -> frozenset[str]:
        """The graph kinds that have a solo session (what server.warmup runs on both)."""
        return frozenset(self._solo_sessions)

    def run(self, feeds: dict[str, np.ndarray], want_probs: bool, solo: bool = False,
            into: dict[str, np.ndarray] | None = None, stop: RunStop | None = None
            ) -> tuple[np.ndarray, np.ndarray | None]:
        """feeds: query (B, Lq, q_dim), key/value (B, Lk, kv_dim), and at most one of mask
        (B, Lq, Lk) bool, key_padding_mask (B, Lk) int32 or head_mask (B, H, Lq, Lk) bool
        (server.tensors.merge). solo: on the spinning session, where there is one.
        into: "output" and/or "attn_probs" -> a C-contiguous float32 array of that output's
        shape, which the run writes into (I/O binding, no copy; server.tensors.compute_batch).
        stop: the run's off switch (server.tensors.RunStop): stopped, ONNX Runtime ends the run
        at its next node and this raises RunStopped.
        Returns output (B, Lq, out_dim) and attn_probs (B, H, Lq, Lk) or None."""
        kind = self.graph_for(feeds, want_probs)
        session = self._solo_sessions.get(kind) if solo else None
        self.solo_runs += session is not None
        options = None
        if stop is not None:
            options = ort.RunOptions()
            stop.on_stop(lambda: setattr(options, "terminate", True))
        rows_kind = None if session is not None else self.chunks_for(kind, feeds["query"].shape[1])
        try:
            graph_feeds = _graph_feeds(kind, feeds)
            if rows_kind is not None:
                outputs = self._run_rows(rows_kind, graph_feeds, into, options, stop)
            elif into and self._writes_into:
                outputs = self._run_into(session or self._sessions[kind], graph_feeds, into, options)
            else:
                outputs = self._run(session or self._sessions[kind], graph_feeds, options)
        except Exception as err:
            if stop is not None and stop.stopped:  # ONNX Runtime's own Fail: "terminate flag being set"
                raise RunStopped(f"stopped while it computed ({type(err).__name__})") from None
            raise
        finally:
            if stop is not None:
                stop.off()
            # Crowded (server.memory.heap, "Lean"), a large run's freed buffers go back to the system
            # now: sized by the batch's (B, H, Lq, Lk) matrix whichever graph ran, the run's scale.
            b, lq, _ = feeds["query"].shape
            heap.release_after(b * self.spec.num_heads * lq * feeds["key"].shape[1] * BYTES_PER_SCORE)
        self.runs[kind] += 1
        if into:  # what the run did not write into its destination (on CUDA) is copied there
            outputs = [_filled(into.get(name), array) for name, array in zip(GRAPH_OUTPUTS[kind], outputs, strict=True)]
        if len(outputs) == 2:  # all_outputs, head_mask_all_outputs
            output, attn_probs = outputs
            return output, (attn_probs if want_probs else None)
        return outputs[0], None

    def run_solo(self, feeds: dict[str, np.ndarray], want_probs: bool,
                 into: dict[str, np.ndarray] | None = None, stop: RunStop | None = None
                 ) -> tuple[np.ndarray, np.ndarray | None]:
        """`run` on the solo sessions (the batcher's run_solo)."""
        return self.run(feeds, want_probs, solo=True, into=into, stop=stop)

    def _run(self, session: ort.InferenceSession, feeds: dict[str, np.ndarray],
             options: ort.RunOptions | None = None) -> list[np.ndarray]:
        if not self._io_binding:
            return session.run(None, feeds, options)
        binding = session.io_binding()
        for name, array in feeds.items():
            binding.bind_cpu_input(name, array)
        for output in session.get_outputs():
            binding.bind_output(output.name, self._output_device)
        session.run_with_iobinding(binding, options)
        return binding.copy_outputs_to_cpu()

    def _run_rows(self, kind: str, feeds: dict[str, np.ndarray], into: dict[str, np.ndarray] | None,
                  options: ort.RunOptions | None, stop: RunStop | None) -> list[np.ndarray]:
        """A fused run in row chunks ("Row chunks"): key and value projected once (ROWS_KV), then
        each item's query rows a chunk at a time, each chunk's output written into the run's
        output (`into`'s, or a new array) at its rows. Stopped, it ends between two chunks (and
        inside one at its next node, as every run)."""
        kv_session, session = self._row_sessions[ROWS_KV], self._row_sessions[kind]
        query = np.ascontiguousarray(feeds["query"])  # (b, lq, query_dim)
        b, lq, _ = query.shape
        lk = feeds["key"].shape[1]
        d_model = kv_session.get_outputs()[0].shape[2]
        projected = {name: _aligned_empty((b, lk, d_model)) for name in ROW_GRAPH_OUTPUTS[ROWS_KV]}
        self._run_into(kv_session, {"key": feeds["key"], "value": feeds["value"]}, projected, options)
        output = (into or {}).get("output")
        if output is None:
            output = _aligned_empty((b, lq, session.get_outputs()[0].shape[2]))  # (b, lq, out_dim)
        item_feeds = {name: np.ascontiguousarray(feeds[name]) for name in ROW_GRAPH_INPUTS[kind] if name in feeds}
        item_feeds |= projected
        for i in range(b):
            for start, end in row_chunks(lq, self.chunk_rows):
                if stop is not None and stop.stopped:
                    raise RunStopped("stopped between row chunks")
                binding = session.io_binding()
                for name in ROW_GRAPH_INPUTS[kind]:
                    array = query[i:i + 1, start:end] if name == "query" else item_feeds[name][i:i + 1]
                    binding.bind_input(name, "cpu", 0, array.dtype, list(array.shape), array.ctypes.data)
                rows = output[i:i + 1, start:end]  # (1, rows, out_dim): contiguous in the output
                # ONNX Runtime's own buffers are aligned: a chunk whose rows are not is written beside, then copied.
                target = rows if rows.ctypes.data % INTO_ALIGNMENT == 0 else _aligned_empty(rows.shape)
                binding.bind_output("output", "cpu", 0, np.float32, list(target.shape), target.ctypes.data)
                session.run_with_iobinding(binding, options)
                if target is not rows:
                    np.copyto(rows, target)
                self.row_chunks_run += 1
        return [output]

    @staticmethod
    def _run_into(session: ort.InferenceSession, feeds: dict[str, np.ndarray],
                  into: dict[str, np.ndarray], options: ort.RunOptions | None = None) -> list[np.ndarray]:
        """A CPU run whose outputs named in `into` are bound to those arrays' memory: ONNX Runtime
        writes them there; the others it allocates, as session.run does."""
        binding = session.io_binding()
        for name, array in feeds.items():
            binding.bind_cpu_input(name, np.ascontiguousarray(array))
        for output in session.get_outputs():
            target = into.get(output.name)
            if target is None:
                binding.bind_output(output.name, "cpu")
            else:
                binding.bind_output(output.name, "cpu", 0, np.float32, list(target.shape), target.ctypes.data)
        session.run_with_iobinding(binding, options)
        return [into[o.name] if o.name in into else value.numpy()
                for o, value in zip(session.get_outputs(), binding.get_outputs(), strict=True)]


def _aligned_empty(shape: tuple[int, ...]) -> np.ndarray:
    """An uninitialised float32 array at an INTO_ALIGNMENT boundary, as ONNX Runtime aligns its own."""
    size = int(np.prod(shape))
    buffer = np.empty(size + INTO_ALIGNMENT // 4, np.float32)
    offset = (-buffer.ctypes.data % INTO_ALIGNMENT) // 4
    return buffer[offset:offset + size].reshape(shape)


def _filled(target: np.ndarray | None, array: np.ndarray) -> np.ndarray:
    """`array`, or `target` once `array` is copied into it (when the run did not write there)."""
    if target is None or target is array:
        return array
    np.copyto(target, array)
    return target


def _graph_feeds(kind: str, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The inputs graph `kind` takes, from the batcher's feeds: the unfused graphs want the
    (B, Lq, Lk) mask (made from a key padding mask, or all True), the key padding graph its mask,
    the head-mask graphs theirs (only a batch with a head mask takes them: server.graphs)."""
    wanted = GRAPH_INPUTS[kind]
    graph_feeds = {name: feeds[name] for name in REQUIRED_INPUTS}
    if HEAD_MASK in wanted:
        graph_feeds[HEAD_MASK] = feeds[HEAD_MASK]
    if "mask" in wanted:
        graph_feeds["mask"] = dense_mask(feeds)
    if KEY_PADDING_MASK in wanted:
        graph_feeds[KEY_PADDING_MASK] = feeds[KEY_PADDING_MASK] if KEY_PADDING_MASK in feeds else np.ones(
            (feeds["key"].shape[0], feeds["key"].shape[1]), np.int32)
    return graph_feeds
