"""`python -m bench.native_compare`: the native data plane's go/no-go measurement (issue 26).

Three processes, measured in alternating rounds (A/B/C/A/B/C) with perf_analyzer (or
bench.loadgen where it cannot run), one ModelInfer call per request:
    python  `attnserve serve`, today's server (its Python gRPC port);
    native  `attnserve serve --data-plane native`, the prototype (its gRPC port, the native plane);
    floor   `python -m bench.native_floor`, a C++ gRPC server answering zeros.
At each concurrency: requests/s, p50 and the CPU milliseconds the serving process spent per
request. Then the verdict as the issue states it: go if native's c=32 throughput is at least 2x
python's and its c=1 p50 at most half python's. The prototype's own counters (where its time
goes) are read from its log at stop. JSON to --output/native-compare.json.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from attnserve.server.repository import read_model_spec

from bench import loadgen, perf_analyzer
from bench.__main__ import _cpu_s, machine
from bench.inprocess import SHAPES

REPO_ROOT = Path(__file__).resolve().parent.parent


class _Process:
    def __init__(self, name: str, module: str, args: list[str], repository: Path, workdir: Path, port_key: str) -> None:
        self.name = name
        ready = workdir / f"ready-{name}.json"
        self.log_path = workdir / f"{name}.log"
        self.log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", module, "--model-repository", str(repository), "--host", "127.0.0.1",
             "--port", "0", "--http-port", "-1", "--metrics-port", "-1", "--ready-file", str(ready),
             "--drain-delay-s", "0", "--workers", "1", *args],
            cwd=REPO_ROOT, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 120
        while not ready.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"bench.native_compare: {name} did not start; see {self.log_path}")
            time.sleep(0.05)
        self.address = f"127.0.0.1:{json.loads(ready.read_text())[port_key]}"

    def stop(self) -> str:
        self.proc.terminate()
        self.proc.wait(timeout=60)
        self.log.close()
        return self.log_path.read_text(errors="replace")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.native_compare", description=__doc__.split("\n\n")[0])
    p.add_argument("--repository", type=Path, default=REPO_ROOT / "models")
    p.add_argument("--model", default="self_attention")
    p.add_argument("--concurrency", default="1,32")
    p.add_argument("--seconds", type=float, default=2.0, help="measurement window per level")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--sides", default="python,native,floor")
    p.add_argument("--output", type=Path, default=REPO_ROOT / "bench" / "results")
    args = p.parse_args(argv)
    spec = read_model_spec(args.repository / args.model)
    shape = SHAPES[args.model]
    found = perf_analyzer.find()
    workdir = Path(tempfile.mkdtemp(prefix="native-compare-"))
    sides = {
        "python": ("attnserve.server", ["--data-plane", "python"], "grpc_port"),
        "native": ("attnserve.server", ["--data-plane", "native"], "grpc_port"),
        "floor": ("bench.native_floor", ["--data-plane", "native"], "grpc_port"),
    }
    chosen = args.sides.split(",")
    procs = {name: _Process(name, *sides[name][:2], args.repository, workdir, sides[name][2]) for name in chosen}
    levels = [int(c) for c in args.concurrency.split(",")]
    load_before = open("/proc/loadavg").read().split()[:3]
    results: dict[str, dict[int, list[dict]]] = {name: {c: [] for c in levels} for name in chosen}
    try:
        for round_ in range(args.rounds):
            for name in chosen:
                proc = procs[name]
                for c in levels:
                    cpu0, t0 = _cpu_s(proc.proc.pid), time.monotonic()
                    if found is not None:
                        binary, env = found
                        got = perf_analyzer.run(binary, env, proc.address, args.model, (spec.query_dim, spec.kv_dim),
                                                shape, c, args.seconds, workdir, spec.version)
                    else:
                        got = loadgen.run(proc.address, args.model, (spec.query_dim, spec.kv_dim), shape, c,
                                          args.seconds)
                    cpu_share = (_cpu_s(proc.proc.pid) - cpu0) / (time.monotonic() - t0)
                    got["cpu_ms_per_req"] = 1000 * cpu_share / got["requests_per_s"]
                    got["load"] = open("/proc/loadavg").read().split()[0]
                    results[name][c].append(got)
                    print(f"round {round_ + 1} {name:6s} c={c:<3d} {got['requests_per_s']:8.0f} req/s  p50 "
                          f"{got['p50_ms']:.3f} ms  CPU {got['cpu_ms_per_req']:.3f} ms/req  load {got['load']}",
                          flush=True)
    finally:
        logs = {name: proc.stop() for name, proc in procs.items()}
    counters = None
    if "native" in logs:
        found_counters = re.findall(r"native data plane stopped: (\{.*\})", logs["native"])
        counters = json.loads(found_counters[-1].replace("'", '"')) if found_counters else None

    def median(name: str, c: int, field: str) -> float:
        return statistics.median(r[field] for r in results[name][c])

    print(f"\n{args.model} {shape}, {args.rounds} rounds, {'perf_analyzer' if found else 'bench.loadgen'}; "
          f"load before {' '.join(load_before)}, after {' '.join(open('/proc/loadavg').read().split()[:3])}")
    print(f"{'side':8s} " + " ".join(f"c={c} req/s  c={c} p50 ms  c={c} CPU ms/req" for c in levels))
    for name in chosen:
        print(f"{name:8s} " + " ".join(f"{median(name, c, 'requests_per_s'):9.0f} {median(name, c, 'p50_ms'):11.3f} "
                                       f"{median(name, c, 'cpu_ms_per_req'):16.3f}" for c in levels))
    verdict = None
    if {"python", "native"} <= set(chosen) and {1, 32} <= set(levels):
        throughput = median("native", 32, "requests_per_s") / median("python", 32, "requests_per_s")
        latency = median("native", 1, "p50_ms") / median("python", 1, "p50_ms")
        verdict = {"c32_throughput_ratio": throughput, "c1_p50_ratio": latency,
                   "go": throughput >= 2.0 and latency <= 0.5}
        print(f"native / python: c=32 throughput {throughput:.2f}x (go needs >= 2), c=1 p50 {latency:.2f}x "
              f"(go needs <= 0.5): {'GO' if verdict['go'] else 'NO GO'}")
    if counters:
        batches = max(counters["batches"], 1)
        print("prototype's counters over the whole run: "
              f"{counters['requests']} requests in {counters['batches']} batches ({counters['rows'] / batches:.1f} "
              f"rows each); per request: check {counters['check_ns'] / max(counters['requests'], 1) / 1e3:.1f} us, "
              f"queue wait {counters['queue_ns'] / max(counters['requests'], 1) / 1e3:.1f} us; per batch: merge "
              f"{counters['merge_ns'] / batches / 1e3:.1f} us, Python (feeds, ONNX Runtime, hand back) "
              f"{counters['python_ns'] / batches / 1e3:.1f} us, "
              f"split+encode {counters['split_ns'] / batches / 1e3:.1f} us, "
              f"gRPC's Finish {counters.get('finish_ns', 0) / batches / 1e3:.1f} us")
    args.output.mkdir(parents=True, exist_ok=True)
    out = args.output / "native-compare.json"
    out.write_text(json.dumps({"machine": machine(), "model": args.model,
                               "shape": vars(shape) if hasattr(shape, "__dict__")
                               else str(shape), "results": results, "verdict": verdict, "counters": counters,
                               "load_before": load_before}, indent=1, default=str))
    print(f"written {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
