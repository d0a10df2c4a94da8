"""bench.ort_c (issue 26: ONNX Runtime from Python or from its C API): the C++ program built
against the wheel's libonnxruntime computes what the Python session computes, a tiny real round
gives every figure, the shares are the arithmetic the docs state, and a bad command is refused
alone. No figure of speed is asserted: `make bench-ort-c` reports speed.

The wheel ships no C headers: where $ORT_C_HEADERS does not name them (and no earlier build left
them in build/ort_c/include), the tests that build skip, saying so (tests/conftest.py lets exactly
that skip through in CI)."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from bench.ort_c import bench, build
from tests.server_process import REPO_ROOT

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def binary():
    try:
        return build.build()
    except build.Unavailable as err:
        pytest.skip(str(err))


@pytest.fixture(scope="module")
def cases(model_repository):
    return bench.open_cases(model_repository, ("self_attention", "cross_attention"), (1,), 0)


def test_the_c_api_run_writes_what_the_python_session_computes(binary, cases, tmp_path):
    with bench.CProgram(binary) as program:
        library, header_api = program.ask("version").split()
        assert library.startswith(build.library().name.removeprefix("libonnxruntime.so."))
        assert int(header_api) == build.header_api_version()
        for case in cases:
            case.load_into(program, tmp_path)
            errors = bench.check_parity(case, program, tmp_path)
            assert set(errors) == set(case.outputs)
            # The outputs are preallocated: a run that left them untouched would read back zeros.
            assert all(e <= bench.PARITY_TOLERANCE for e in errors.values()), (case.name, errors)
    graphs = {(c.spec.name, c.want_probs): c.kind for c in cases}
    # Both graph families are covered: the unfused graph with probabilities, and each model's
    # output-only choice (self_attention's short run below the crossover, cross_attention's fused).
    assert graphs[("self_attention", True)] == graphs[("cross_attention", True)] == "all_outputs"
    assert graphs[("self_attention", False)] == "output_only"
    assert graphs[("cross_attention", False)] == "fused"


def test_one_tiny_round_gives_every_variant_its_figures(binary, cases, tmp_path):
    with bench.CProgram(binary) as program:
        for case in cases[:2]:  # self_attention's two graphs
            case.load_into(program, tmp_path)
        got = bench.measure(cases[:2], program, rounds=1, seconds=1e-6, min_calls=1, max_calls=1, warm_up=1)
    for case in cases[:2]:
        result = got[case.name]
        assert len(result["rounds"]) == 1 and set(result["rounds"][0]) == {*bench.VARIANTS, "load"}
        assert result["calls_per_round"] == 1
        for variant in bench.VARIANTS:
            figures = result["median"][variant]
            assert figures["wall_us"] > 0 and figures["cpu_us"] >= 0, (variant, figures)
        for variant in bench.PYTHON_VARIANTS:
            over = result["overhead_over_c_api"][variant]
            # One call each: the paired difference is the difference of the two calls.
            assert over["wall_us"] == pytest.approx(result["median"][variant]["wall_us"]
                                                    - result["median"]["c_api"]["wall_us"])
            assert over["cpu_us_per_round"] == [pytest.approx(result["median"][variant]["cpu_us"]
                                                              - result["median"]["c_api"]["cpu_us"])]


def test_a_bad_command_is_refused_alone_and_the_program_serves_on(binary, cases, tmp_path):
    with bench.CProgram(binary) as program:
        with pytest.raises(RuntimeError, match="no case"):
            program.ask("time nothing-opened 1")
        with pytest.raises(RuntimeError, match="open: .*"):  # ONNX Runtime's own message, not a crash
            program.ask(f"open broken 0 {tmp_path / 'missing.onnx'}")
        case = cases[0]
        case.load_into(program, tmp_path)
        with pytest.raises(RuntimeError, match="cannot read"):
            program.ask(f"input {case.name} query float32 {tmp_path / 'missing.bin'} 3 1 10 512")
        with pytest.raises(RuntimeError, match="calls must be >= 1"):
            program.ask(f"time {case.name} 0")
        assert json.loads(program.ask(f"time {case.name} 1"))["wall_ns"][0] > 0


def test_the_share_is_the_engine_overhead_per_request_over_the_plane_cpu(tmp_path):
    results = {
        "m-b32-probs": {"model": "m", "requests": 32, "want_probs": True,
                        "overhead_over_c_api": {"engine": {"cpu_us": 64.0}}},
        "m-b32-output": {"model": "m", "requests": 32, "want_probs": False,
                         "overhead_over_c_api": {"engine": {"cpu_us": 1e6}}},
        "m-b1-probs": {"model": "m", "requests": 1, "want_probs": True,
                       "overhead_over_c_api": {"engine": {"cpu_us": 50.0}}},
    }
    for i, (c1, c32) in enumerate(((1.0, 0.4), (0.8, 0.5), (0.6, 0.6))):
        goals = {"models": {"m": {"goals": {"native": {"cpu_c1": {"cpu_ms_per_req": c1},
                                                       "cpu_c32": {"cpu_ms_per_req": c32}}}}}}
        (tmp_path / f"goals-{i}.json").write_text(json.dumps(goals))
    (tmp_path / "other.json").write_text("{}")  # not a goals file: not read
    plane = bench.plane_cpu(tmp_path)
    assert plane == {"m": {"c1": [1.0, 0.8, 0.6], "c32": [0.4, 0.5, 0.6]}}
    got = bench.shares(results, plane)["m"]
    # c32, full batches: 64 us over 32 requests = 2 us of the median 0.5 ms per request; the
    # output-only case is not the goals' workload, so it gives no share.
    assert set(got["c32"]) == {"b32", "b1"}
    assert got["c32"]["b32"]["saved_cpu_ms_per_request"] == pytest.approx(0.002)
    assert got["c32"]["b32"]["share_saved"] == pytest.approx(0.002 / 0.5)
    assert got["c32"]["b1"]["share_saved"] == pytest.approx(0.05 / 0.5)
    assert got["c1"]["share_saved"] == pytest.approx(0.05 / 0.8)
    assert got["c1"]["plane_cpu_ms_per_request_sources"] == [1.0, 0.8, 0.6]


def test_the_headers_come_from_a_folder_or_a_git_directory(tmp_path, monkeypatch):
    monkeypatch.setattr(build, "BUILD", tmp_path / "build")
    monkeypatch.setattr(build, "INCLUDE", tmp_path / "build" / "include")
    with pytest.raises(build.Unavailable, match="ORT_C_HEADERS"):
        build.vendor_headers(str(tmp_path / "nowhere"))
    folder = tmp_path / "headers"
    folder.mkdir()
    (folder / build.MAIN_HEADER).write_text('#define ORT_API_VERSION 7\n#include "onnxruntime_error_code.h"\n')
    (folder / "onnxruntime_error_code.h").write_text("// included by it\n")
    (folder / "onnxruntime_wrapper.h").write_text("")  # another project's header beside them: not taken
    include = build.vendor_headers(str(folder))
    assert sorted(p.name for p in include.iterdir()) == ["onnxruntime_c_api.h", "onnxruntime_error_code.h"]
    assert build.header_api_version(include) == 7
    # A git directory (a fetched copy of a repository) whose HEAD keeps them where ONNX Runtime does.
    repo = tmp_path / "repo"
    where = repo / "include" / "onnxruntime" / "core" / "session"
    where.mkdir(parents=True)
    (where / build.MAIN_HEADER).write_text("#define ORT_API_VERSION 9\n")
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "add", "."], check=True)
    subprocess.run([*git, "commit", "-qm", "headers"], check=True)
    (where / build.MAIN_HEADER).unlink()  # only HEAD's copy can be read
    assert build.header_api_version(build.vendor_headers(str(repo / ".git"))) == 9
    monkeypatch.delenv(build.HEADERS_ENV, raising=False)
    assert build.vendor_headers() == build.INCLUDE  # a later build reuses what was vendored


def test_the_command_line_writes_its_json(binary, model_repository, tmp_path):
    out = tmp_path / "ort-c.json"
    done = subprocess.run([sys.executable, "-m", "bench.ort_c", "--repository", str(model_repository),
                           "--models", "self_attention", "--batches", "1", "--rounds", "1", "--seconds", "0.001",
                           "--results", str(tmp_path), "--output", str(out)],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(out.read_text())
    assert set(got["cases"]) == {"self_attention-b1-probs", "self_attention-b1-output"}
    assert all(e <= bench.PARITY_TOLERANCE for c in got["cases"].values() for e in c["parity_max_abs_error"].values())
    assert got["shares"] == {}  # no goals file in --results
    assert np.isfinite(got["cases"]["self_attention-b1-probs"]["median"]["c_api"]["wall_us"])
