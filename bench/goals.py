"""`python -m bench.goals`: issue 26's benchmark, its derived goals and the REST decision, in one run.

    .venv/bin/python -m bench.goals                          # both models, 2 rounds of 2 s windows
    .venv/bin/python -m bench.goals --models self_attention --rounds 1 --seconds 1 --sides native_floor,native
    .venv/bin/python -m bench.goals --peers pytriton         # and PyTriton at c=32 (make bench-peers)
    .venv/bin/python -m bench.goals --device cuda            # the servers and in-process ONNX Runtime on CUDA

For each model (self_attention with one (1, 10, 512) sequence per request, cross_attention at
its preset shapes: bench.inprocess.SHAPES), in alternating rounds (the order of the sides turns
round each round, so every side sees the machine's drift), at concurrency 1 and 32:

    native_floor  bench.native_floor: gRPC's C++ core answering zeros (the plane, zeros switch on)
    aio_floor     bench.aio_floor: a bare grpc.aio servicer answering zeros
    python        `attnserve serve --data-plane python`, its gRPC port
    native        `attnserve serve --data-plane native`, its gRPC port (the native plane)
    rest_binary   the python server's REST port, binary tensor data (perf_analyzer -i http)
    native_rest_binary   the native server's REST port, binary (perf_analyzer -i http): REST over gRPC there
    native_beside_rest   the native server's gRPC port while REST binary calls (c=8) run beside it
    rest_binary_aiohttp, rest_json   the same port driven by bench.rest_loadgen, binary and JSON
    aiohttp_floor bench.aiohttp_floor: bare aiohttp answering zeros (binary), by bench.rest_loadgen
    in-process    ONNX Runtime on the served graph: the batch-1 call and 32 requests per run
    pytriton      (--peers) PyTriton on the same graph, Triton's dynamic batcher, c=32 only

gRPC sides are driven by perf_analyzer (bench.perf_analyzer; bench.loadgen where it cannot run).
Each level records requests/s, p50/p99 and the serving processes' CPU milliseconds per request
(the process and its descendants).
Then, per round and then as the median over rounds, for each server side:
    c32 >= 0.7 x 1/(1/native floor c32 + 1/in-process b32)
    c1 p50 <= native floor p50 + b1 call + 0.1 ms
    CPU ms per request beside the native floor's; our c32 / PyTriton's c32 (goal 3x).
JSON to --output/goals.json. docs/performance.md ("Issue 26's goals") has the method.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from attnserve.server.repository import read_model_spec

from bench import inprocess, loadgen, perf_analyzer, rest_loadgen
from bench.__main__ import _cpu_s, machine
from bench.inprocess import SHAPES

REPO_ROOT = Path(__file__).resolve().parent.parent
PYTRITON_PYTHON = REPO_ROOT / "build" / "pytriton-venv" / "bin" / "python"
LEVELS = (1, 32)
C32_SHARE = 0.7  # of 1/(1/native floor + 1/in-process b32)
C1_SLACK_MS = 0.1  # over native floor p50 + b1 call
PEER_GOAL = 3.0  # our c32 over PyTriton's
REST_GOAL = 0.8  # the native server's REST binary c32 over its gRPC c32
BESIDE_REST_CONCURRENCY = 8  # REST calls in flight beside native_beside_rest's gRPC load
SERVERS = ("native", "python")  # the sides the goals are judged for
# side: (process, how it is driven)
SIDES = {
    "native_floor": ("native_floor", "grpc"),
    "aio_floor": ("aio_floor", "grpc"),
    "python": ("python", "grpc"),
    "native": ("native", "grpc"),
    "rest_binary": ("python", "http"),
    "rest_binary_aiohttp": ("python", "rest_binary"),
    "rest_json": ("python", "rest_json"),
    "aiohttp_floor": ("aiohttp_floor", "rest_binary"),
    # The native server's REST port (its calls join the core's queues beside gRPC's), by the gRPC
    # sides' own generator; and its gRPC port at c=32 while REST calls (c=8) run beside them.
    "native_rest_binary": ("native", "http"),
    "native_beside_rest": ("native", "grpc_beside_rest"),
    # Asked for by name only: the native floor answering from a thread of its own (what a handoff costs).
    "native_floor_handoff": ("native_floor_handoff", "grpc"),
}
DEFAULT_SIDES = ",".join(s for s in SIDES if s != "native_floor_handoff")


class Process:
    """A serving process started with --ready-file; its ports are read from that file."""

    def __init__(self, name: str, command: list[str], workdir: Path, port_key: str, timeout_s: float = 180) -> None:
        self.name = name
        self.ready = workdir / f"ready-{name}.json"
        self.log_path = workdir / f"{name}.log"
        self.log = open(self.log_path, "wb")
        self.proc = subprocess.Popen([*command, "--ready-file", str(self.ready)], cwd=REPO_ROOT, stdout=self.log,
                                     stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout_s
        while not self.ready.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                tail = self.log_path.read_text(errors="replace")[-3000:]
                raise RuntimeError(f"{name} did not start (exit {self.proc.returncode}); {self.log_path}:\n{tail}")
            time.sleep(0.05)
        self.ports = json.loads(self.ready.read_text())
        self.address = f"127.0.0.1:{self.ports[port_key]}"

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


def tree_cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process and every live descendant: PyTriton serves from
    tritonserver and a backend stub below its Python process."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parents[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue  # gone meanwhile
    tree, frontier = {pid}, [pid]
    while frontier:
        children = [p for p, parent in parents.items() if parent in frontier and p not in tree]
        tree.update(children)
        frontier = children
    total = 0.0
    for p in tree:
        try:
            total += _cpu_s(p)
        except (OSError, IndexError, ValueError):
            pass
    return total


def _server_command(module: str, repository: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", module, "--model-repository", str(repository), "--host", "127.0.0.1", "--port", "0",
            "--http-port", "-1", "--metrics-port", "-1", "--log-level", "WARNING", "--drain-delay-s", "0",
            "--workers", "1", *extra]


def pytriton_command(repository: Path, models: list[str]) -> list[str]:
    """bench/pytriton_peer.py in its own virtualenv, serving each model's all-outputs graph with
    the model's own batching (max_batch_size rows, max_queue_delay_ms), as the server does."""
    command = [str(PYTRITON_PYTHON), str(REPO_ROOT / "bench" / "pytriton_peer.py")]
    for s in (read_model_spec(repository / m) for m in models):
        command += ["--model", f"{s.name}={s.graph_all_outputs}:{s.query_dim}:{s.kv_dim}:{s.out_dim}:{s.num_heads}:"
                               f"{s.max_batch_size}:{s.max_queue_delay_ms}"]
    return command


def start(name: str, repository: Path, workdir: Path, models: list[str], device: str = "cpu",
          server_args: tuple[str, ...] = ()) -> Process:
    """One serving process; `device` and `server_args` reach the two servers (the floors compute nothing)."""
    if name == "native_floor":
        return Process(name, _server_command("bench.native_floor", repository, "--data-plane", "native"),
                                             workdir, "grpc_port")
    if name == "native_floor_handoff":
        command = _server_command("bench.native_floor", repository, "--data-plane", "native")
        command.insert(3, "--handoff")  # the module's own flag, before the server's
        return Process(name, command, workdir, "grpc_port")
    if name == "aio_floor":
        return Process(name, _server_command("bench.aio_floor", repository), workdir, "grpc_port")
    if name == "python":
        return Process(name, _server_command("attnserve.server", repository, "--data-plane", "python",
                                             "--http-port", "0", "--device", device, *server_args),
                       workdir, "grpc_port")
    if name == "native":
        return Process(name, _server_command("attnserve.server", repository, "--data-plane", "native",
                                             "--http-port", "0", "--device", device, *server_args),
                       workdir, "grpc_port")
    if name == "aiohttp_floor":
        return Process(name, [sys.executable, "-m", "bench.aiohttp_floor", "--model-repository", str(repository)],
                       workdir, "http_port")
    if name == "pytriton":
        return Process(name, pytriton_command(repository, models), workdir, "grpc_port", timeout_s=300)
    raise ValueError(f"unknown process {name!r}")


def derive(in_process: dict, sides: dict, servers=SERVERS) -> dict:
    """One round's goals from its own figures. in_process: {1: {"ms_per_call"}, 32: {"requests_per_s"}};
    sides: {side: {level: {"requests_per_s", "p50_ms", "cpu_ms_per_req"}}}. Each goal is left out
    when a figure it needs was not measured."""
    floor = sides.get("native_floor", {})
    got: dict = {}
    for name in servers:
        server = sides.get(name, {})
        mine: dict = {}
        if 32 in server and 32 in floor and 32 in in_process:
            ideal = 1.0 / (1.0 / floor[32]["requests_per_s"] + 1.0 / in_process[32]["requests_per_s"])
            mine["c32"] = {"ideal_requests_per_s": ideal, "goal_requests_per_s": C32_SHARE * ideal,
                           "requests_per_s": server[32]["requests_per_s"],
                           "of_ideal": server[32]["requests_per_s"] / ideal,
                           "met": server[32]["requests_per_s"] >= C32_SHARE * ideal}
        if 1 in server and 1 in floor and 1 in in_process:
            budget = floor[1]["p50_ms"] + in_process[1]["ms_per_call"] + C1_SLACK_MS
            mine["c1"] = {"goal_p50_ms": budget, "p50_ms": server[1]["p50_ms"],
                          "over_goal_ms": server[1]["p50_ms"] - budget, "met": server[1]["p50_ms"] <= budget}
        for c in LEVELS:
            if c in server and c in floor and "cpu_ms_per_req" in server[c]:
                mine[f"cpu_c{c}"] = {"cpu_ms_per_req": server[c]["cpu_ms_per_req"],
                                     "native_floor_cpu_ms_per_req": floor[c]["cpu_ms_per_req"],
                                     "of_floor": server[c]["cpu_ms_per_req"] / floor[c]["cpu_ms_per_req"]}
        peer = sides.get("pytriton", {})
        if 32 in server and 32 in peer:
            ratio = server[32]["requests_per_s"] / peer[32]["requests_per_s"]
            mine["pytriton"] = {"of_pytriton": ratio, "goal": PEER_GOAL, "met": ratio >= PEER_GOAL}
        if mine:
            got[name] = mine
    return got


def _median(values: list[float]) -> float:
    return float(statistics.median(values)) if values else float("nan")


def summarize(rounds: list[dict]) -> dict:
    """Each figure's median over the rounds, and each goal's verdict on the median of its
    per-round ratio (each round against its own floor and in-process figures)."""
    sides: dict = {}
    for got in rounds:
        for side, levels in got["sides"].items():
            for c, figures in levels.items():
                sides.setdefault(side, {}).setdefault(c, []).append(figures)
    medians = {side: {c: {f: _median([r[f] for r in runs if f in r]) for f in runs[0]
                          if isinstance(runs[0][f], (int, float))} for c, runs in levels.items()}
               for side, levels in sides.items()}
    in_process = {k: {f: _median([r["in_process"][k][f] for r in rounds]) for f in rounds[0]["in_process"][k]}
                  for k in rounds[0]["in_process"]} if rounds else {}
    goals: dict = {}
    for name in SERVERS:
        per_round = [got["derived"][name] for got in rounds if name in got["derived"]]
        if not per_round:
            continue
        mine = {}
        for goal, ratio, passes in (("c32", "of_ideal", lambda x: x >= C32_SHARE),
                                    ("c1", "over_goal_ms", lambda x: x <= 0),
                                    ("cpu_c1", "of_floor", None), ("cpu_c32", "of_floor", None),
                                    ("pytriton", "of_pytriton", lambda x: x >= PEER_GOAL)):
            these = [d[goal] for d in per_round if goal in d]
            if not these:
                continue
            entry = {f: _median([d[f] for d in these]) for f in these[0] if f != "met"}
            entry[f"{ratio}_per_round"] = [d[ratio] for d in these]
            if passes is not None:
                entry["met"] = passes(entry[ratio])
            mine[goal] = entry
        goals[name] = mine
    per_round = [got["sides"]["native_rest_binary"][32]["requests_per_s"] / got["sides"]["native"][32]["requests_per_s"]
                 for got in rounds if 32 in got["sides"].get("native_rest_binary", {})
                 and 32 in got["sides"].get("native", {})]
    rest_over_grpc = {"per_round": per_round, "median": _median(per_round)} if per_round else None
    return {"sides": medians, "in_process": in_process, "goals": goals, "rest_over_grpc": rest_over_grpc}


def rest_decision(medians: dict) -> list[dict]:
    """REST next to the gRPC paths, and each transport's bare floor: CPU ms per request at c=32
    and p50 at c=1, and each one's CPU over the Python gRPC path's."""
    base = medians.get("python", {}).get(32, {}).get("cpu_ms_per_req")
    rows = []
    for side in ("native", "native_rest_binary", "native_beside_rest", "python", "rest_binary", "rest_binary_aiohttp",
                 "rest_json", "native_floor", "aio_floor", "aiohttp_floor"):
        levels = medians.get(side)
        if not levels:
            continue
        c32, c1 = levels.get(32, {}), levels.get(1, {})
        rows.append({"side": side, "cpu_ms_per_req_c32": c32.get("cpu_ms_per_req"),
                     "requests_per_s_c32": c32.get("requests_per_s"), "p50_ms_c1": c1.get("p50_ms"),
                     "cpu_ms_per_req_c1": c1.get("cpu_ms_per_req"),
                     "cpu_of_python_grpc": (c32["cpu_ms_per_req"] / base) if base and "cpu_ms_per_req" in c32
                     else None})
    return rows


def _fmt(value, spec: str) -> str:
    """value formatted, or "-" in the same width where it was not measured."""
    width = "".join(c for c in spec.split(".")[0].split(",")[0] if c.isdigit())
    return ("-".rjust(int(width)) if width else "-") if value is None or value != value else format(value, spec)


def report(model: str, shape, summary: dict) -> list[str]:
    """The printed table of one model."""
    lines = [f"\n{model}: request {shape.batch} x ({shape.q_len} queries, {shape.k_len} keys)"]
    inproc = summary["in_process"]
    if inproc:
        lines.append(f"  in-process ONNX Runtime: b1 call {inproc[1]['ms_per_call']:.3f} ms, "
                     f"b32 {inproc[32]['requests_per_s']:,.0f} requests/s")
    lines.append(f"  {'side':20s} {'c1 req/s':>9} {'c1 p50 ms':>9} {'c1 CPU ms/req':>13} "
                 f"{'c32 req/s':>9} {'c32 p50 ms':>10} {'c32 CPU ms/req':>14}")
    for side, levels in summary["sides"].items():
        c1, c32 = levels.get(1, {}), levels.get(32, {})
        lines.append(f"  {side:20s} {_fmt(c1.get('requests_per_s'), '9,.0f')} {_fmt(c1.get('p50_ms'), '9.3f')} "
                     f"{_fmt(c1.get('cpu_ms_per_req'), '13.3f')} {_fmt(c32.get('requests_per_s'), '9,.0f')} "
                     f"{_fmt(c32.get('p50_ms'), '10.3f')} {_fmt(c32.get('cpu_ms_per_req'), '14.3f')}")
    for name, goals in summary["goals"].items():
        if "c32" in goals:
            d = goals["c32"]
            per_round = ", ".join(f"{x:.2f}" for x in d["of_ideal_per_round"])
            lines.append(f"  {name}: c32 >= {C32_SHARE} x 1/(1/native floor + 1/in-process b32): "
                         f"{d['requests_per_s']:,.0f} vs goal {d['goal_requests_per_s']:,.0f} req/s, "
                         f"{d['of_ideal']:.2f} x the ideal (rounds {per_round}) {'PASS' if d['met'] else 'FAIL'}")
        if "c1" in goals:
            d = goals["c1"]
            per_round = ", ".join(f"{x:+.3f}" for x in d["over_goal_ms_per_round"])
            lines.append(f"  {name}: c1 p50 <= native floor p50 + b1 call + {C1_SLACK_MS} ms: {d['p50_ms']:.3f} vs "
                         f"goal {d['goal_p50_ms']:.3f} ms (rounds {per_round} over) {'PASS' if d['met'] else 'FAIL'}")
        for c in LEVELS:
            if f"cpu_c{c}" in goals:
                d = goals[f"cpu_c{c}"]
                lines.append(f"  {name}: CPU at c{c} {d['cpu_ms_per_req']:.3f} ms/req beside the native floor's "
                             f"{d['native_floor_cpu_ms_per_req']:.3f} ({d['of_floor']:.1f} x)")
        if "pytriton" in goals:
            d = goals["pytriton"]
            lines.append(f"  {name}: c32 / PyTriton's c32 = {d['of_pytriton']:.2f} (goal {PEER_GOAL:.0f}x) "
                         f"{'PASS' if d['met'] else 'FAIL'}")
    ratios = summary.get("rest_over_grpc")
    if ratios:
        per_round = ", ".join(f"{x:.2f}" for x in ratios["per_round"])
        lines.append(f"  native: REST binary c32 / gRPC c32 on the same server = {ratios['median']:.2f} "
                     f"(rounds {per_round}; goal {REST_GOAL}) {'PASS' if ratios['median'] >= REST_GOAL else 'FAIL'}")
    rest = rest_decision(summary["sides"])
    if any(r["side"].startswith(("rest", "aiohttp")) for r in rest):
        lines.append("  REST next to gRPC (server CPU ms per request at c=32, p50 at c=1; CPU over Python gRPC's):")
        for r in rest:
            lines.append(f"    {r['side']:20s} CPU {_fmt(r['cpu_ms_per_req_c32'], '.3f')} ms/req "
                         f"({_fmt(r['cpu_of_python_grpc'], '.2f')} x), {_fmt(r['requests_per_s_c32'], ',.0f')} req/s, "
                         f"c1 p50 {_fmt(r['p50_ms_c1'], '.3f')} ms")
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.goals", description=__doc__.split("\n\n")[0])
    p.add_argument("--repository", type=Path, default=REPO_ROOT / "models")
    p.add_argument("--models", default="self_attention,cross_attention")
    p.add_argument("--sides", default=DEFAULT_SIDES, help=f"of {DEFAULT_SIDES} (the default), native_floor_handoff")
    p.add_argument("--peers", default="", help="pytriton: also PyTriton at c=32 (make bench-peers installs it)")
    p.add_argument("--seconds", type=float, default=2.0, help="measurement window per level")
    p.add_argument("--rounds", type=int, default=2, help="alternating rounds; figures are their medians")
    p.add_argument("--in-process-s", type=float, default=1.0, help="in-process window per batch size")
    p.add_argument("--load-generator", choices=("auto", "python"), default="auto",
                   help="python: bench.loadgen for gRPC sides even where perf_analyzer runs")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="ONNX Runtime's device for the servers and the in-process figures")
    p.add_argument("--server-args", default="", help="more flags for the two servers, e.g. '--batches-in-flight 2'")
    p.add_argument("--output", type=Path, default=REPO_ROOT / "bench" / "results")
    args = p.parse_args(argv)
    models = [m for m in args.models.split(",") if m]
    chosen = [s for s in args.sides.split(",") if s]
    unknown = sorted(set(chosen) - set(SIDES))
    if unknown:
        p.error(f"unknown sides {unknown}; choose from {DEFAULT_SIDES}")
    peers = [s for s in args.peers.split(",") if s]
    if set(peers) - {"pytriton"}:
        p.error(f"unknown peers {peers}; the one peer is pytriton")
    if peers and args.device != "cpu":
        p.error("the PyTriton peer serves on CPU only (bench/pytriton_peer.py)")
    if peers and not PYTRITON_PYTHON.exists():
        raise SystemExit(f"bench.goals: {PYTRITON_PYTHON} is missing: `make bench-peers` installs PyTriton there")
    specs = {m: read_model_spec(args.repository / m) for m in models}
    found = perf_analyzer.find() if args.load_generator == "auto" else None
    if found is None:  # bench.loadgen speaks gRPC alone: REST binary goes by bench.rest_loadgen's side only
        chosen = [s for s in chosen if SIDES[s][1] != "http"]
    from attnserve.server.native import why_unavailable

    why_not_native = why_unavailable()
    if why_not_native is not None:
        print(f"bench.goals: no native sides: {why_not_native}", flush=True)
        chosen = [s for s in chosen if SIDES[s][0] not in ("native", "native_floor", "native_floor_handoff")]
    providers = ("CUDAExecutionProvider",) if args.device == "cuda" else ("CPUExecutionProvider",)
    host = machine()
    load_before = os.getloadavg()
    print(f"bench.goals: {host['cpu_model']}, {host['cores']} cores, load {' '.join(f'{x:.2f}' for x in load_before)}; "
          f"{'perf_analyzer' if found else 'bench.loadgen'}; {args.rounds} rounds of {args.seconds:g} s; "
          f"device {args.device}; sides {','.join(chosen + peers)}", flush=True)
    workdir = Path(tempfile.mkdtemp(prefix="bench-goals-"))
    needed = list(dict.fromkeys([SIDES[s][0] for s in chosen] + peers))
    procs: dict[str, Process] = {}
    results: dict = {"machine": host, "generator": "perf_analyzer" if found else "bench.loadgen",
                     "rounds": args.rounds, "seconds": args.seconds, "device": args.device,
                     "server_args": args.server_args, "load_before": load_before,
                     "sides": chosen + peers, "models": {}}
    try:
        for name in needed:
            print(f"starting {name} ...", flush=True)
            procs[name] = start(name, args.repository, workdir, models, args.device,
                                tuple(shlex.split(args.server_args)))

        def drive(side: str, model: str, c: int) -> dict:
            spec, shape = specs[model], SHAPES[model]
            dims = (spec.query_dim, spec.kv_dim)
            proc_name, how = (side, "grpc") if side == "pytriton" else SIDES[side]
            proc = procs[proc_name]
            pid = proc.proc.pid
            if how in ("rest_binary", "rest_json"):
                window = {}
                got = rest_loadgen.run(f"127.0.0.1:{proc.ports['http_port']}", model, dims, shape, c,
                                       args.seconds, binary=how == "rest_binary",
                                       on_start=lambda: window.update(cpu0=tree_cpu_s(pid)),
                                       on_stop=lambda: window.update(cpu1=tree_cpu_s(pid)))
                cpu_ms = (window["cpu1"] - window["cpu0"]) * 1000
                got["cpu_ms_per_req"] = cpu_ms / got["requests"] if got["requests"] else float("nan")
            elif how == "grpc_beside_rest":  # gRPC at c, REST binary calls running beside it the whole time
                beside = threading.Thread(target=rest_loadgen.run, args=(
                    f"127.0.0.1:{proc.ports['http_port']}", model, dims, shape, BESIDE_REST_CONCURRENCY,
                    args.seconds * 3 + 30), daemon=True)
                beside.start()
                time.sleep(2)  # its processes warmed up and sending
                cpu0, t0 = tree_cpu_s(pid), time.monotonic()
                if found is not None:
                    got = perf_analyzer.run(*found, proc.address, model, dims, shape, c, args.seconds, workdir,
                                            spec.version)
                else:
                    got = loadgen.run(proc.address, model, dims, shape, c, args.seconds)
                share = (tree_cpu_s(pid) - cpu0) / (time.monotonic() - t0)
                got["cpu_ms_per_req"] = 1000 * share / got["requests_per_s"]
                beside.join()
            else:
                address = f"127.0.0.1:{proc.ports['http_port']}" if how == "http" else proc.address
                cpu0, t0 = tree_cpu_s(pid), time.monotonic()
                if found is not None:
                    got = perf_analyzer.run(*found, address, model, dims, shape, c, args.seconds, workdir,
                                            1 if side == "pytriton" else spec.version, protocol=how,
                                            triton_batching=side == "pytriton")
                else:
                    got = loadgen.run(address, model, dims, shape, c, args.seconds)
                # The process's CPU share over the whole run of the generator, over its rate.
                share = (tree_cpu_s(pid) - cpu0) / (time.monotonic() - t0)
                got["cpu_ms_per_req"] = 1000 * share / got["requests_per_s"]
            got["load"] = os.getloadavg()[0]
            return got

        for r in range(args.rounds):
            for model in models:
                got: dict = {"sides": {}}
                order = chosen + peers if r % 2 == 0 else list(reversed(chosen + peers))
                if r % 2 == 0:
                    got["in_process"] = inprocess.measure(specs[model], SHAPES[model], (1, 32), args.in_process_s,
                                                          providers=providers)
                for side in order:
                    for c in ((32,) if side in ("pytriton", "native_beside_rest") else LEVELS):
                        try:
                            figures = drive(side, model, c)
                        except RuntimeError as err:  # perf_analyzer found no stable window: this level is left out
                            got.setdefault("failed", []).append({"side": side, "level": c, "error": str(err)[-600:]})
                            why = [line.strip() for line in str(err).splitlines() if line.strip()][-1:] or ["?"]
                            print(f"round {r + 1} {model:15s} {side:20s} c={c:<3d} not measured: {why[0][:200]}",
                                  flush=True)
                            continue
                        got["sides"].setdefault(side, {})[c] = figures
                        print(f"round {r + 1} {model:15s} {side:20s} c={c:<3d} {figures['requests_per_s']:8.0f} req/s"
                              f"  p50 {figures['p50_ms']:7.3f} ms  CPU {figures['cpu_ms_per_req']:.3f} ms/req"
                              f"  load {figures['load']:.2f}", flush=True)
                if r % 2 == 1:
                    got["in_process"] = inprocess.measure(specs[model], SHAPES[model], (1, 32), args.in_process_s,
                                                          providers=providers)
                print(f"round {r + 1} {model:15s} in-process: b1 call {got['in_process'][1]['ms_per_call']:.3f} ms, "
                      f"b32 {got['in_process'][32]['requests_per_s']:,.0f} req/s", flush=True)
                got["derived"] = derive(got["in_process"], got["sides"])
                results["models"].setdefault(model, {"shape": vars(SHAPES[model]), "rounds": []})["rounds"].append(got)
    finally:
        for proc in procs.values():
            proc.stop()
    shutil.rmtree(workdir, ignore_errors=True)  # kept when the run fails: the processes' logs are there
    results["load_after"] = os.getloadavg()
    for model in models:
        data = results["models"][model]
        data.update(summarize(data["rounds"]))
        data["rest"] = rest_decision(data["sides"])
        print("\n".join(report(model, SHAPES[model], data)))
    print(f"\n{host['cpu_model']}, {host['cores']} cores; load average before "
          f"{' '.join(f'{x:.2f}' for x in load_before)}, after {' '.join(f'{x:.2f}' for x in results['load_after'])}; "
          f"medians of {args.rounds} alternating rounds; device {args.device}")
    args.output.mkdir(parents=True, exist_ok=True)
    out = args.output / "goals.json"
    out.write_text(json.dumps(results, indent=1, default=str))
    print(f"written {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
