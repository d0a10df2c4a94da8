"""Row chunks (server.engine, "Row chunks"; docs/scheduling.md, "Row chunks"): a long fused run is
computed a chunk of query rows at a time over key/value projected once, so a cancelled long run
stops within one chunk; the answers are those of the unchunked run.

Parity runs in process on the exported graphs (tests/conftest.py's repository); the stop is
measured on a real server, gated on its own metrics (attnserve_runs_in_flight) and its CPU time
from /proc: ratios within one test, never absolute times."""

from __future__ import annotations

import dataclasses
import time

import numpy as np
import pytest
import torch
from attnserve.proto import inference_pb2_grpc as pb_grpc
from attnserve.server.engine import Engine, choose_device
from attnserve.server.repository import read_model_spec
from attnserve.server.tensors import RunStop, RunStopped, Work, compute_batch

from attnserve import contract
from tests.export_helpers import old_layout
from tests.oip import infer_request
from tests.server_process import ServerProcess
from tests.test_cancellation import WAIT_S, _cancelled, _cpu_s, _metrics, _running, _sample, _wait_metric

MODEL = "self_attention"
CHUNK_ROWS = 48  # several chunks at the short lengths below, uneven ones too


def _engine(repository, name: str, chunk_rows: int) -> Engine:
    """An engine whose fused graphs run at every length (no crossover): long-run paths at test sizes."""
    spec = dataclasses.replace(read_model_spec(repository / name), crossover=())
    return Engine(spec, choose_device("cpu"), intra_op_threads=1, chunk_rows=chunk_rows)


@pytest.fixture(scope="module")
def engines(model_repository):
    return {name: (_engine(model_repository, name, CHUNK_ROWS), _engine(model_repository, name, 0))
            for name in ("self_attention", "cross_attention")}


def _inputs(spec, b: int, lq: int, lk: int, seed: int):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((b, lq, spec.query_dim), dtype=np.float32),
            rng.standard_normal((b, lk, spec.kv_dim), dtype=np.float32),
            rng.standard_normal((b, lk, spec.kv_dim), dtype=np.float32))


def _key_rows(b: int, lq: int, lk: int, seed: int) -> np.ndarray:
    """(b, lq, lk) bool whose rows are alike (a key mask: the key padding graph's), item 0's keys
    past a third masked."""
    keep = np.random.default_rng(seed).random((b, lk)) > 0.3
    keep[:, 0] = True
    keep[0, max(1, lk // 3):] = False
    return np.ascontiguousarray(np.broadcast_to(keep[:, None, :], (b, lq, lk)))


def _masks(b: int, h: int, lq: int, lk: int, seed: int) -> dict[str, np.ndarray | None]:
    """No mask, and a key mask in each of contract.MASK_SHAPES."""
    rows = _key_rows(b, lq, lk, seed)
    return {"none": None, "b_q_k": rows, "q_k": rows[0], "b_1_q_k": rows[:, None],
            "b_h_q_k": np.ascontiguousarray(np.broadcast_to(rows[:, None], (b, h, lq, lk)))}


def _eager(eager_modules, name, query, key, value, mask):
    with torch.no_grad():
        out, probs = eager_modules[name](torch.from_numpy(query), torch.from_numpy(key), torch.from_numpy(value),
                                         mask=None if mask is None else torch.from_numpy(mask))
    return out.numpy(), probs.numpy()


@pytest.mark.parametrize("name", ["self_attention", "cross_attention"])
@pytest.mark.parametrize("b,lq,lk", [(1, 200, 200), (2, 97, 77), (1, 300, 1)])
def test_chunked_answers_are_the_unchunked_ones(engines, eager_modules, name, b, lq, lk):
    chunked, whole = engines[name]
    spec = chunked.spec
    query, key, value = _inputs(spec, b, lq, lk, seed=lq + lk)
    for form, mask in _masks(b, spec.num_heads, lq, lk, seed=b + lq).items():
        for want_probs in (False, True):
            work = Work(query, key, value, mask, want_probs)
            before = chunked.row_chunks_run
            [(got, got_probs)], _, _ = compute_batch(chunked.run, [work])
            chunks = chunked.row_chunks_run - before
            [(ref, ref_probs)], _, _ = compute_batch(whole.run, [Work(query, key, value, mask, want_probs)])
            eager_out, eager_probs = _eager(eager_modules, name, query, key, value, mask)
            # attn_probs runs the unfused graph, never chunked; an output alone, the fused graph in chunks.
            assert chunks == (0 if want_probs else b * len(contract.row_chunks(lq, CHUNK_ROWS))), (form, want_probs)
            np.testing.assert_allclose(got, ref, rtol=0, atol=1e-5, err_msg=f"{form} probs={want_probs}")
            np.testing.assert_allclose(got, eager_out, rtol=0, atol=1e-5, err_msg=f"{form} probs={want_probs}")
            if want_probs:
                np.testing.assert_array_equal(got_probs, ref_probs)
                np.testing.assert_allclose(got_probs, eager_probs, rtol=0, atol=1e-5)


def test_a_merged_batch_with_padded_keys_is_chunked_per_item_exactly(engines, eager_modules):
    """Two requests of other lengths in one run: keys padded (the key padding graph), query rows
    padded; each request's rows are its own answer."""
    chunked, whole = engines[MODEL]
    spec = chunked.spec
    works = [Work(*_inputs(spec, 1, lq, lk, seed=lq), None, False) for lq, lk in ((130, 90), (61, 120))]
    before = chunked.row_chunks_run
    got, _, _ = compute_batch(chunked.run, works)
    assert chunked.row_chunks_run - before == 2 * len(contract.row_chunks(130, CHUNK_ROWS))
    ref, _, _ = compute_batch(whole.run, works)
    for w, (out, _), (want, _) in zip(works, got, ref, strict=True):
        np.testing.assert_allclose(out, want, rtol=0, atol=1e-5)
        np.testing.assert_allclose(out, _eager(eager_modules, MODEL, w.query, w.key, w.value, None)[0],
                                   rtol=0, atol=1e-5)


def test_a_chunked_run_writes_into_the_requests_own_output(engines):
    """A lone request's output destination (shared memory's path) is filled by the chunks themselves."""
    chunked, whole = engines[MODEL]
    spec = chunked.spec
    query, key, value = _inputs(spec, 1, 150, 150, seed=3)
    buffer = np.zeros(150 * spec.out_dim + 64, np.float32)
    offset = (-buffer.ctypes.data % 64) // 4
    into = buffer[offset:offset + 150 * spec.out_dim].reshape(1, 150, spec.out_dim)
    work = Work(query, key, value, None, False, output_into=into)
    [(out, _)], _, _ = compute_batch(chunked.run, [work], writes_into=True)
    assert out is None and work.written == "run"
    [(ref, _)], _, _ = compute_batch(whole.run, [Work(query, key, value, None, False)])
    np.testing.assert_allclose(into, ref, rtol=0, atol=1e-5)


def test_a_stopped_chunked_run_ends_between_chunks(engines):
    """A stop while a chunk computes: that chunk finishes, and no further chunk is started (not
    even to be ended by ONNX Runtime's terminate flag at its first node)."""
    chunked, _ = engines[MODEL]
    query, key, value = _inputs(chunked.spec, 1, 400, 400, seed=4)
    stop = RunStop()
    chunks = len(contract.row_chunks(400, CHUNK_ROWS))
    started = []

    class Counting:  # the real session; the test stops the run while its second chunk computes
        def __init__(self, session):
            self._session = session

        def __getattr__(self, attr):
            return getattr(self._session, attr)

        def run_with_iobinding(self, binding, options):
            started.append(binding)
            self._session.run_with_iobinding(binding, options)
            if len(started) == 2:
                stop.stop()

    original = chunked._row_sessions[contract.FUSED_ROWS]
    chunked._row_sessions[contract.FUSED_ROWS] = Counting(original)
    try:
        with pytest.raises(RunStopped):
            chunked.run({"query": query, "key": key, "value": value}, False, stop=stop)
    finally:
        chunked._row_sessions[contract.FUSED_ROWS] = original
    assert len(started) == 2 < chunks


def test_a_version_without_the_row_graphs_runs_unchunked(model_repository, tmp_path, eager_modules):
    old = old_layout(model_repository, MODEL, tmp_path)
    # The fused graphs back, the row-chunk graphs not: a version exported before them.
    for kind in contract.FUSED_KINDS:
        file = contract.GRAPH_FILES[kind]
        (old / MODEL / "1" / file).write_bytes((model_repository / MODEL / "1" / file).read_bytes())
    engine = _engine(old, MODEL, CHUNK_ROWS)
    assert "model_rows_kv.onnx not in version 1" in engine.why_no_row_chunks
    query, key, value = _inputs(engine.spec, 1, 200, 200, seed=5)
    out, _ = engine.run({"query": query, "key": key, "value": value}, False)
    assert engine.row_chunks_run == 0 and engine.runs[contract.FUSED] == 1
    np.testing.assert_allclose(out, _eager(eager_modules, MODEL, query, key, value, None)[0], rtol=0, atol=1e-5)


def test_the_export_proved_the_row_graphs(model_repository):
    import json

    record = json.loads((model_repository / MODEL / "1" / contract.EXPORT_FILE).read_text())
    assert record["row_graphs"] == contract.ROW_GRAPH_FILES
    errors = record["parity"]["max_abs_error"]
    for kind in (contract.FUSED_ROWS, contract.FUSED_ROWS_KEY_PADDING):
        assert 0 <= errors[kind]["output"] <= 1e-5


# -- a real server: the cancel stops a long run within a chunk --------------------------------

LONG = (1, 8192, 512)  # the longest accepted: eight chunks at the default chunk_query_rows
CANCEL_AT = 0.2  # of the run's full CPU cost: inside the attention (projections are a few %)
LEFT_AT_MOST = 0.3  # of the full cost, spent from the cancel to a second after the stop


def test_a_cancelled_long_solo_run_stops_within_a_chunk(model_repository):
    """The server's CPU time from the cancel (not the stop) to one second after the stop is a
    small part of what the whole run costs, measured in the same server just before. Without row
    chunks the cancel lands inside the one attention node and most of the run is still spent."""
    x = np.random.default_rng(28).standard_normal(LONG, dtype=np.float32)
    server = ServerProcess(model_repository, "--intra-op-threads", "2")
    try:
        pid = server.proc.pid
        with server.channel() as channel:
            stub = pb_grpc.GRPCInferenceServiceStub(channel)
            request = infer_request(MODEL, outputs=("output",), query=x, key=x, value=x)
            started = _cpu_s(pid)
            stub.ModelInfer(request, timeout=WAIT_S)
            full = _cpu_s(pid) - started
            _wait_metric(server, "attnserve_memory_reserved_bytes", 0)

            started = _cpu_s(pid)
            call = stub.ModelInfer.future(request, timeout=WAIT_S)
            _wait_metric(server, "attnserve_runs_in_flight", 1, model=MODEL)
            deadline = time.monotonic() + WAIT_S
            while _cpu_s(pid) - started < CANCEL_AT * full:  # the run's own progress, read from /proc
                assert time.monotonic() < deadline and _running(server) == 1, "the run ended before the cancel"
                time.sleep(0.005)
            at_cancel = _cpu_s(pid)
            call.cancel()
            _wait_metric(server, "attnserve_runs_in_flight", 0, model=MODEL)
            time.sleep(1.0)  # a measuring window after the stop, not a wait for a state
            spent = _cpu_s(pid) - at_cancel
            assert _cancelled(server, "client", "terminated") == 1  # stopped, not finished
            assert spent < LEFT_AT_MOST * full, (
                f"{spent:.2f} CPU s from the cancel to 1 s after the stop; the whole run cost {full:.2f}")
            _wait_metric(server, "attnserve_memory_reserved_bytes", 0)
            assert _sample(_metrics(server), "attnserve_requests_total", model=MODEL, code="OK") == 1
    finally:
        server.stop()


def test_row_graphs_of_other_widths_are_not_used(model_repository, tmp_path, eager_modules):
    """Another model's row-chunk graphs in this version (hand-made repositories): refused at load
    with the reason, and the version's long runs go unchunked, answered right."""
    import shutil

    shutil.copytree(model_repository / MODEL, tmp_path / MODEL)
    for file in contract.ROW_GRAPH_FILES.values():
        shutil.copy(model_repository / "cross_attention" / "1" / file, tmp_path / MODEL / "1" / file)
    engine = _engine(tmp_path, MODEL, CHUNK_ROWS)
    assert "model_rows_kv.onnx does not match config.json" in engine.why_no_row_chunks
    query, key, value = _inputs(engine.spec, 1, 100, 100, seed=6)
    out, _ = engine.run({"query": query, "key": key, "value": value}, False)
    assert engine.row_chunks_run == 0
    np.testing.assert_allclose(out, _eager(eager_modules, MODEL, query, key, value, None)[0], rtol=0, atol=1e-5)
