"""`python -m bench`: the server under load vs in-process ONNX Runtime, measured in one run.

    make bench                                    # both presets, concurrency 1, 8, 32, 64; then the sweep
    .venv/bin/python -m bench --models self_attention --concurrency 1,32 --seconds 2 --no-streaming --no-http
                                                  # quick: issue #17's two derived goals alone
    .venv/bin/python -m bench --models self_attention --soak-s 300 -- --batches-in-flight 2
    .venv/bin/python -m bench --sweep [bench.sweep's flags]   # time and memory against sequence length

1. In-process ONNX Runtime on the served graph (the server's own Engine and session options),
   k requests merged per run for k in 1, 8, 32, 64: the ceiling.
2. The server (a real `attnserve serve` process, extra flags after `--`), driven at each
   concurrency by perf_analyzer (unmodified; `make bench-tools`) or, where it cannot run, by a
   multi-process load generator: one ModelInfer call per request, and (perf_analyzer only)
   requests as messages of ModelStreamInfer streams, and one POST .../infer per request on the
   REST port (perf_analyzer -i http, binary tensor data), with REST vs gRPC at each level.
3. The floor: `python -m bench.floor`, the same server stack answering without a model (decode,
   batch, zeros for the model's run, encode), driven the same way: what gRPC, Python and
   batching cost per call on this machine.
4. A table with the ratios the goals are stated in, and JSON + PNG under --output. Issue #17's
   goals are derived from the same round's figures: concurrency 32 against
   1 / (1/floor + 1/in-process b32) (a request costing exactly its transport plus its compute),
   concurrency 1's p50 against the floor's p50 + the batch-1 call + 0.1 ms. In-process, server
   and floor alternate, round after round (--rounds, A/B/A/B), each level's server and floor
   runs back to back, so the ratios survive a noisy machine; the table gives each figure's
   median over the rounds, the CPU model and the load.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from attnserve.server.engine import DeviceUnavailable, choose_device
from attnserve.server.repository import read_model_spec

from bench import inprocess, loadgen, perf_analyzer
from bench.inprocess import SHAPES

REPO_ROOT = Path(__file__).resolve().parent.parent
IN_PROCESS_BATCHES = (1, 8, 32, 64)


def _rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process so far."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _rows(server: _Server, model: str) -> int:
    """Rows the server has inferred for `model` (its ModelStatistics)."""
    from attnserve.client import InferenceClient

    with InferenceClient(server.address) as client:
        (stats,) = client.model_statistics(model)
        return stats.inference_count


class _Server:
    def __init__(self, repository: Path, extra: list[str], workdir: Path, module: str = "attnserve.server") -> None:
        self.ready_file = workdir / f"ready-{module}.json"
        self.log = open(workdir / f"{module}.log", "wb")
        started = time.monotonic()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", module, "--model-repository", str(repository), "--host", "127.0.0.1",
             "--port", "0", "--http-port", "0", "--metrics-port", "0", "--log-level", "WARNING", "--ready-file",
             str(self.ready_file),
             "--drain-delay-s", "0", "--workers", "1",
             *extra], cwd=REPO_ROOT, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 60
        while not self.ready_file.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"bench: {module} did not start; see {workdir / f'{module}.log'}")
            time.sleep(0.05)
        self.ready_s = time.monotonic() - started  # process start to the ready file: every model warmed
        ports = json.loads(self.ready_file.read_text())
        self.address = f"127.0.0.1:{ports['grpc_port']}"
        self.http_address = f"127.0.0.1:{ports['http_port']}"  # the REST port
        self.metrics_port = ports["metrics_port"]

    def time_to_ready(self) -> dict:
        """The process's (start to ready file) and each model's (attnserve_model_ready_seconds:
        from the server's start, warm-up included) time-to-ready."""
        import re
        import urllib.request

        text = urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=10).read().decode()
        models = {m: float(v) for m, v in re.findall(r'attnserve_model_ready_seconds\{model="(\w+)"\} (\S+)', text)}
        return {"process_s": round(self.ready_s, 3), "models_s": {m: round(v, 3) for m, v in sorted(models.items())}}

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=60)
        self.log.close()


def _parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, list[str]]:
    argv = list(sys.argv[1:] if argv is None else argv)
    server_args: list[str] = []
    if "--" in argv:
        split = argv.index("--")
        argv, server_args = argv[:split], argv[split + 1:]
    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--repository", type=Path, default=REPO_ROOT / "models", help="model repository (default: models)")
    p.add_argument("--models", default="self_attention,cross_attention")
    p.add_argument("--concurrency", default="1,8,32,64")
    p.add_argument("--seconds", type=float, default=4.0, help="measurement window per level")
    p.add_argument("--rounds", type=int, default=2, help="rounds of in-process, server and floor, alternating "
                   "(A/B/A/B); the table gives each figure's median over them")
    p.add_argument("--load-generator", choices=("auto", "perf_analyzer", "python"), default="auto")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="ONNX Runtime's device, in process and in the server (--device is passed on)")
    p.add_argument("--no-floor", action="store_true", help="skip the floor (bench.floor, no model)")
    p.add_argument("--no-streaming", action="store_true", help="skip ModelStreamInfer (perf_analyzer --streaming)")
    p.add_argument("--no-http", action="store_true", help="skip the REST port (perf_analyzer -i http)")
    p.add_argument("--soak-s", type=float, default=0.0, help="then run the first model at concurrency 32 "
                   "this long, sampling the server's memory")
    p.add_argument("--output", type=Path, default=REPO_ROOT / "bench" / "results")
    return p.parse_args(argv), server_args


def machine() -> dict:
    """What the figures were measured on: ratios differ by machine (the same commit gave 0.25x
    and 0.19x of in-process batch 32 on two machines), so the CPU model goes with them."""
    model = "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), model)
    except OSError:
        pass
    return {"host": platform.node(), "cpu_model": model, "cores": os.cpu_count()}


def _median(values: list[float]) -> float:
    return float(statistics.median(values)) if values else float("nan")


def _median_levels(rounds: list[dict]) -> dict:
    """{key: {field: median over the rounds}} of per-round {key: {field: value}}."""
    keys = [k for k in rounds[0] if all(k in r for r in rounds)] if rounds else []
    return {k: {f: _median([r[k][f] for r in rounds]) for f in rounds[0][k]
                if isinstance(rounds[0][k][f], (int, float))} for k in keys}


def derived(in_process: dict, server: dict, floor: dict) -> dict:
    """Issue #17's two goals, from one round's measurements (in-process, server and floor of
    the same round, so that they saw the same load):

    - throughput at concurrency 32 >= 0.9 x 1 / (1/floor + 1/in-process b32): what the server
      would reach if a request cost exactly its transport (the floor) plus its compute;
    - p50 at concurrency 1 <= floor p50 + the in-process batch-1 call + 0.1 ms.
    Either is left out when its levels were not run."""
    got = {}
    if 32 in server and 32 in floor and 32 in in_process:
        ideal = 1.0 / (1.0 / floor[32]["requests_per_s"] + 1.0 / in_process[32]["requests_per_s"])
        got["c32"] = {"ideal_requests_per_s": ideal, "goal_requests_per_s": 0.9 * ideal,
                      "requests_per_s": server[32]["requests_per_s"],
                      "of_ideal": server[32]["requests_per_s"] / ideal}
    if 1 in server and 1 in floor and 1 in in_process:
        budget = floor[1]["p50_ms"] + in_process[1]["ms_per_call"] + 0.1
        got["c1"] = {"goal_p50_ms": budget, "p50_ms": server[1]["p50_ms"],
                     "added_ms": server[1]["p50_ms"] - floor[1]["p50_ms"] - in_process[1]["ms_per_call"]}
    return got


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--sweep"]:  # the sequence-length sweep: bench.sweep, with the rest of the flags
        from bench import sweep

        return sweep.main(argv[1:])
    args, server_args = _parse_args(argv)
    server_args = ["--device", args.device, *server_args]
    try:
        providers = choose_device(args.device).providers
    except DeviceUnavailable as err:
        raise SystemExit(f"bench: --device cuda: {err}") from None
    models = [m for m in args.models.split(",") if m]
    levels = [int(c) for c in args.concurrency.split(",")]
    specs = {m: read_model_spec(args.repository / m) for m in models}
    found = perf_analyzer.find() if args.load_generator != "python" else None
    if args.load_generator == "perf_analyzer" and found is None:
        raise SystemExit("bench: perf_analyzer is not installed or cannot run here: `make bench-tools`")
    generator = "perf_analyzer" if found else "python (multi-process grpc.aio)"
    load_before = os.getloadavg()
    host = machine()
    print(f"bench: {host['host']}, {host['cpu_model']}, {host['cores']} cores, load {load_before[0]:.2f}; "
          f"generator: {generator}; {args.rounds} rounds; server flags: {' '.join(server_args) or '(defaults)'}",
          flush=True)

    results: dict = {"generator": generator, "server_args": server_args, "cores": os.cpu_count(),
                     "machine": host, "providers": list(providers), "rounds": args.rounds,
                     "load_before": load_before,
                     "models": {m: {"shape": vars(SHAPES[m]), "rounds": []} for m in models}}

    def drive(server: _Server, model: str, c: int, workdir: Path, streaming: bool = False, http: bool = False) -> dict:
        spec, shape = specs[model], SHAPES[model]
        cpu_s, rows = _cpu_s(server.proc.pid), _rows(server, model)
        if found:
            got = perf_analyzer.run(*found, server.http_address if http else server.address, model,
                                    (spec.query_dim, spec.kv_dim), shape, c, args.seconds, workdir, spec.version,
                                    streaming=streaming, protocol="http" if http else "grpc")
        else:
            got = loadgen.run(server.address, model, (spec.query_dim, spec.kv_dim), shape, c, args.seconds)
        got["server_rss_mb"] = _rss_mb(server.proc.pid)
        # The server's own CPU time per request, over every request of the level (perf_analyzer's
        # warm-up too): the cost of a transport, whatever the load generator beside it takes.
        requests = (_rows(server, model) - rows) / shape.batch
        cpu_ms = (_cpu_s(server.proc.pid) - cpu_s) * 1000
        got["server_cpu_ms_per_request"] = cpu_ms / requests if requests else float("nan")
        got["load"] = os.getloadavg()[0]
        return got

    streaming = bool(found) and not args.no_streaming
    http = bool(found) and not args.no_http  # the python load generator speaks gRPC only
    with tempfile.TemporaryDirectory(prefix="attnserve-bench-") as tmp:
        # Both processes stay up for the whole run (the one not measured is idle), so that the
        # rounds can alternate between them: A/B/A/B, each side seeing the machine's load.
        (Path(tmp) / "server").mkdir()
        server = _Server(args.repository, server_args, Path(tmp) / "server")
        results["time_to_ready"] = ready = server.time_to_ready()
        print(f"time-to-ready: {ready['process_s']:.2f}s from the process's start to its ready file; per model, "
              "from the server's start (warm-up included): "
              + ", ".join(f"{m} {s:.2f}s" for m, s in ready["models_s"].items()), flush=True)
        floor = None
        try:
            if not args.no_floor:
                (Path(tmp) / "floor").mkdir()
                floor = _Server(args.repository, server_args, Path(tmp) / "floor", module="bench.floor")
            for r in range(args.rounds):
                for model in models:
                    got: dict = {"server": {}, "floor": {}}

                    def in_process(r: int = r, model: str = model, got: dict = got) -> None:
                        print(f"round {r + 1}: in-process ONNX Runtime, {model} ...", flush=True)
                        got["in_process"] = inprocess.measure(specs[model], SHAPES[model], IN_PROCESS_BATCHES,
                                                              seconds=min(args.seconds, 3.0), providers=providers)

                    def served(c: int, r: int = r, model: str = model, got: dict = got) -> None:
                        print(f"round {r + 1}: server, {model}, concurrency {c} ...", flush=True)
                        got["server"][c] = drive(server, model, c, Path(tmp))

                    def floored(c: int, r: int = r, model: str = model, got: dict = got) -> None:
                        if floor is not None:
                            print(f"round {r + 1}: floor (no model), {model}, concurrency {c} ...", flush=True)
                            got["floor"][c] = drive(floor, model, c, Path(tmp))

                    # A/B/A/B: the order turns round each round. The server and the floor take each
                    # level one right after the other: this VM's speed drifts by 1.4x within minutes,
                    # so the figures a ratio divides are measured seconds apart, not a level apart.
                    order = (served, floored) if r % 2 == 0 else (floored, served)
                    pairs = [(side, c) for c in levels for side in order]
                    if r % 2 == 0:
                        in_process()
                    for side, c in pairs:
                        side(c)
                    if r % 2 == 1:
                        in_process()
                    got["derived"] = derived(got["in_process"], got["server"], got["floor"])
                    results["models"][model]["rounds"].append(got)
            for model in models:  # the extra transports, once each
                data = results["models"][model]
                data["server_streaming"], data["server_http"] = {}, {}
                for c in levels:
                    if streaming:
                        print(f"server, {model}, concurrency {c}, ModelStreamInfer ...", flush=True)
                        data["server_streaming"][c] = drive(server, model, c, Path(tmp), streaming=True)
                    if http:
                        print(f"server, {model}, concurrency {c}, REST (perf_analyzer -i http) ...", flush=True)
                        data["server_http"][c] = drive(server, model, c, Path(tmp), http=True)
            if args.soak_s > 0:
                results["soak"] = _soak(server, specs[models[0]], models[0], found, args.soak_s, Path(tmp))
        finally:
            server.stop()
            if floor is not None:
                floor.stop()
    for model in models:
        data = results["models"][model]
        rounds = data["rounds"]
        for side in ("in_process", "server", "floor"):
            data[side] = _median_levels([got[side] for got in rounds])
        data["derived"] = _derived_summary([got["derived"] for got in rounds])
    results["load_after"] = os.getloadavg()

    _print_table(results)
    args.output.mkdir(parents=True, exist_ok=True)
    (args.output / "bench.json").write_text(json.dumps(results, indent=2))
    _plot(results, args.output / "bench.png")
    print(f"wrote {args.output / 'bench.json'} and {args.output / 'bench.png'}")
    return 0


def _derived_summary(rounds: list[dict]) -> dict:
    """The derived goals over the rounds: the median of each round's own ratio (each against
    its own round's floor and in-process figures), and the verdict on it."""
    summary = {}
    c32 = [d["c32"] for d in rounds if "c32" in d]
    if c32:
        of_ideal = _median([d["of_ideal"] for d in c32])
        summary["c32"] = {"of_ideal_per_round": [d["of_ideal"] for d in c32], "of_ideal": of_ideal,
                          "goal_of_ideal": 0.9, "met": of_ideal >= 0.9,
                          "goal_requests_per_s": _median([d["goal_requests_per_s"] for d in c32]),
                          "requests_per_s": _median([d["requests_per_s"] for d in c32])}
    c1 = [d["c1"] for d in rounds if "c1" in d]
    if c1:
        added = _median([d["added_ms"] for d in c1])
        summary["c1"] = {"added_ms_per_round": [d["added_ms"] for d in c1], "added_ms": added,
                         "goal_added_ms": 0.1, "met": added <= 0.1,
                         "goal_p50_ms": _median([d["goal_p50_ms"] for d in c1]),
                         "p50_ms": _median([d["p50_ms"] for d in c1])}
    return summary


def _soak(server: _Server, spec, model: str, found, seconds: float, workdir: Path) -> dict:
    """Concurrency 32 for `seconds`, in windows of 10 s, the server's RSS after each."""
    samples = []
    started = time.monotonic()
    while time.monotonic() - started < seconds:
        if found:
            got = perf_analyzer.run(*found, server.address, model, (spec.query_dim, spec.kv_dim), SHAPES[model],
                                    32, 5.0, workdir, spec.version)
        else:
            got = loadgen.run(server.address, model, (spec.query_dim, spec.kv_dim), SHAPES[model], 32, 10.0)
        samples.append({"t_s": round(time.monotonic() - started, 1), "rss_mb": _rss_mb(server.proc.pid),
                        "requests_per_s": got["requests_per_s"]})
        print(f"  soak t={samples[-1]['t_s']:.0f}s rss={samples[-1]['rss_mb']:.1f} MB "
              f"{got['requests_per_s']:.0f} req/s", flush=True)
    rss = [s["rss_mb"] for s in samples]
    return {"seconds": seconds, "samples": samples, "rss_first_mb": rss[0], "rss_last_mb": rss[-1],
            "rss_max_mb": max(rss)}


def _print_table(results: dict) -> None:
    for model, data in results["models"].items():
        inproc = data["in_process"]
        b1_ms = inproc[1]["ms_per_call"]
        b32 = inproc[32]["requests_per_s"]
        floor = data.get("floor", {})
        print(f"\n{model}: request = {data['shape']}")
        print("  in-process ONNX Runtime (requests merged per run): " + ", ".join(
            f"{k}: {v['requests_per_s']:,.0f}/s ({v['ms_per_call']:.2f} ms)" for k, v in inproc.items()))
        blocks = [("ModelInfer", data["server"])]
        if data.get("server_streaming"):
            blocks.append(("ModelStreamInfer", data["server_streaming"]))
        if data.get("server_http"):
            blocks.append(("REST: POST /v2/models/{m}/infer, binary tensor data (perf_analyzer -i http)",
                           data["server_http"]))
        if floor:
            blocks.append(("floor: same stack, no model (bench.floor), ModelInfer", floor))
        for title, rows in blocks:
            print(f"  {title}")
            print(f"  {'conc':>4} {'req/s':>8} {'p50 ms':>7} {'p99 ms':>7} {'÷ in-proc b32':>13} "
                  f"{'p50 ÷ b1 call':>13} {'p99/p50':>7} {'RSS MB':>7} {'CPU ms/req':>10}")
            for c, s in rows.items():
                print(f"  {c:>4} {s['requests_per_s']:>8,.0f} {s['p50_ms']:>7.2f} {s['p99_ms']:>7.2f} "
                      f"{s['requests_per_s'] / b32:>13.2f} {s['p50_ms'] / b1_ms:>13.2f} "
                      f"{s['p99_ms'] / s['p50_ms']:>7.2f} {s['server_rss_mb']:>7.0f} "
                      f"{s.get('server_cpu_ms_per_request', float('nan')):>10.2f}")
        servers = data["server"]
        if 32 in servers:
            s = servers[32]
            print(f"  goal c32 throughput >= 0.40 x in-process b32: {s['requests_per_s'] / b32:.2f} "
                  f"{'met' if s['requests_per_s'] / b32 >= 0.40 else 'NOT met'}; "
                  f"p99 < 3 x p50: {s['p99_ms'] / s['p50_ms']:.2f} "
                  f"{'met' if s['p99_ms'] < 3 * s['p50_ms'] else 'NOT met'}")
            if 32 in floor:
                print(f"    the floor (no model at all) reaches {floor[32]['requests_per_s'] / b32:.2f} x; "
                      f"the server has {s['requests_per_s'] / floor[32]['requests_per_s']:.2f} x the floor's "
                      "throughput")
        rest = data.get("server_http", {})
        for c in sorted(set(rest) & set(servers)):
            print(f"  REST vs gRPC at concurrency {c}: {rest[c]['requests_per_s']:,.0f} vs "
                  f"{servers[c]['requests_per_s']:,.0f} requests/s "
                  f"({rest[c]['requests_per_s'] / servers[c]['requests_per_s']:.2f} x), "
                  f"p50 {rest[c]['p50_ms']:.2f} vs {servers[c]['p50_ms']:.2f} ms, server CPU "
                  f"{rest[c]['server_cpu_ms_per_request']:.2f} vs "
                  f"{servers[c]['server_cpu_ms_per_request']:.2f} ms/request")
        _print_derived(data)
        if 1 in servers:
            ratio = servers[1]["p50_ms"] / b1_ms
            print(f"  goal c1 p50 <= 3 x in-process b1 call: {ratio:.2f} {'met' if ratio <= 3 else 'NOT met'}")
            if 1 in floor:
                print(f"    the floor's p50 alone is {floor[1]['p50_ms'] / b1_ms:.2f} x the b1 call; the server adds "
                      f"{servers[1]['p50_ms'] - floor[1]['p50_ms']:.2f} ms to it (the b1 call: {b1_ms:.2f} ms)")
    if "soak" in results:
        soak = results["soak"]
        print(f"\nsoak {soak['seconds']:.0f}s at concurrency 32: RSS first {soak['rss_first_mb']:.1f} MB, "
              f"last {soak['rss_last_mb']:.1f} MB, max {soak['rss_max_mb']:.1f} MB")
    host = results["machine"]
    print(f"\n{host['cpu_model']}, {host['cores']} cores; load average before {results['load_before'][0]:.2f}, "
          f"after {results['load_after'][0]:.2f}; medians of {results['rounds']} alternating rounds")


def _print_derived(data: dict) -> None:
    """Issue #17's goals: the server against its transport (the floor) plus its compute."""
    got = data.get("derived", {})
    if "c32" in got:
        d = got["c32"]
        print(f"  goal c32 >= 0.9 x 1/(1/floor + 1/in-process b32): {d['requests_per_s']:,.0f} vs goal "
              f"{d['goal_requests_per_s']:,.0f} req/s; {d['of_ideal']:.2f} x the ideal "
              f"(rounds: {', '.join(f'{x:.2f}' for x in d['of_ideal_per_round'])}) {'met' if d['met'] else 'NOT met'}")
    if "c1" in got:
        d = got["c1"]
        print(f"  goal c1 p50 <= floor p50 + b1 call + 0.1 ms: {d['p50_ms']:.2f} vs goal {d['goal_p50_ms']:.2f} ms; "
              f"adds {d['added_ms']:+.2f} ms to floor + b1 call (rounds: "
              f"{', '.join(f'{x:+.2f}' for x in d['added_ms_per_round'])}) {'met' if d['met'] else 'NOT met'}")


def _plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(results["models"])
    fig, axes = plt.subplots(2, len(models), figsize=(6 * len(models), 8), squeeze=False)
    for col, model in enumerate(models):
        data = results["models"][model]
        levels = list(data["server"])
        thr = [data["server"][c]["requests_per_s"] for c in levels]
        ax = axes[0][col]
        ax.plot(levels, thr, "o-", label="server, ModelInfer")
        for key, style, label in (("server_streaming", "^-", "server, ModelStreamInfer"),
                                  ("server_http", "s-", "server, REST (HTTP)"),
                                  ("floor", "x--", "floor: same stack, no model")):
            if data.get(key):
                ax.plot(list(data[key]), [v["requests_per_s"] for v in data[key].values()], style, label=label)
        ax.axhline(data["in_process"][32]["requests_per_s"], ls="--", color="gray", label="in-process, 32 per run")
        ax.axhline(0.4 * data["in_process"][32]["requests_per_s"], ls=":", color="red", label="goal: 0.40 x")
        ax.set(title=f"{model}: throughput", xlabel="concurrency", ylabel="requests/s", xscale="log")
        ax.legend()
        ax = axes[1][col]
        ax.plot(levels, [data["server"][c]["p50_ms"] for c in levels], "o-", label="p50")
        ax.plot(levels, [data["server"][c]["p99_ms"] for c in levels], "s-", label="p99")
        if data.get("floor"):
            ax.plot(list(data["floor"]), [v["p50_ms"] for v in data["floor"].values()], "x--", label="floor p50")
        ax.set(title=f"{model}: latency", xlabel="concurrency", ylabel="ms", xscale="log", yscale="log")
        ax.legend()
    fig.suptitle(f"attnserve vs in-process ONNX Runtime ({results['cores']} cores, {results['generator']})")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
