"""The scaling table: throughput at concurrency 32 for 1, 2, ... worker processes (--workers).

    python -m bench.scaling --repository models [--workers 1,2] [--connections 32] [--seconds 4]

For each worker count a fresh `attnserve serve --workers N`, driven by this module's own load
generator: LOADGEN_PROCESSES processes, the `concurrency` calls in flight spread over
`connections` gRPC channels (each its own TCP connection; a channel's calls all reach one
worker, so the connections are what the kernel spreads, SO_REUSEPORT), then perf_analyzer
(`make bench-tools`) on gRPC and REST at the same concurrency. Printed per row: requests/s,
p50, the CPUs the server kept busy (supervisor and workers) and the load generator's own (it
shares the machine): CPU seconds per second of the row's whole run (perf_analyzer repeats its
window until stable, so its rows run longer than --seconds), and the balance: requests each
worker answered (from its statistics file, server.shared_stats). Results in
bench/results/scaling.json (the CPU seconds and the row's wall time too).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from bench import loadgen
from bench.inprocess import SHAPES, Shape

REPO_ROOT = Path(__file__).resolve().parent.parent
LOADGEN_PROCESSES = 4


def _load(address: str, model: str, dims: tuple[int, int], shape: Shape, in_flight: int, channels: int,
          seconds: float, queue: multiprocessing.Queue) -> None:
    import grpc
    from attnserve.proto import inference_pb2_grpc as pb_grpc

    request = loadgen.grpc_request(model, dims, shape, np.random.default_rng(0))
    options = [*loadgen.CHANNEL_OPTIONS, ("grpc.use_local_subchannel_pool", 1)]  # each channel its own connection

    async def main() -> tuple[list[float], int]:
        chans = [grpc.aio.insecure_channel(address, options=options) for _ in range(channels)]
        stubs = [pb_grpc.GRPCInferenceServiceStub(c) for c in chans]
        await asyncio.gather(*(s.ModelInfer(request) for s in stubs))  # connect and warm every one
        got = await loadgen.closed_loops([loadgen.grpc_send(stubs[i % channels], request) for i in range(in_flight)],
                                         seconds, (grpc.aio.AioRpcError,))
        for c in chans:
            await c.close()
        return got

    queue.put(asyncio.run(main()))


def drive(address: str, model: str, dims: tuple[int, int], shape: Shape, concurrency: int, connections: int,
          seconds: float) -> dict:
    """Requests/s, p50 and the generator's CPU seconds, `concurrency` calls over `connections`."""
    processes = min(LOADGEN_PROCESSES, connections)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    latencies, errors, _ = loadgen.fan_out(
        _load, [(address, model, dims, shape, calls, conns, seconds) for calls, conns in
                zip(loadgen.shares(concurrency, processes), loadgen.shares(connections, processes), strict=True)],
        seconds)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    stats = loadgen.summary(latencies, errors, seconds)
    return {"requests_per_s": stats["requests_per_s"], "p50_ms": stats["p50_ms"], "errors": errors,
            "loadgen_cpu_s": cpu}


def cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Served:
    """A fresh `attnserve serve --workers N` on 127.0.0.1."""

    def __init__(self, repository: Path, workers: int, workdir: Path, extra: list[str]) -> None:
        self.ready_file = workdir / f"ready-{workers}.json"
        self.log = open(workdir / f"serve-{workers}.log", "wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "attnserve", "serve", "--model-repository", str(repository), "--host", "127.0.0.1",
             "--port", "0", "--http-port", "0", "--metrics-port", "-1", "--log-level", "WARNING",
             "--drain-delay-s", "0", "--workers", str(workers), "--ready-file", str(self.ready_file), *extra],
            cwd=REPO_ROOT, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 120
        while not self.ready_file.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"bench.scaling: the server did not start; see {self.log.name}")
            time.sleep(0.05)
        info = json.loads(self.ready_file.read_text())
        self.port = info["grpc_port"]
        self.address = f"127.0.0.1:{self.port}"
        self.http_address = f"127.0.0.1:{info['http_port']}"
        self.pids = [self.proc.pid] + (info.get("workers") or [])
        self.workers_dir = info.get("workers_dir")

    def cpu_s(self) -> float:
        return sum(cpu_s(p) for p in dict.fromkeys(self.pids))

    def requests_per_worker(self, model: str) -> list[int]:
        if not self.workers_dir:
            return []
        from attnserve.server.shared_stats import gather_by_pid

        per_pid = gather_by_pid(Path(self.workers_dir))
        return [int(per_pid[p][model].success.count) if p in per_pid and model in per_pid[p] else 0
                for p in self.pids[1:]]

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=120)
        self.log.close()


def _perf_analyzer(found, server: Served, protocol: str, model: str, dims, shape: Shape, concurrency: int,
                   seconds: float, workdir: Path, version: int) -> dict:
    """perf_analyzer at `concurrency` on gRPC or REST; its CPU seconds from the rusage of children."""
    from bench import perf_analyzer

    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    got = perf_analyzer.run(*found, server.http_address if protocol == "http" else server.address, model, dims,
                            shape, concurrency, seconds, workdir, version, protocol=protocol)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    # Its measurement windows repeat until stable: CPU per second of its whole run, not of `seconds`.
    got["loadgen_cpu_s"] = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return got


def measure(repository: Path, workers: list[int], concurrency: int, connections: list[int], seconds: float,
            model: str, extra: list[str], use_perf_analyzer: bool = True) -> list[dict]:
    from attnserve.server.repository import read_model_spec

    from bench import perf_analyzer

    found = perf_analyzer.find() if use_perf_analyzer else None

    spec = read_model_spec(repository / model)
    dims, shape = (spec.query_dim, spec.kv_dim), SHAPES[model]
    rows = []
    with tempfile.TemporaryDirectory(prefix="attnserve-scaling-") as tmp:
        for n in workers:
            server = Served(repository, n, Path(tmp), extra)
            try:
                runs = [(f"ours, {c} conn.",
                         lambda c=c, server=server: drive(server.address, model, dims, shape, concurrency, c,
                                                          seconds)) for c in connections]
                if found is not None:
                    runs += [(f"perf_analyzer {protocol}", lambda protocol=protocol, server=server: _perf_analyzer(
                        found, server, protocol, model, dims, shape, concurrency, seconds, Path(tmp), spec.version))
                        for protocol in ("grpc", "http")]
                warm = min(4, max(connections))
                drive(server.address, model, dims, shape, warm, warm, 0.5)  # warm-up
                for generator, run in runs:
                    base_cpu, base_requests = server.cpu_s(), server.requests_per_worker(model)
                    started = time.monotonic()
                    got = run()
                    got["wall_s"] = time.monotonic() - started
                    got["server_cpu_s"] = server.cpu_s() - base_cpu
                    got["server_cpus"] = got["server_cpu_s"] / got["wall_s"]
                    got["loadgen_cpus"] = got["loadgen_cpu_s"] / got["wall_s"]
                    got.update(workers=n, generator=generator)
                    got["requests_per_worker"] = [a - b for a, b in zip(server.requests_per_worker(model),
                                                                        base_requests, strict=True)]
                    rows.append(got)
                    _print_row(got, seconds)
            finally:
                server.stop()
    return rows


def _print_row(r: dict, seconds: float) -> None:
    balance = "/".join(str(x) for x in r["requests_per_worker"]) or "-"
    print(f"| {r['workers']:>7} | {r['generator']:<20} | {r['requests_per_s']:>10.0f} | {r['p50_ms']:>6.2f} | "
          f"{r['server_cpus']:>11.2f} | {r['loadgen_cpus']:>12.2f} | {balance} |", flush=True)


HEADER = ("| workers | load generator       | requests/s | p50 ms | server CPUs | loadgen CPUs "
          "| requests per worker |\n"
          "|--------:|----------------------|-----------:|-------:|------------:|-------------:|---------------------|")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.scaling", description=__doc__.split("\n\n")[0])
    p.add_argument("--repository", type=Path, default=REPO_ROOT / "models")
    p.add_argument("--model", default="self_attention")
    p.add_argument("--workers", default="", help="worker counts (default: 1..the CPUs this process may use)")
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--connections", default="32", help="connections to try per worker count, e.g. 1,32")
    p.add_argument("--seconds", type=float, default=4.0)
    p.add_argument("--no-perf-analyzer", action="store_true", help="our load generator only")
    p.add_argument("--output", type=Path, default=REPO_ROOT / "bench" / "results")
    args, extra = p.parse_known_args(argv)
    from attnserve.server.workers import available_cpus

    cpus = available_cpus()
    workers = [int(w) for w in args.workers.split(",") if w] or list(range(1, cpus + 1))
    load = os.getloadavg()
    print(f"bench.scaling: {platform.node()}, {cpus} CPUs, load {load[0]:.2f}; {args.model}, concurrency "
          f"{args.concurrency}, {LOADGEN_PROCESSES} load generator processes; CPU columns: CPU seconds per second of "
          "each row's run", flush=True)
    print(HEADER, flush=True)
    rows = measure(args.repository, workers, args.concurrency, [int(c) for c in args.connections.split(",")],
                   args.seconds, args.model, extra, use_perf_analyzer=not args.no_perf_analyzer)
    args.output.mkdir(parents=True, exist_ok=True)
    (args.output / "scaling.json").write_text(json.dumps({"cpus": cpus, "load_before": load, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
