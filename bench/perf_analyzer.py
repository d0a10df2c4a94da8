"""Driving the server with NVIDIA's perf_analyzer, unmodified, and reading its CSV.

`make bench-tools` installs it: the binary ships in tritonclient 2.45's manylinux wheel (later
releases moved it to a `perf-analyzer` wheel that needs glibc 2.38); it links libcudart.so.12
(pip package nvidia-cuda-runtime-cu12; no GPU is needed) and libb64 (Debian's libb64-0d).
"""

from __future__ import annotations

import csv
import glob
import os
import shutil
import subprocess
from pathlib import Path

from bench.inprocess import Shape

REPO_ROOT = Path(__file__).resolve().parent.parent
BENCH_VENV = REPO_ROOT / ".venv-bench"


def find() -> tuple[Path, dict[str, str]] | None:
    """The perf_analyzer binary and the environment it runs in, or None if not installed."""
    binary = BENCH_VENV / "bin" / "perf_analyzer"
    if not binary.exists():
        found = shutil.which("perf_analyzer")
        if found is None:
            return None
        binary = Path(found)
    libs = glob.glob(str(BENCH_VENV / "lib" / "python3*" / "site-packages" / "nvidia" / "cuda_runtime" / "lib"))
    env = dict(os.environ)
    if libs:
        env["LD_LIBRARY_PATH"] = os.pathsep.join(libs + [env.get("LD_LIBRARY_PATH", "")]).rstrip(os.pathsep)
    probe = subprocess.run([str(binary), "--version"], env=env, capture_output=True, text=True)
    if probe.returncode != 0:
        return None
    return binary, env


def shape_args(spec_dims: tuple[int, int], shape: Shape, triton_batching: bool = False) -> list[str]:
    """perf_analyzer's --shape flags for one request (and -b where Triton's batcher owns the
    batch dim: then the shapes leave it out)."""
    q_dim, kv_dim = spec_dims
    lead = () if triton_batching else (shape.batch,)
    args = ["-b", str(shape.batch)] if triton_batching else []
    for name, dims in (("query", (shape.q_len, q_dim)), ("key", (shape.k_len, kv_dim)),
                       ("value", (shape.k_len, kv_dim)), ("mask", (shape.q_len, shape.k_len))):
        args += ["--shape", f"{name}:{','.join(str(d) for d in (*lead, *dims))}"]
    return args


def run(binary: Path, env: dict[str, str], address: str, model: str, spec_dims: tuple[int, int], shape: Shape,
        concurrency: int, seconds: float, workdir: Path, version: int, streaming: bool = False,
        protocol: str = "grpc", triton_batching: bool = False) -> dict[str, float]:
    """One concurrency level; returns requests/s and p50/p90/p99 latency in ms. `streaming`:
    requests as messages of ModelStreamInfer streams (perf_analyzer's --streaming) instead of
    one ModelInfer call each. protocol "http": the REST port at `address` (perf_analyzer -i http,
    binary tensor data), one POST .../infer per request. triton_batching: the model's config has
    max_batch_size > 0 (PyTriton's): shapes without the batch dim, the batch as `-b`."""
    report = workdir / f"pa-{model}-c{concurrency}-{protocol}{'-stream' if streaming else ''}.csv"
    args = [
        # The version named: with it perf_analyzer reads the model's statistics by name and
        # version rather than waiting for a version to show up in them.
        str(binary), "-m", model, "-x", str(version), "-i", protocol, "-u", address,
        *(["--streaming"] if streaming else []),
        *shape_args(spec_dims, shape, triton_batching),
        # Zeros: perf_analyzer's random data fills a BOOL with random bytes, which the server
        # refuses (a BOOL byte is 0 or 1); zeros cost ONNX Runtime the same (every key masked).
        "--input-data", "zero",
        "--concurrency-range", f"{concurrency}:{concurrency}",
        "--measurement-interval", str(int(seconds * 1000)),
        "--stability-percentage", "50", "--max-trials", "10",  # a shared 2-core machine is noisy
        "-f", str(report),
    ]
    done = subprocess.run(args, env=env, capture_output=True, text=True, timeout=seconds * 12 + 60)
    if done.returncode != 0 or not report.exists():
        raise RuntimeError(f"perf_analyzer failed ({done.returncode}): {done.stdout[-2000:]} {done.stderr[-2000:]}")
    with open(report, newline="") as f:
        row = next(csv.DictReader(f))
    return {
        # Inferences are rows times requests where perf_analyzer sends a batch (-b).
        "requests_per_s": float(row["Inferences/Second"]) / (shape.batch if triton_batching else 1),
        "p50_ms": float(row["p50 latency"]) / 1000,
        "p90_ms": float(row["p90 latency"]) / 1000,
        "p99_ms": float(row["p99 latency"]) / 1000,
    }
