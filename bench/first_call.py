"""`python -m bench.first_call`: the first calls after readiness against steady state, with and
without warm-up (server.warmup; docs/performance.md, "Warm-up: first calls after ready").

For each --warmup mode, a fresh server per round: once its ready file is written, each probe (a
request shape that takes one graph; the first one per model absorbs the request path's own first
use) is sent once (its first call), then `--calls` more times (steady state: their median). The
ratio first / steady is what a caller right after readiness pays. Writes bench/results/first-call.json; prints a table.

    python -m bench.first_call --repository models [--rounds 2] [--calls 15]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from attnserve.client import InferenceClient
from attnserve.server.repository import read_model_spec

from bench.__main__ import _Server, machine

MODELS = ("self_attention", "cross_attention")
MODES = ("graphs", "none")


def probes(spec) -> dict[str, tuple[int, str, tuple[str, ...]]]:
    """name -> (length, mask kind, outputs), in the order sent: the model's very first call (its
    request path's first use, at a length the warm-up did not run: with --warmup graphs the
    warm-up's request has been down that path), then one call per graph: a short call, one at
    the crossover (where the fused graph takes over; the warm-up's long length), one with a key
    padding mask, one asking for attn_probs."""
    crossover = max((n for _k, n in spec.crossover), default=0)
    long = crossover if crossover > 16 else 512
    return {"model's first call, L=8": (8, "none", ("output",)), "short": (16, "none", ("output",)),
            f"crossover L={long}": (long, "none", ("output",)),
            "short, key padding mask": (16, "key_padding", ("output",)),
            "short, attn_probs": (16, "none", ("output", "attn_probs"))}


def _inputs(spec, length: int, mask: str, rng: np.random.Generator) -> dict:
    x = {"query": rng.standard_normal((1, length, spec.query_dim), dtype=np.float32),
         "key": rng.standard_normal((1, length, spec.kv_dim), dtype=np.float32),
         "value": rng.standard_normal((1, length, spec.kv_dim), dtype=np.float32)}
    if mask == "key_padding":  # every query row alike: the key padding graph
        keys = np.ones(length, np.bool_)
        keys[length // 2:] = False
        x["mask"] = np.broadcast_to(keys, (1, length, length)).copy()
    return x


def measure(server: _Server, specs: dict, calls: int) -> dict:
    rng = np.random.default_rng(0)
    got: dict = {}
    with InferenceClient(server.address) as client:
        client.server_ready()  # the connection is open before the first inference
        for model, spec in specs.items():
            for name, (length, mask, outputs) in probes(spec).items():
                x = _inputs(spec, length, mask, rng)
                times = []
                for _ in range(calls + 1):
                    started = time.perf_counter()
                    client.infer(model, x["query"], x["key"], x["value"], x.get("mask"), outputs=outputs)
                    times.append((time.perf_counter() - started) * 1000)
                steady = statistics.median(times[1:])
                got.setdefault(model, {})[name] = {"first_ms": round(times[0], 3), "steady_ms": round(steady, 3),
                                                   "ratio": round(times[0] / steady, 2)}
    return got


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.first_call", description=__doc__.split("\n\n")[0])
    parser.add_argument("--repository", type=Path, default=Path("models"))
    parser.add_argument("--rounds", type=int, default=2, help="fresh servers per mode")
    parser.add_argument("--calls", type=int, default=15, help="calls after the first, per probe (steady state)")
    parser.add_argument("--output", type=Path, default=Path(__file__).parent / "results")
    args, server_args = parser.parse_known_args(argv)
    specs = {m: read_model_spec(args.repository / m) for m in MODELS}
    results: dict = {"machine": machine(), "load_before": os.getloadavg(), "server_args": server_args,
                     "calls": args.calls, "rounds": args.rounds, "modes": {}}
    with tempfile.TemporaryDirectory(prefix="attnserve-first-call-") as tmp:
        for r in range(args.rounds):
            for mode in MODES:  # alternating, so that both see the machine's load
                workdir = Path(tmp) / f"{mode}-{r}"
                workdir.mkdir()
                server = _Server(args.repository, ["--warmup", mode, *server_args], workdir)
                try:
                    round_ = {"time_to_ready": server.time_to_ready(), "probes": measure(server, specs, args.calls)}
                finally:
                    server.stop()
                results["modes"].setdefault(mode, []).append(round_)
                print(f"round {r + 1}, --warmup {mode}: ready in {round_['time_to_ready']['process_s']:.2f}s",
                      flush=True)
    results["load_after"] = os.getloadavg()
    results["summary"] = summary = {
        mode: {model: {name: {key: statistics.median(rd["probes"][model][name][key] for rd in rounds)
                              for key in ("first_ms", "steady_ms", "ratio")}
                       for name in rounds[0]["probes"][model]}
               for model in MODELS}
        for mode, rounds in results["modes"].items()}
    print(f"\nfirst call after ready vs steady state (median of {args.calls}), medians of {args.rounds} fresh "
          f"servers; load {results['load_before'][0]:.2f} -> {results['load_after'][0]:.2f}")
    for model in MODELS:
        print(f"\n{model}")
        for name in summary["graphs"][model]:
            cells = [f"--warmup {mode}: {s['first_ms']:.2f} / {s['steady_ms']:.2f} ms = {s['ratio']:.2f}x"
                     for mode, s in ((m, summary[m][model][name]) for m in MODES)]
            print(f"  {name:26s} " + "   ".join(cells))
    args.output.mkdir(parents=True, exist_ok=True)
    (args.output / "first-call.json").write_text(json.dumps(results, indent=2))
    print(f"wrote {args.output / 'first-call.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
