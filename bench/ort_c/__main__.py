"""`python -m bench.ort_c` (`make bench-ort-c`): ONNX Runtime from Python vs its C API, per batch.

    .venv/bin/python -m bench.ort_c                                  # both models, 3 rounds
    ORT_C_HEADERS=/path/to/headers .venv/bin/python -m bench.ort_c   # the first build needs the headers
    .venv/bin/python -m bench.ort_c --models self_attention --batches 1 --rounds 1 --seconds 0.1

Builds bench/ort_c/ort_c_bench.cc (bench.ort_c.build), checks its outputs against the Python
session's, measures (bench.ort_c.bench), writes JSON to --output and prints one line per case.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from attnserve.server.config import ServerConfig

from bench.__main__ import machine
from bench.inprocess import SHAPES
from bench.ort_c import bench

REPO_ROOT = Path(__file__).resolve().parents[2]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.ort_c", description=__doc__.splitlines()[0])
    parser.add_argument("--repository", type=Path, default=REPO_ROOT / "models")
    parser.add_argument("--models", default=",".join(SHAPES))
    parser.add_argument("--batches", default="1,2,32",
                        help="requests merged into one run (at c=32 the plane's batches held 2.4-2.7)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=0.2, help="per variant, case and round")
    parser.add_argument("--intra-op-threads", type=int, default=ServerConfig().intra_op_threads)
    parser.add_argument("--results", type=Path, default=REPO_ROOT / "bench" / "results",
                        help="where goals*.json are read (the plane's CPU per request)")
    parser.add_argument("--output", type=Path, default=REPO_ROOT / "bench" / "results" / "ort-c.json")
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.seconds <= 0:
        parser.error(f"--rounds must be >= 1 and --seconds > 0, got {args.rounds} and {args.seconds}")
    results = {"machine": machine(), **bench.run_benchmark(
        args.repository, tuple(args.models.split(",")), tuple(int(b) for b in args.batches.split(",")), args.rounds,
        args.seconds, args.intra_op_threads, args.results)}
    load = " ".join(f"{x:.2f}" for x in results["load_before"])
    print(f"bench.ort_c: onnxruntime {results['onnxruntime']['library']} (C API headers v"
          f"{results['onnxruntime']['header_api_version']}), {results['machine']['cores']} cores, load {load}")
    for name, case in results["cases"].items():
        med, over = case["median"], case["overhead_over_c_api"]
        print(f"  {name:32s} {case['graph']:18s} c_api {med['c_api']['wall_us']:9.1f} us wall "
              f"{med['c_api']['cpu_us']:9.1f} us cpu | over it: "
              + ", ".join(f"{v} {o['wall_us']:+.1f}/{o['cpu_us']:+.1f}" for v, o in over.items()))
    for model, levels in results["shares"].items():
        for level, share in [("c1", levels.get("c1")), *((f"c32 {b}", s) for b, s in levels.get("c32", {}).items())]:
            if share is not None:
                print(f"  {model} {level}: the engine's overhead is "
                      f"{share['saved_cpu_ms_per_request'] * 1e3:.1f} us CPU per request of the plane's "
                      f"{share['plane_cpu_ms_per_request'] * 1e3:.0f} us: "
                      f"{share['share_saved']:.1%}")
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(results, indent=1))
    print(f"bench.ort_c: {args.output}")


if __name__ == "__main__":
    main()
