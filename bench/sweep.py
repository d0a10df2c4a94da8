"""`python -m bench.sweep` (or `python -m bench --sweep`): time and memory against sequence length.

    .venv/bin/python -m bench.sweep                       # both presets, every side, table + JSON + PNG
    .venv/bin/python -m bench.sweep --models self_attention --lengths 1024,4096

One request of one sequence per configuration: self_attention (1, L, 512) over L keys for L = 16
... 8,192; cross_attention (1, Lq, 32) over 77 keys for Lq up to 8,192. Each configuration runs
in a fresh process, so one's memory cannot pollute another's figures:

    eager_seed   eager PyTorch, the seeds' formulation (the module: matmul, -1e10 fill, softmax)
    eager_sdpa   the module's projections around F.scaled_dot_product_attention
    ort_unfused  in-process ONNX Runtime, model_output_only.onnx (MatMul/Softmax)
    ort_fused    in-process ONNX Runtime, model_fused.onnx (ORT's MultiHeadAttention: flash on CPU)
    server       a fresh `attnserve serve` process, one ModelInfer call for `output` alone, raw
                 contents, from a client in another process that writes and reads the raw
                 tensors without protobuf's copies (attnserve.proto.wire) and keeps its large
                 blocks in its heap between calls (keep_client_heap); the project's
                 InferenceClient on the same request is reported beside it

Time: the median of the runs after the first (at least 3, up to --budget-s); then, for issue #16's
ratio at self_attention (1, 4096, 512), the in-process fused run and the server alternated round by
round in one process (`pair`: the same load for both). Peak RSS increase:
the process's VmHWM (peak resident set, /proc) once one request of this size was built and
computed, less its VmRSS just before, with the peak reset (/proc/PID/clear_refs) after loading
the model and a small warm-up run; for the server, the server process's, with the request built
by the client. In-process ONNX Runtime runs with its own defaults (one thread per core, spinning),
as bench.inprocess does; the server with its own (spinning off).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
SIDES = ("eager_seed", "eager_sdpa", "ort_unfused", "ort_fused", "server")
# --shared-memory adds this side: the server with --allow-shared-memory, inputs and `output` in
# system shared memory regions (docs/shared-memory.md); the pair then times it too.
SHM_SIDE = "server_shm"
LENGTHS = {"self_attention": (16, 64, 256, 1024, 2048, 4096, 8192),
           "cross_attention": (16, 64, 256, 1024, 2048, 4096, 8192)}
CROSS_K_LEN = 77  # seed 002's keys
# The sides whose score matrices grow with Lq*Lk stop here by default: at 8,192 the unfused
# graph and the eager module hold 2 GiB per copy of self_attention's 8 x L x L scores, several
# copies at once, more than a shared development machine should give one benchmark.
QUADRATIC_SIDES = ("eager_seed", "ort_unfused")
DEFAULT_MAX_QUADRATIC_SCORES = 4096 * 4096
DONE_WHEN_L = 4096  # issue #16: the server vs the in-process fused run, self_attention (1, 4096, 512)


def shape_of(model: str, length: int) -> tuple[int, int, int]:
    """(batch, q_len, k_len) of the sweep's request at `length`."""
    return (1, length, CROSS_K_LEN) if model == "cross_attention" else (1, length, length)


# -- one configuration, in its own process ---------------------------------------------------------


def _status(pid: int | str, field: str) -> float:
    """VmRSS or VmHWM of a process, MB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no {field} in /proc/{pid}/status")


def _reset_peak(pid: int | str) -> None:
    """Start VmHWM afresh from the current RSS (Linux: 5 > /proc/PID/clear_refs)."""
    Path(f"/proc/{pid}/clear_refs").write_text("5")


# The client's large blocks (the serialized request, gRPC's copy of it, the answer) stay in its
# heap between calls, as a long-lived client sending tens of MB per call should keep them (see
# docs/performance.md, "The sequence-length sweep"): with glibc's defaults this client faulted in ~12,400 pages a
# (1, 4096, 512) call (its heap trimmed after each, the next call's blocks fresh), about 60 ms of
# the "server" column that were the client's own.
CLIENT_MMAP_THRESHOLD_BYTES = 64 << 20
CLIENT_TRIM_THRESHOLD_BYTES = 128 << 20


def keep_client_heap() -> None:
    """Set this (benchmark client) process's glibc thresholds to CLIENT_*; elsewhere nothing."""
    import ctypes
    import platform

    if platform.libc_ver()[0] != "glibc":
        return
    libc = ctypes.CDLL(None)
    libc.mallopt(-3, CLIENT_MMAP_THRESHOLD_BYTES)  # M_MMAP_THRESHOLD
    libc.mallopt(-1, CLIENT_TRIM_THRESHOLD_BYTES)  # M_TRIM_THRESHOLD


def _timed(call, budget_s: float) -> tuple[float, list[float]]:
    """Run `call` once (its peak is measured around this run), then time it: median of >= 3."""
    times = []
    started = time.perf_counter()
    while len(times) < 3 or (time.perf_counter() - started < budget_s and len(times) < 20):
        t0 = time.perf_counter()
        call()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1000, times


def _inputs(spec, shape, rng):
    import numpy as np

    b, lq, lk = shape
    return {"query": rng.standard_normal((b, lq, spec.query_dim), dtype=np.float32),
            "key": rng.standard_normal((b, lk, spec.kv_dim), dtype=np.float32),
            "value": rng.standard_normal((b, lk, spec.kv_dim), dtype=np.float32)}


def _measure_in_process(side: str, spec, shape: tuple[int, int, int], budget_s: float) -> dict:
    import numpy as np

    rng = np.random.default_rng(0)
    if side.startswith("eager"):
        import torch
        from attnserve.export.checkpoint import demo_module
        from attnserve.export.config import AttentionConfig

        config_json = json.loads((spec.version_dir.parent / "config.json").read_text())
        config = AttentionConfig.from_dict(config_json["attention"])
        module = demo_module(config, seed=0).eval()
        forward = module if side == "eager_seed" else _sdpa(module)

        def make(shape):
            return {k: torch.from_numpy(v) for k, v in _inputs(spec, shape, rng).items()}

        def run(x):
            with torch.no_grad():
                return forward(x["query"], x["key"], x["value"])[0]
    else:
        import onnxruntime as ort

        from attnserve import contract

        kind = contract.OUTPUT_ONLY if side == "ort_unfused" else contract.FUSED
        session = ort.InferenceSession(str(spec.graph_path(kind)), providers=["CPUExecutionProvider"])

        def make(shape):
            x = _inputs(spec, shape, rng)
            if kind == contract.OUTPUT_ONLY:
                x["mask"] = np.ones(shape, np.bool_)  # what the engine feeds the unfused graph without a mask
            return x

        def run(x):
            return session.run(None, x)[0]

    run(make((1, 16, 16)))  # warm-up: libraries and the model's first allocations
    _reset_peak("self")
    before = _status("self", "VmRSS")
    x = make(shape)
    run(x)  # the request's peak: its inputs, the run, its output
    peak = _status("self", "VmHWM") - before
    ms, times = _timed(lambda: run(x), budget_s)
    return {"ms": ms, "peak_rss_increase_mb": peak, "runs": len(times)}


def _sdpa(module):
    """The module's projections around torch's fused scaled_dot_product_attention (no mask)."""
    import torch.nn.functional as F

    def forward(query, key, value):
        q = module._split_heads(module.to_q(query))  # (b, h, lq, dh)
        k = module._split_heads(module.to_k(key))  # (b, h, lk, dh)
        v = module._split_heads(module.to_v(value))  # (b, h, lk, dh)
        return module.to_out(module._merge_heads(F.scaled_dot_product_attention(q, k, v))), None

    return forward


def _measure_server(repository: Path, model: str, spec, shape: tuple[int, int, int], budget_s: float,
                    server_args: list[str]) -> dict:
    """A fresh server; a lean client in this process that serializes each request's raw inputs
    and reads the answer's raw output without protobuf's copies (attnserve.proto.wire); then, for
    comparison, the project's InferenceClient (plain protobuf messages) on the same request."""
    import grpc
    import numpy as np
    from attnserve.client import InferenceClient

    from bench.__main__ import _Server

    def call(channel, x):
        return _raw_call(channel, model, x)

    keep_client_heap()
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory(prefix="attnserve-sweep-") as tmp:
        server = _Server(repository, server_args, Path(tmp))
        try:
            with grpc.insecure_channel(server.address, options=_CHANNEL_OPTIONS) as channel:
                infer = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer")  # bytes in, bytes out
                call(infer, _inputs(spec, (1, 16, 16), rng))  # warm-up
                x = _inputs(spec, shape, rng)
                _reset_peak(server.proc.pid)
                before = _status(server.proc.pid, "VmRSS")
                call(infer, x)
                peak = _status(server.proc.pid, "VmHWM") - before
                ms, times = _timed(lambda: call(infer, x), budget_s)
            with InferenceClient(server.address, timeout_s=600, max_message_bytes=256 << 20) as client:
                client_ms, _ = _timed(lambda: client.infer(model, x["query"], x["key"], x["value"]), budget_s / 2)
        finally:
            server.stop()
    return {"ms": ms, "peak_rss_increase_mb": peak, "runs": len(times), "attnserve_client_ms": client_ms}


_CHANNEL_OPTIONS = [("grpc.max_send_message_length", 256 << 20), ("grpc.max_receive_message_length", 256 << 20)]


def _raw_call(channel, model: str, x: dict):
    """One ModelInfer for `output` alone, raw contents written and read without protobuf's copies
    (attnserve.proto.wire); `channel` a bytes-in, bytes-out unary_unary callable."""
    import numpy as np
    from attnserve.proto import inference_pb2 as pb
    from attnserve.proto import wire

    message = pb.ModelInferRequest(model_name=model)
    for name, array in x.items():
        message.inputs.add(name=name, datatype="FP32", shape=array.shape)
    message.outputs.add(name="output")
    data = wire.serialize_with_raw(message, "raw_input_contents", list(x.values()))
    answer = channel(data, timeout=600)
    response, raw = wire.parse_with_raw(pb.ModelInferResponse, answer, "raw_output_contents")
    return np.frombuffer(raw[0], dtype="<f4").reshape(tuple(response.outputs[0].shape))


class _ShmCall:
    """ModelInfer for `output` alone with the inputs in one region (written once, as data that
    lives in shared memory) and the output written by the server into another; the message
    carries names and shapes only. `output()` is a view of the output region (no copy)."""

    def __init__(self, channel, model: str, x: dict, out_dim: int) -> None:
        from multiprocessing import shared_memory

        import numpy as np
        from attnserve.proto import inference_pb2 as pb
        from attnserve.proto import inference_pb2_grpc as pb_grpc

        self._stub = pb_grpc.GRPCInferenceServiceStub(channel)
        b, lq, _ = x["query"].shape
        self.out_shape = (b, lq, out_dim)
        in_bytes, out_bytes = sum(a.nbytes for a in x.values()), b * lq * out_dim * 4
        self._in = shared_memory.SharedMemory(create=True, size=in_bytes)
        self._out = shared_memory.SharedMemory(create=True, size=out_bytes)
        message = pb.ModelInferRequest(model_name=model)
        offset = 0
        for name, array in x.items():
            np.frombuffer(self._in.buf, dtype="<f4", count=array.size, offset=offset)[:] = array.ravel()
            tensor = message.inputs.add(name=name, datatype="FP32", shape=array.shape)
            tensor.parameters["shared_memory_region"].string_param = "sweep-in"
            tensor.parameters["shared_memory_offset"].int64_param = offset
            tensor.parameters["shared_memory_byte_size"].int64_param = array.nbytes
            offset += array.nbytes
        output = message.outputs.add(name="output")
        output.parameters["shared_memory_region"].string_param = "sweep-out"
        output.parameters["shared_memory_byte_size"].int64_param = out_bytes
        for name, region in (("sweep-in", self._in), ("sweep-out", self._out)):
            self._stub.SystemSharedMemoryRegister(pb.SystemSharedMemoryRegisterRequest(
                name=name, key="/" + region.name.lstrip("/"), byte_size=region.size))
        self._message = message

    def __call__(self, infer=None):
        import numpy as np

        self._stub.ModelInfer(self._message, timeout=600)
        return np.frombuffer(self._out.buf, dtype="<f4").reshape(self.out_shape)

    def close(self) -> None:
        from attnserve.proto import inference_pb2 as pb

        self._stub.SystemSharedMemoryUnregister(pb.SystemSharedMemoryUnregisterRequest())
        for region in (self._in, self._out):
            region.close()
            region.unlink()


def _measure_server_shm(repository: Path, model: str, spec, shape: tuple[int, int, int], budget_s: float,
                        server_args: list[str]) -> dict:
    """A fresh server with --allow-shared-memory, the request through regions (_ShmCall). Region
    pages the server touched (shared, resident in both processes) are reported beside its peak
    RSS increase as shm_resident_mb: none since it reads and writes regions through their
    descriptors (docs/shared-memory.md), whose staging buffers its peak counts instead."""
    import grpc
    import numpy as np

    from bench.__main__ import _Server

    keep_client_heap()
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory(prefix="attnserve-sweep-") as tmp:
        server = _Server(repository, ["--allow-shared-memory", *server_args], Path(tmp))
        try:
            with grpc.insecure_channel(server.address, options=_CHANNEL_OPTIONS) as channel:
                warm = _ShmCall(channel, model, _inputs(spec, (1, 16, 16), rng), spec.out_dim)
                warm()
                warm.close()
                call = _ShmCall(channel, model, _inputs(spec, shape, rng), spec.out_dim)
                _reset_peak(server.proc.pid)
                before, shm_before = _status(server.proc.pid, "VmRSS"), _status(server.proc.pid, "RssShmem")
                call()
                peak = _status(server.proc.pid, "VmHWM") - before
                shm_resident = _status(server.proc.pid, "RssShmem") - shm_before
                ms, times = _timed(call, budget_s)
                call.close()
        finally:
            server.stop()
    return {"ms": ms, "peak_rss_increase_mb": peak, "shm_resident_mb": shm_resident, "runs": len(times)}


def _measure_pair(repository: Path, model: str, spec, shape: tuple[int, int, int], rounds: int,
                  server_args: list[str], shared_memory: bool = False) -> dict:
    """Time only, for the issue's ratio: in this process ONNX Runtime on model_fused.onnx with the
    server's own session options, and a fresh server's ModelInfer for the same request (the lean
    client above), alternating one of each per round, so that both see the same machine load
    (on a shared machine the load drifts between the sweep's separate processes). Medians, and
    the median of the per-round ratios server / in-process."""
    import grpc
    import numpy as np
    import onnxruntime as ort
    from attnserve.server.engine import session_options

    from attnserve import contract
    from bench.__main__ import _Server

    keep_client_heap()  # for the in-process runs as well: they share this process
    rng = np.random.default_rng(0)
    x = _inputs(spec, shape, rng)
    session = ort.InferenceSession(str(spec.graph_path(contract.FUSED)), sess_options=session_options(0),
                                   providers=["CPUExecutionProvider"])
    in_process, served = [], []
    with tempfile.TemporaryDirectory(prefix="attnserve-sweep-") as tmp:
        server = _Server(repository, (["--allow-shared-memory"] if shared_memory else []) + server_args, Path(tmp))
        try:
            with grpc.insecure_channel(server.address, options=_CHANNEL_OPTIONS) as channel:
                infer = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer")
                shm_call = _ShmCall(channel, model, x, spec.out_dim) if shared_memory else None
                serve = shm_call if shm_call is not None else (lambda: _raw_call(infer, model, x))
                session.run(None, x)  # the first of each: arenas grow, the connection opens
                serve()
                for _ in range(rounds):
                    t0 = time.perf_counter()
                    session.run(None, x)
                    t1 = time.perf_counter()
                    serve()
                    t2 = time.perf_counter()
                    in_process.append(t1 - t0)
                    served.append(t2 - t1)
                if shm_call is not None:
                    shm_call.close()
        finally:
            server.stop()
    return {"in_process_ms": statistics.median(in_process) * 1000, "server_ms": statistics.median(served) * 1000,
            "ratio": statistics.median(s / i for s, i in zip(served, in_process, strict=True)), "rounds": rounds,
            "load": os.getloadavg()[0], "shared_memory": shared_memory}


def _one(args: argparse.Namespace) -> int:
    """--one SIDE: measure one configuration in this (fresh) process, print one JSON line."""
    from attnserve.server.repository import read_model_spec

    spec = read_model_spec(args.repository / args.model)
    shape = (1, args.q_len, args.k_len)
    if args.one == "server":
        result = _measure_server(args.repository, args.model, spec, shape, args.budget_s, args.server_args)
    elif args.one == SHM_SIDE:
        result = _measure_server_shm(args.repository, args.model, spec, shape, args.budget_s, args.server_args)
    elif args.one == "pair":
        result = _measure_pair(args.repository, args.model, spec, shape, args.pair_rounds, args.server_args,
                               args.shared_memory)
    else:
        result = _measure_in_process(args.one, spec, shape, args.budget_s)
    print(json.dumps(result))
    return 0


# -- the sweep -------------------------------------------------------------------------------------


def _parse(argv: list[str] | None) -> argparse.Namespace:
    argv = list(sys.argv[1:] if argv is None else argv)
    server_args: list[str] = []
    if "--" in argv:
        split = argv.index("--")
        argv, server_args = argv[:split], argv[split + 1:]
    p = argparse.ArgumentParser(prog="python -m bench.sweep", description=__doc__.split("\n\n")[0])
    p.add_argument("--repository", type=Path, default=REPO_ROOT / "models")
    p.add_argument("--models", default="self_attention,cross_attention")
    p.add_argument("--sides", default=",".join(SIDES))
    p.add_argument("--lengths", help="comma-separated L (Lq for cross_attention); default 16 ... 8192")
    p.add_argument("--max-quadratic-scores", type=int, default=DEFAULT_MAX_QUADRATIC_SCORES,
                   help=f"skip {', '.join(QUADRATIC_SIDES)} where Lq*Lk is larger (default 4096^2)")
    p.add_argument("--budget-s", type=float, default=2.0, help="timing budget per configuration after its first run")
    p.add_argument("--output", type=Path, default=REPO_ROOT / "bench" / "results")
    p.add_argument("--pair-rounds", type=int, default=10,
                   help=f"rounds of the paired in-process fused / server timing at self_attention (1, {DONE_WHEN_L}, "
                        "512), after the sweep (0: none)")
    p.add_argument("--shared-memory", action="store_true",
                   help=f"add the {SHM_SIDE} side (the server through system shared memory regions) and time the "
                        "pair through them")
    p.add_argument("--one", choices=(*SIDES, SHM_SIDE, "pair"), help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    p.add_argument("--q-len", type=int, help=argparse.SUPPRESS)
    p.add_argument("--k-len", type=int, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.server_args = server_args
    return args


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    if args.one:
        return _one(args)
    models = [m for m in args.models.split(",") if m]
    sides = [s for s in args.sides.split(",") if s] + ([SHM_SIDE] if args.shared_memory else [])
    load_before = os.getloadavg()
    print(f"sweep: {os.cpu_count()} cores, load {load_before[0]:.2f}; one fresh process per configuration",
          flush=True)
    results: dict = {"cores": os.cpu_count(), "load_before": load_before, "server_args": args.server_args,
                     "models": {}}
    started = time.monotonic()
    for model in models:
        lengths = [int(x) for x in args.lengths.split(",")] if args.lengths else list(LENGTHS[model])
        rows = results["models"][model] = {}
        for length in lengths:
            b, lq, lk = shape_of(model, length)
            rows[length] = {"shape": [b, lq, lk]}
            for side in sides:
                if side in QUADRATIC_SIDES and lq * lk > args.max_quadratic_scores:
                    rows[length][side] = {"skipped": f"Lq*Lk > {args.max_quadratic_scores:,}"}
                    continue
                command = [sys.executable, "-m", "bench.sweep", "--one", side, "--model", model,
                           "--q-len", str(lq), "--k-len", str(lk), "--repository", str(args.repository),
                           "--budget-s", str(args.budget_s), "--", *args.server_args]
                done = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=900)
                if done.returncode != 0:
                    last = done.stderr.strip().splitlines()[-1:]
                    rows[length][side] = {"failed": last or [f"exit {done.returncode}"]}
                else:
                    rows[length][side] = json.loads(done.stdout.strip().splitlines()[-1])
                got = rows[length][side]
                figure = (f"{got['ms']:.2f} ms, +{got['peak_rss_increase_mb']:.0f} MB" if "ms" in got
                          else json.dumps(got))
                print(f"  {model} {b}x{lq}x{lk} {side}: {figure}", flush=True)
    self_lengths = [int(x) for x in args.lengths.split(",")] if args.lengths else LENGTHS["self_attention"]
    if args.pair_rounds and "self_attention" in models and DONE_WHEN_L in self_lengths:
        b, lq, lk = shape_of("self_attention", DONE_WHEN_L)
        command = [sys.executable, "-m", "bench.sweep", "--one", "pair", "--model", "self_attention",
                   "--q-len", str(lq), "--k-len", str(lk), "--repository", str(args.repository),
                   "--pair-rounds", str(args.pair_rounds), *(["--shared-memory"] if args.shared_memory else []),
                   "--", *args.server_args]
        done = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=900)
        results["pair"] = (json.loads(done.stdout.strip().splitlines()[-1]) if done.returncode == 0
                           else {"failed": done.stderr.strip().splitlines()[-1:] or [f"exit {done.returncode}"]})
        print(f"  self_attention {b}x{lq}x{lk} pair: {json.dumps(results['pair'])}", flush=True)
    results["seconds"] = round(time.monotonic() - started, 1)
    results["load_after"] = os.getloadavg()
    print_table(results)
    args.output.mkdir(parents=True, exist_ok=True)
    (args.output / "sweep.json").write_text(json.dumps(results, indent=2))
    plot(results, args.output / "sweep.png")
    print(f"wrote {args.output / 'sweep.json'} and {args.output / 'sweep.png'} ({results['seconds']:.0f} s)")
    return 0


def _cell(got: dict | None) -> str:
    if not got:
        return "-"
    if "ms" in got:
        return f"{_ms(got['ms'])} / {got['peak_rss_increase_mb']:.0f} MB"
    return "skipped" if "skipped" in got else "failed"


def _client_cell(got: dict | None) -> str:
    return _ms(got["attnserve_client_ms"]) if got and "attnserve_client_ms" in got else "-"


def _ms(ms: float) -> str:
    return f"{ms:,.0f} ms" if ms >= 100 else f"{ms:.3g} ms"


def print_table(results: dict) -> None:
    for model, rows in results["models"].items():
        sides = [s for s in (*SIDES, SHM_SIDE) if any(s in r for r in rows.values())]
        print(f"\n{model}: time per request / peak RSS increase")
        client = "server" in sides
        print("  " + f"{'shape':>14} " + " ".join(f"{s:>22}" for s in sides)
              + (f" {'InferenceClient':>16}" if client else ""))
        for row in rows.values():
            shape = "x".join(map(str, row["shape"]))
            print("  " + f"{shape:>14} " + " ".join(f"{_cell(row.get(s)):>22}" for s in sides)
                  + (f" {_client_cell(row.get('server')):>16}" if client else ""))
    rows = results["models"].get("self_attention", {})
    row = rows.get(DONE_WHEN_L) or rows.get(str(DONE_WHEN_L))
    if row and "ms" in row.get("server", {}) and "ms" in row.get("ort_fused", {}):
        t = row["server"]["ms"] / row["ort_fused"]["ms"]
        m = row["server"]["peak_rss_increase_mb"] / row["ort_fused"]["peak_rss_increase_mb"]
        print(f"\nissue #16, self_attention (1, {DONE_WHEN_L}, 512), output alone: server / in-process fused: "
              f"time {t:.2f} x (goal <= 1.3: {'met' if t <= 1.3 else 'NOT met'}), "
              f"peak RSS increase {m:.2f} x (goal <= 1.5: {'met' if m <= 1.5 else 'NOT met'})")
    shm = row.get(SHM_SIDE, {}) if row else {}
    if "ms" in shm and "ms" in row.get("ort_fused", {}):
        t = shm["ms"] / row["ort_fused"]["ms"]
        m = shm["peak_rss_increase_mb"] / row["ort_fused"]["peak_rss_increase_mb"]
        print(f"shared memory, self_attention (1, {DONE_WHEN_L}, 512), output alone: server / in-process fused: "
              f"time {t:.2f} x (goal <= 1.15), peak RSS increase {m:.2f} x (goal <= 1.3; "
              f"{shm.get('shm_resident_mb', 0):.0f} MB of it region pages)")
    pair = results.get("pair", {})
    if "ratio" in pair:
        t = pair["ratio"]
        print(f"  paired ({pair['rounds']} alternating rounds, in-process with the server's session options): "
              f"in-process {_ms(pair['in_process_ms'])}, server {_ms(pair['server_ms'])}, median ratio {t:.2f} x "
              f"(goal <= 1.3: {'met' if t <= 1.3 else 'NOT met'})")
    print(f"load average before {results['load_before'][0]:.2f}, after {results['load_after'][0]:.2f}")


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(results["models"])
    fig, axes = plt.subplots(2, len(models), figsize=(6.5 * len(models), 9), squeeze=False)
    for col, model in enumerate(models):
        rows = results["models"][model]
        for side in SIDES:
            points = [(int(length), row[side]) for length, row in rows.items() if "ms" in row.get(side, {})]
            if not points:
                continue
            xs = [x for x, _ in points]
            axes[0][col].plot(xs, [g["ms"] for _, g in points], "o-", label=side)
            axes[1][col].plot(xs, [max(g["peak_rss_increase_mb"], 0.1) for _, g in points], "o-", label=side)
        xlabel = "L (Lq = Lk)" if model != "cross_attention" else f"Lq (Lk = {CROSS_K_LEN})"
        axes[0][col].set(title=f"{model}: time per request", xlabel=xlabel, ylabel="ms", xscale="log", yscale="log")
        axes[1][col].set(title=f"{model}: peak RSS increase", xlabel=xlabel, ylabel="MB", xscale="log", yscale="log")
        for ax in axes[:, col]:
            ax.grid(True, which="both", alpha=0.3)
            ax.legend()
    fig.suptitle(f"attnserve: sequence-length sweep, one sequence per request ({results['cores']} cores)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
