"""ONNX Runtime from Python (as the native plane's runner calls it) against its C API, per batch.

For each model at its benchmark shape (bench.inprocess.SHAPES), 1, 2 and 32 requests merged into
a run, and both graphs a request takes there (attn_probs wanted, with the mask perf_analyzer sends:
the unfused graph; `output` alone without a mask: the graph server.graphs picks), in rounds where
the variants are interleaved call by call in a shuffled order, each variant's per-call wall and
process CPU time (the process's: ONNX Runtime's pool threads included):

    engine      Engine.run(feeds, want_probs, stop=RunStop()): the plane's runner's call, whole
    run         InferenceSession.run(None, feeds, RunOptions()) on the graph's feeds (engine._run)
    ort_values  run_with_ort_values over OrtValues made from the numpy feeds, outputs to numpy
    io_binding  bound numpy inputs and preallocated outputs (engine._run_into)
    c_api       bench/ort_c/ort_c_bench.cc, a process of its own: the C API's Run over tensors that
                view the caller's memory, outputs preallocated (what the plane would do in C++)

Every variant runs on a session of its own opened with server.engine.session_options (the C
program opens its own with the same options), so they compute the same thing: `check_parity`
compares the C program's outputs with the Python session's.
Per-batch overhead of a variant: the median of its paired per-call differences from c_api in each
round (the variants interleaved call by call), then the median over rounds.
docs/performance.md (bench.ort_c) has the method, docs/record/native-plane.md ("ONNX Runtime from C++ or
from Python") the figures.
"""

from __future__ import annotations

import json
import os
import random
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnxruntime as ort
from attnserve.server.config import ServerConfig
from attnserve.server.engine import CPU, DeviceChoice, Engine, _aligned_empty, _graph_feeds, session_options
from attnserve.server.repository import ModelSpec, read_model_spec
from attnserve.server.tensors import RunStop

from bench.inprocess import SHAPES
from bench.ort_c import build

PYTHON_VARIANTS = ("engine", "run", "ort_values", "io_binding")
VARIANTS = (*PYTHON_VARIANTS, "c_api")
PARITY_TOLERANCE = 1e-6
_DTYPES = {np.dtype(np.float32): "float32", np.dtype(np.bool_): "bool", np.dtype(np.int32): "int32"}


class CProgram:
    """bench/ort_c/ort_c_bench.cc as a child process, one command a line (its header comment)."""

    def __init__(self, binary: Path) -> None:
        self._proc = subprocess.Popen([str(binary)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                      bufsize=1)

    def ask(self, line: str) -> str:
        """The answer to one command; RuntimeError with the program's reason if it failed."""
        self._proc.stdin.write(line + "\n")
        self._proc.stdin.flush()
        answer = self._proc.stdout.readline()
        if not answer:
            raise RuntimeError(f"ort_c_bench exited ({self._proc.wait(timeout=10)}) at {line.split()[0]!r}")
        status, _, rest = answer.rstrip("\n").partition(" ")
        if status != "ok":
            raise RuntimeError(f"ort_c_bench: {line.split()[0]}: {rest}")
        return rest

    def close(self) -> None:
        if self._proc.poll() is None:
            try:
                self._proc.stdin.write("quit\n")
                self._proc.stdin.close()
                self._proc.wait(timeout=30)
            except (OSError, subprocess.TimeoutExpired):
                self._proc.kill()
                self._proc.wait()
        self._proc.stdout.close()

    def __enter__(self) -> CProgram:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


@dataclass
class Case:
    """One run's shape and graph: `requests` requests of the model's benchmark shape merged."""

    spec: ModelSpec
    requests: int
    want_probs: bool
    engine: Engine
    engine_threads: int = 0  # intra-op threads of every session here (0: one per core, the server's default)
    session: ort.InferenceSession = field(init=False)  # the run variant's (parity is checked against it)
    sessions: dict[str, ort.InferenceSession] = field(init=False)
    feeds: dict[str, np.ndarray] = field(init=False)  # as the plane hands them to the engine
    graph_feeds: dict[str, np.ndarray] = field(init=False)  # as the engine hands them to ONNX Runtime
    kind: str = field(init=False)
    outputs: dict[str, tuple[int, ...]] = field(init=False)  # name -> shape, in the graph's order

    def __post_init__(self) -> None:
        shape = SHAPES[self.spec.name]
        rows = shape.batch * self.requests
        rng = np.random.default_rng(self.requests)
        self.feeds = {
            "query": rng.standard_normal((rows, shape.q_len, self.spec.query_dim), dtype=np.float32),
            "key": rng.standard_normal((rows, shape.k_len, self.spec.kv_dim), dtype=np.float32),
            "value": rng.standard_normal((rows, shape.k_len, self.spec.kv_dim), dtype=np.float32),
        }
        if self.want_probs:  # perf_analyzer's requests (bench.goals) send a mask and want both outputs
            self.feeds["mask"] = np.ones((rows, shape.q_len, shape.k_len), np.bool_)
        self.kind = self.engine.graph_for(self.feeds, self.want_probs)
        # The engine's own feed rule, so both sides run exactly what the plane's run would.
        self.graph_feeds = {n: np.ascontiguousarray(a) for n, a in _graph_feeds(self.kind, self.feeds).items()}
        # A session per variant, as the engine and the C program have their own: a run right after
        # another on the same session finds its weights in cache, which would favour those variants.
        self.sessions = {variant: ort.InferenceSession(str(self.spec.graph_path(self.kind)),
                                                       sess_options=session_options(self.engine_threads),
                                                       providers=[CPU])
                         for variant in PYTHON_VARIANTS if variant != "engine"}
        self.session = self.sessions["run"]
        got = self.session.run(None, self.graph_feeds)
        self.outputs = {o.name: a.shape for o, a in zip(self.session.get_outputs(), got, strict=True)}

    @property
    def name(self) -> str:
        return f"{self.spec.name}-b{self.requests}-{'probs' if self.want_probs else 'output'}"

    def python_calls(self) -> dict[str, Callable[[], object]]:
        """Each Python variant as a no-argument call (module docstring)."""
        sessions, feeds, graph_feeds = self.sessions, self.feeds, self.graph_feeds
        names = list(self.outputs)
        into = {name: _aligned_empty(shape) for name, shape in self.outputs.items()}

        def engine() -> object:
            return self.engine.run(feeds, self.want_probs, stop=RunStop())

        def run() -> object:
            return sessions["run"].run(None, graph_feeds, ort.RunOptions())

        def ort_values() -> object:
            values = {n: ort.OrtValue.ortvalue_from_numpy(a) for n, a in graph_feeds.items()}
            return [v.numpy() for v in sessions["ort_values"].run_with_ort_values(names, values, ort.RunOptions())]

        def io_binding() -> object:
            binding = sessions["io_binding"].io_binding()
            for n, a in graph_feeds.items():
                binding.bind_cpu_input(n, a)
            for n, target in into.items():
                binding.bind_output(n, "cpu", 0, np.float32, list(target.shape), target.ctypes.data)
            sessions["io_binding"].run_with_iobinding(binding, ort.RunOptions())
            return into

        return {"engine": engine, "run": run, "ort_values": ort_values, "io_binding": io_binding}

    def load_into(self, program: CProgram, workdir: Path) -> None:
        """Open this case in the C program: the same graph, options, feeds and output shapes."""
        program.ask(f"open {self.name} {self.engine_threads} {self.spec.graph_path(self.kind)}")
        for name, array in self.graph_feeds.items():
            path = workdir / f"{self.name}.{name}.bin"
            array.tofile(path)
            program.ask(f"input {self.name} {name} {_DTYPES[array.dtype]} {path} {array.ndim} "
                        + " ".join(map(str, array.shape)))
        for name, shape in self.outputs.items():
            program.ask(f"output {self.name} {name} {len(shape)} " + " ".join(map(str, shape)))


def open_cases(repository: Path, models: tuple[str, ...], batches: tuple[int, ...],
               intra_op_threads: int) -> list[Case]:
    """Every (model, requests per run, probs or not) case, each model's Engine opened once."""
    config = ServerConfig()
    cases = []
    for model in models:
        spec = read_model_spec(repository / model)
        engine = Engine(spec, DeviceChoice((CPU,), None), intra_op_threads, chunk_rows=config.chunk_query_rows)
        for requests in batches:
            for want_probs in (True, False):
                cases.append(Case(spec, requests, want_probs, engine, engine_threads=intra_op_threads))
    return cases


def check_parity(case: Case, program: CProgram, workdir: Path) -> dict[str, float]:
    """The C run's outputs against the Python session's on the same feeds: max |difference| per
    output; AssertionError past PARITY_TOLERANCE."""
    program.ask(f"dump {case.name} {workdir}")
    expected = dict(zip(case.outputs, case.session.run(None, case.graph_feeds), strict=True))
    errors = {}
    for name, shape in case.outputs.items():
        got = np.fromfile(workdir / f"{name}.bin", dtype=np.float32).reshape(shape)
        errors[name] = float(np.max(np.abs(got - expected[name])))
        if not errors[name] <= PARITY_TOLERANCE:
            raise AssertionError(f"{case.name}: the C API's {name} differs from the Python session's by "
                                 f"{errors[name]} (tolerance {PARITY_TOLERANCE})")
    return errors


def _time_python(call: Callable[[], object], calls: int) -> tuple[list[int], list[int]]:
    wall, cpu = [], []
    for _ in range(calls):
        w0, c0 = time.perf_counter_ns(), time.process_time_ns()
        call()
        c1, w1 = time.process_time_ns(), time.perf_counter_ns()
        wall.append(w1 - w0)
        cpu.append(c1 - c0)
    return wall, cpu


def _time_c(program: CProgram, case: Case, calls: int) -> tuple[list[int], list[int]]:
    got = json.loads(program.ask(f"time {case.name} {calls}"))
    return got["wall_ns"], got["cpu_ns"]


def measure(cases: list[Case], program: CProgram, rounds: int, seconds: float, min_calls: int = 3,
            max_calls: int = 400, warm_up: int = 3) -> dict[str, dict]:
    """Rounds over `cases`, the variants interleaved call by call (call i of each, in a shuffled
    order), so that a variant's overhead over c_api is the median of
    paired differences, which a loaded machine's drift moves far less than it moves either side.
    Returns {case: {"graph", ..., "rounds": [{variant: figures}], "median": {variant: figures},
    "overhead_over_c_api": {variant: figures}}}, figures in µs; `seconds`: per variant, case and round."""
    results = {}
    calls = {}
    for case in cases:  # warm every side, and size the rounds to `seconds` a variant
        timed = {name: _time_python(call, warm_up) for name, call in case.python_calls().items()}
        timed["c_api"] = _time_c(program, case, warm_up)
        per_call_s = sum(statistics.median(wall) for wall, _ in timed.values()) / 1e9 / len(VARIANTS)
        calls[case.name] = max(min_calls, min(max_calls, int(seconds / max(per_call_s, 1e-6))))
        shape = SHAPES[case.spec.name]
        results[case.name] = {"model": case.spec.name, "requests": case.requests,
                              "rows": case.feeds["query"].shape[0], "q_len": shape.q_len, "k_len": shape.k_len,
                              "want_probs": case.want_probs, "graph": case.kind,
                              "file": case.spec.graph_path(case.kind).name, "calls_per_round": calls[case.name],
                              "rounds": []}
    rng = random.Random(0)
    for _round in range(rounds):
        for case in cases:
            python = case.python_calls()
            wall: dict[str, list[int]] = {v: [] for v in VARIANTS}
            cpu: dict[str, list[int]] = {v: [] for v in VARIANTS}
            for _ in range(calls[case.name]):
                order = list(VARIANTS)
                rng.shuffle(order)  # no variant always follows the same one (what ran before warms or cools it)
                for variant in order:
                    w, c = _time_c(program, case, 1) if variant == "c_api" else _time_python(python[variant], 1)
                    wall[variant] += w
                    cpu[variant] += c
            got = {}
            for variant in VARIANTS:
                got[variant] = {"wall_us": statistics.median(wall[variant]) / 1e3,
                                "cpu_us": statistics.median(cpu[variant]) / 1e3}
                if variant != "c_api":  # the paired differences' medians
                    got[variant]["over_c_api_wall_us"] = statistics.median(
                        a - b for a, b in zip(wall[variant], wall["c_api"], strict=True)) / 1e3
                    got[variant]["over_c_api_cpu_us"] = statistics.median(
                        a - b for a, b in zip(cpu[variant], cpu["c_api"], strict=True)) / 1e3
            got["load"] = os.getloadavg()[0]
            results[case.name]["rounds"].append(got)
    for result in results.values():
        per_round = result["rounds"]
        result["median"] = {v: {k: statistics.median(r[v][k] for r in per_round) for k in ("wall_us", "cpu_us")}
                            for v in VARIANTS}
        result["overhead_over_c_api"] = {}
        for variant in PYTHON_VARIANTS:
            over = {k: [r[variant][f"over_c_api_{k}"] for r in per_round] for k in ("wall_us", "cpu_us")}
            result["overhead_over_c_api"][variant] = {
                "wall_us": statistics.median(over["wall_us"]), "cpu_us": statistics.median(over["cpu_us"]),
                "wall_us_per_round": over["wall_us"], "cpu_us_per_round": over["cpu_us"]}
    return results


def plane_cpu(results_dir: Path) -> dict[str, dict[str, list[float]]]:
    """The native plane's CPU ms per request by model and concurrency ("c1", "c32"), one figure
    per bench/results/goals*.json that has it (their medians over rounds)."""
    found: dict[str, dict[str, list[float]]] = {}
    for path in sorted(results_dir.glob("goals*.json")):
        models = json.loads(path.read_text()).get("models", {})
        for model, got in models.items():
            goals = got.get("goals", {}).get("native", {})
            for level in ("c1", "c32"):
                figure = goals.get(f"cpu_{level}", {}).get("cpu_ms_per_req")
                if figure is not None:
                    found.setdefault(model, {}).setdefault(level, []).append(figure)
    return found


def shares(results: dict[str, dict], plane: dict[str, dict[str, list[float]]]) -> dict[str, dict]:
    """What moving the run into C++ would save of a request's CPU on the native plane: the
    engine's per-batch CPU overhead over the C API, spread over the batch's requests, against the
    plane's CPU per request (median of the goals files' figures).
    {model: {"c1": figures of the 1-request run, "c32": {"b<k>": figures of each k-request run}}}:
    at c=32 the plane's batches held 2.4-2.7 requests (docs/record/native-plane.md, its counters),
    so the share there is read at the measured k nearest that, and at k=32 (full batches)."""
    out: dict[str, dict] = {}
    for result in results.values():
        if not result["want_probs"]:  # the goals' requests want attn_probs (bench.goals, perf_analyzer)
            continue
        model, k = result["model"], result["requests"]
        overhead_ms = result["overhead_over_c_api"]["engine"]["cpu_us"] / 1e3
        for level in ("c1", "c32"):
            figures = plane.get(model, {}).get(level)
            if not figures or (level == "c1" and k != 1):
                continue
            plane_ms = statistics.median(figures)
            share = {"engine_overhead_cpu_ms_per_batch": overhead_ms, "requests_per_batch": k,
                     "saved_cpu_ms_per_request": overhead_ms / k, "plane_cpu_ms_per_request": plane_ms,
                     "plane_cpu_ms_per_request_sources": figures, "share_saved": overhead_ms / k / plane_ms}
            if level == "c1":
                out.setdefault(model, {})["c1"] = share
            else:
                out.setdefault(model, {}).setdefault("c32", {})[f"b{k}"] = share
    return out


def run_benchmark(repository: Path, models: tuple[str, ...], batches: tuple[int, ...], rounds: int, seconds: float,
                  intra_op_threads: int, results_dir: Path, headers: str | None = None) -> dict:
    """Build, open, check parity, measure: the whole of `make bench-ort-c`'s JSON."""
    binary = build.build(headers)
    load_before = os.getloadavg()
    cases = open_cases(repository, models, batches, intra_op_threads)
    with CProgram(binary) as program, tempfile.TemporaryDirectory(prefix="ort-c-") as tmp:
        workdir = Path(tmp)
        library_version, header_api = program.ask("version").split()
        for case in cases:
            case.load_into(program, workdir)
        parity = {case.name: check_parity(case, program, workdir) for case in cases}
        results = measure(cases, program, rounds, seconds)
    for name, errors in parity.items():
        results[name]["parity_max_abs_error"] = errors
    return {
        "onnxruntime": {"python": ort.__version__, "library": library_version, "header_api_version": int(header_api),
                        "library_file": build.library().name},
        "intra_op_threads": intra_op_threads, "rounds": rounds, "seconds": seconds,
        "load_before": load_before, "cases": results,
        "shares": shares(results, plane_cpu(results_dir)), "load_after": os.getloadavg(),
    }
