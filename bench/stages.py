"""`python -m bench.stages`: where a native-plane request's time goes, stage by stage.

    .venv/bin/python -m bench.stages                                   # both models, c=1 and c=32, CPU
    .venv/bin/python -m bench.stages --device cuda --batches-in-flight 1,2

For each model, --batches-in-flight value and concurrency: a fresh `attnserve serve --data-plane
native` on --device, perf_analyzer (bench.loadgen where it cannot run) for one window, then the
plane's own counters, which it logs when it stops (server.native, "native data plane stopped"):
per request, the time in each stage of the native path, each summed over the requests' batches:

    check    parsing and the tensor contract, on gRPC's thread
    queue    arrival to the start of its batch's merge (the runner's wake included)
    merge    the batch's padded inputs, on the runner thread
    python   the runner's Python: the feeds, ONNX Runtime's run, until the answers start
    split    the batch's outputs copied into the answers
    finish   gRPC's Finish on the runner thread (it may send the answer there)

The runner thread's share of a batch is merge + python + split + finish; at c=32 a runner that
takes all of the wall time is the server's limit. JSON to --output/stages-<device>.json.
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
import tempfile
import time
from pathlib import Path

from attnserve.server.repository import read_model_spec

from bench import loadgen, perf_analyzer
from bench.__main__ import machine
from bench.goals import REPO_ROOT, Process, _server_command
from bench.inprocess import SHAPES

STAGES = ("check", "queue", "merge", "python", "split", "finish")
RUNNER_STAGES = ("merge", "python", "split", "finish")
STOPPED = "native data plane stopped: "


def counters_from_log(text: str) -> dict[str, int]:
    """The plane's counters from the last "native data plane stopped" line of a server log."""
    lines = [line for line in text.splitlines() if STOPPED in line]
    if not lines:
        raise RuntimeError("the server logged no counters when it stopped")
    return ast.literal_eval(lines[-1].split(STOPPED, 1)[1].strip())


def per_request(counters: dict[str, int], wall_s: float) -> dict[str, float]:
    """Microseconds per request in each stage, requests and rows per batch, and the runner
    threads' busy share of the window."""
    requests, batches = max(counters["requests"], 1), max(counters["batches"], 1)
    got = {f"{stage}_us": counters[f"{stage}_ns"] / requests / 1000 for stage in STAGES}
    runner_ns = sum(counters[f"{stage}_ns"] for stage in RUNNER_STAGES)
    got |= {"requests": counters["requests"], "requests_per_batch": counters["requests"] / batches,
            "rows_per_batch": counters["rows"] / batches, "runner_us_per_batch": runner_ns / batches / 1000,
            "runner_busy": runner_ns / 1e9 / wall_s if wall_s > 0 else float("nan")}
    return got


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.stages", description=__doc__.split("\n\n")[0])
    p.add_argument("--repository", type=Path, default=REPO_ROOT / "models")
    p.add_argument("--models", default="self_attention,cross_attention")
    p.add_argument("--levels", default="1,32", help="concurrency levels")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--batches-in-flight", default="1", help="values of the server's --batches-in-flight")
    p.add_argument("--seconds", type=float, default=2.0, help="perf_analyzer's measurement window")
    p.add_argument("--load-generator", choices=("auto", "python"), default="auto",
                   help="python: bench.loadgen even where perf_analyzer runs")
    p.add_argument("--output", type=Path, default=REPO_ROOT / "bench" / "results")
    args = p.parse_args(argv)
    from attnserve.server.native import why_unavailable

    why = why_unavailable()
    if why is not None:
        raise SystemExit(f"bench.stages: the native plane is not built: {why}")
    found = perf_analyzer.find() if args.load_generator == "auto" else None
    host = machine()
    print(f"bench.stages: {host['cpu_model']}, {host['cores']} cores; device {args.device}; "
          f"{'perf_analyzer' if found else 'bench.loadgen'}", flush=True)
    rows = []
    workdir = Path(tempfile.mkdtemp(prefix="bench-stages-"))
    header = (f"{'model':15s} {'bif':>3} {'c':>3} {'req/s':>8} {'p50 ms':>7} {'req/batch':>9} "
              + " ".join(f"{s + ' us':>9}" for s in STAGES) + f" {'runner busy':>11}")
    print(header, flush=True)
    for model in [m for m in args.models.split(",") if m]:
        spec, shape = read_model_spec(args.repository / model), SHAPES[model]
        for bif in [int(x) for x in args.batches_in_flight.split(",")]:
            for c in [int(x) for x in args.levels.split(",")]:
                name = f"native-{model}-{bif}-{c}"
                command = _server_command("attnserve.server", args.repository, "--data-plane", "native", "--device",
                                          args.device, "--batches-in-flight", str(bif))
                command[command.index("--log-level") + 1] = "INFO"
                proc = Process(name, command, workdir, "grpc_port")
                try:
                    started = time.monotonic()
                    if found is not None:
                        got = perf_analyzer.run(*found, proc.address, model, (spec.query_dim, spec.kv_dim), shape, c,
                                                args.seconds, workdir, spec.version)
                    else:
                        got = loadgen.run(proc.address, model, (spec.query_dim, spec.kv_dim), shape, c, args.seconds)
                    wall = time.monotonic() - started
                finally:
                    proc.stop()
                figures = {"model": model, "batches_in_flight": bif, "concurrency": c, **got,
                           **per_request(counters_from_log(proc.log_path.read_text(errors="replace")), wall)}
                rows.append(figures)
                print(f"{model:15s} {bif:3d} {c:3d} {figures['requests_per_s']:8.0f} {figures['p50_ms']:7.3f} "
                      f"{figures['requests_per_batch']:9.1f} "
                      + " ".join(f"{figures[s + '_us']:9.1f}" for s in STAGES)
                      + f" {figures['runner_busy']:11.2f}", flush=True)
    args.output.mkdir(parents=True, exist_ok=True)
    out = args.output / f"stages-{args.device}.json"
    out.write_text(json.dumps({"machine": host, "device": args.device, "rows": rows}, indent=1))
    print(f"written {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
