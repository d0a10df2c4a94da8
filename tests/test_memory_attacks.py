"""Legal traffic that used to push the server's memory without bound, against a server with a
stated --memory-limit-bytes (issue 12). Each case asserts: peak RSS <= idle RSS + limit + a stated
margin; every request answered (OK, exact, or a clear status; none lost, none hung); a known-good
request still exact afterwards; RSS back near idle within a few seconds after.

RSS comes from /proc (VmHWM is reset through /proc/PID/clear_refs before each case, so each case
has its own peak). Bounded in count; no time bound other than generous ones. Figures are printed
(`pytest -s`) and, when ATTNSERVE_FIGURES is set, appended to that file as JSON lines.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import time

import grpc
import numpy as np
from attnserve.proto import inference_pb2 as pb
from attnserve.proto import inference_pb2_grpc as pb_grpc

from tests.h2_client import RawGrpcClient
from tests.oip import eager, infer_request, outputs_of, random_inputs
from tests.server_process import ServerProcess

MIB = 1 << 20
TOLERANCE = 1e-5
INFER = "/inference.GRPCInferenceService/ModelInfer"
STREAM = "/inference.GRPCInferenceService/ModelStreamInfer"
# What the budget does not count: the interpreter's and allocator's slack. (Messages gRPC is still
# receiving, at most the gate's receive slots at once, each held twice at most, are added per case.)
SLACK = 96 * MIB
# RSS within this of idle once the work is over: memory went back.
BACK_NEAR_IDLE = 64 * MIB


def _rss(proc: ServerProcess) -> int:
    return proc.memory_kib("VmRSS") * 1024


def _reset_peak(proc: ServerProcess) -> None:
    proc.reset_memory_peak()


def _peak(proc: ServerProcess) -> int:
    return proc.memory_kib("VmHWM") * 1024


def _wait_near_idle(proc: ServerProcess, idle: int, timeout_s: float = 30.0) -> int:
    """RSS once it is within BACK_NEAR_IDLE of idle (a state), or after a generous timeout."""
    deadline = time.monotonic() + timeout_s
    while (rss := _rss(proc)) > idle + BACK_NEAR_IDLE and time.monotonic() < deadline:
        time.sleep(0.1)
    return rss


def _after_attack(proc: ServerProcess, eager_modules, name: str, limit: int, idle: int, counts: dict | None = None,
                  **figures) -> tuple[int, int]:
    """What every attack ends with: the peak RSS since _reset_peak, a known-good request still
    exact, RSS once back near idle, and the figures printed. Returns (peak, after)."""
    peak = _peak(proc)
    _known_good(proc, eager_modules)
    after = _wait_near_idle(proc, idle)
    _figures(name, limit=limit, idle=idle, peak=peak, peak_over_idle=peak - idle, after=after, **figures,
             **{k: v for k, v in (counts or {}).items() if k != "lost_details"})
    return peak, after


def _assert_bounded(peak: int, after: int, idle: int, limit: int, margin: int = SLACK) -> None:
    assert peak <= idle + limit + margin, (peak - idle) / MIB
    assert after <= idle + BACK_NEAR_IDLE, (
        f"RSS {after / MIB:.0f} MiB, idle {idle / MIB:.0f} MiB: memory did not go back")


def _figures(name: str, **values) -> None:
    figures = {"test": name, **values}
    print(f"\n{name}: {json.dumps(figures, sort_keys=True)}")
    if os.environ.get("ATTNSERVE_FIGURES"):
        with open(os.environ["ATTNSERVE_FIGURES"], "a") as f:
            f.write(json.dumps({"at": time.time(), **figures}, sort_keys=True) + "\n")


def _start(model_repository, limit: int, *args: str) -> tuple[ServerProcess, int]:
    proc = ServerProcess(model_repository, "--memory-limit-bytes", str(limit), "--intra-op-threads", "1", *args,
                         env={"MALLOC_ARENA_MAX": os.environ.get("T_ARENAS", "8")})
    return proc, _rss(proc)


def _warm(proc: ServerProcess, eager_modules) -> int:
    """One small request per model (sessions warm, buffers allocated); then the idle RSS."""
    _known_good(proc, eager_modules)
    return _rss(proc)


def _known_good(proc: ServerProcess, eager_modules) -> None:
    rng = np.random.default_rng(7)
    with proc.channel() as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        for model, dim in (("self_attention", 512), ("cross_attention", 32)):
            x = random_inputs(rng, 2, 9, 11, dim, dim, masked=True)
            got = outputs_of(stub.ModelInfer(infer_request(model, **x), timeout=60))
            want = eager(eager_modules[model], **x)
            for name in ("output", "attn_probs"):
                assert float(np.max(np.abs(got[name] - want[name]))) <= TOLERANCE


def _metrics_text(proc: ServerProcess) -> str:
    """The server's /metrics page."""
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{proc.metrics_port}/metrics", timeout=30) as response:
        return response.read().decode()


def _budget_metrics(proc: ServerProcess) -> dict[str, float]:
    """The memory budget's series on /metrics (server.metrics): name without the prefix -> value."""
    text = _metrics_text(proc)
    return {line.split()[0].removeprefix("attnserve_memory_"): float(line.split()[1])
            for line in text.splitlines() if line.startswith("attnserve_memory_")}


def _receive_metrics(proc: ServerProcess) -> dict[str, float]:
    """server.gate's receive slots on /metrics: slots, messages, deferred_total."""
    text = _metrics_text(proc)
    names = {"attnserve_receive_slots": "slots", "attnserve_receiving_messages": "messages",
             "attnserve_receive_deferred_total": "deferred_total"}
    return {names[line.split()[0]]: float(line.split()[1]) for line in text.splitlines()
            if line.split() and line.split()[0] in names}


def _settled_budget_metrics(proc: ServerProcess, timeout_s: float = 30.0) -> dict[str, float]:
    """The budget's series once nothing is reserved (a call's reservation goes back when the
    server has finished the call, which may be just after its client has the answer)."""
    deadline = time.monotonic() + timeout_s
    while (gauge := _budget_metrics(proc))["reserved_bytes"] != 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    return gauge


def _count(outcomes: list, wants: list | None = None) -> dict:
    """outcomes: (response or None, grpc code or None, details) per request."""
    counts = {"served": 0, "shed": 0, "refused": 0, "lost": 0, "lost_details": []}
    for i, (response, code, details) in enumerate(outcomes):
        if code is None:
            if wants is not None:
                got = outputs_of(response)
                for name, array in got.items():
                    assert float(np.max(np.abs(array - wants[i][name]))) <= TOLERANCE, (i, name)
            counts["served"] += 1
        elif code == grpc.StatusCode.RESOURCE_EXHAUSTED and "memory budget" in details:
            counts["shed"] += 1
            counts.setdefault("shed_example", details[:300])
        elif code == grpc.StatusCode.INVALID_ARGUMENT and "--memory-limit-bytes" in details:
            counts["refused"] += 1
        else:
            counts["lost"] += 1
            counts["lost_details"].append((str(code), details[:200]))
    return counts


def _concurrent(proc: ServerProcess, requests: list[pb.ModelInferRequest], timeout_s: float | None) -> list:
    def call(request):
        try:
            return stub.ModelInfer(request, timeout=timeout_s), None, ""
        except grpc.RpcError as err:
            return None, err.code(), err.details() or ""

    with proc.channel() as channel, concurrent.futures.ThreadPoolExecutor(len(requests)) as pool:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        # Connected first: calls opened before the server's SETTINGS arrive may pass its
        # MAX_CONCURRENT_STREAMS and be refused (REFUSED_STREAM, UNAVAILABLE: retryable).
        stub.ServerLive(pb.ServerLiveRequest(), timeout=30)
        return list(pool.map(call, requests))


# -- compute working set ---------------------------------------------------------------------


def test_a_request_that_can_never_fit_is_refused_naming_its_figure_and_one_that_fits_runs(model_repository,
                                                                                           eager_modules):
    limit = 224 * MIB
    proc, _ = _start(model_repository, limit)
    try:
        idle = _warm(proc, eager_modules)
        _reset_peak(proc)
        rng = np.random.default_rng(1)
        x = random_inputs(rng, 4, 512, 512, 512, 512)
        # A 32 MiB attention matrix; the run takes 4-7x that. With attn_probs its estimate (about
        # 270 MB) is over the limit; output alone (about 190 MB) fits.
        too_big = infer_request("self_attention", **x)
        fits = infer_request("self_attention", outputs=("output",), **x)
        outcomes = _concurrent(proc, [too_big], 120) + _concurrent(proc, [fits], 120)
        want = eager(eager_modules["self_attention"], **x)
        assert outcomes[0][1] == grpc.StatusCode.INVALID_ARGUMENT, outcomes[0][1:]
        assert f"{limit:,}" in outcomes[0][2] and "needs an estimated" in outcomes[0][2], outcomes[0][2]
        assert _budget_metrics(proc)["too_large_total"] == 1
        counts = _count(outcomes[1:], [{"output": want["output"]}])
        peak, after = _after_attack(proc, eager_modules, "memory_compute", limit, idle, counts)
        assert counts["served"] == 1 and counts["lost"] == 0, counts
        _assert_bounded(peak, after, idle, limit)
    finally:
        assert proc.stop() == 0, proc.log()[-3000:]


def test_refused_large_calls_leave_nothing_behind_before_any_collection(model_repository, eager_modules):
    """A refused call ends in context.abort, whose exception gRPC keeps in a reference cycle with
    the call's frames: if they still held the request, each refused 12.6 MB message would stay
    resident until the cyclic collector ran (and a budget never used runs no reclaim). 24 calls
    that can never fit, one after another: the peak stays within SLACK of idle (without the fix:
    idle + 232 MiB, with it 56 MiB), and RSS near idle at once."""
    limit = 64 * MIB
    proc, _ = _start(model_repository, limit)
    try:
        idle = _warm(proc, eager_modules)
        _reset_peak(proc)
        rng = np.random.default_rng(12)
        request = infer_request("self_attention", outputs=("output",), **random_inputs(rng, 4, 512, 512, 512, 512))
        outcomes = []
        with proc.channel() as channel:
            infer = channel.unary_unary(INFER, request_serializer=pb.ModelInferRequest.SerializeToString,
                                        response_deserializer=pb.ModelInferResponse.FromString)
            for _ in range(24):
                try:
                    infer(request, timeout=60)
                    outcomes.append(grpc.StatusCode.OK)
                except grpc.RpcError as err:
                    outcomes.append(err.code())
        rss, peak = _rss(proc), _peak(proc)  # no waiting: nothing is collected or trimmed for these
        _figures("memory_refused", limit=limit, idle=idle, rss_after=rss, rss_over_idle=rss - idle,
                 peak_over_idle=peak - idle)
        assert outcomes == [grpc.StatusCode.INVALID_ARGUMENT] * 24, outcomes
        assert peak <= idle + SLACK, (peak - idle) / MIB
        assert rss <= idle + BACK_NEAR_IDLE, (rss - idle) / MIB
        assert _budget_metrics(proc)["too_large_total"] == 24
        _known_good(proc, eager_modules)
    finally:
        assert proc.stop() == 0, proc.log()[-3000:]


# -- merging ---------------------------------------------------------------------------------


def test_merged_batches_stay_within_the_budget_and_waiting_requests_are_all_served(model_repository, eager_modules):
    limit = 256 * MIB
    proc, _ = _start(model_repository, limit)
    try:
        idle = _warm(proc, eager_modules)
        _reset_peak(proc)
        rng = np.random.default_rng(2)
        # 32 requests of (1, 1000, 32) over 1000 keys (0.4 MB each, an 8 MB attention matrix):
        # merged into one run they took 1.2-1.6 GB. With a deadline they wait for memory.
        xs = [random_inputs(rng, 1, 1000, 1000, 32, 32) for _ in range(32)]
        wants = [{"output": eager(eager_modules["cross_attention"], **x)["output"]} for x in xs]
        outcomes = _concurrent(proc, [infer_request("cross_attention", outputs=("output",), **x) for x in xs], 300)
        counts = _count(outcomes, wants)
        peak, after = _after_attack(proc, eager_modules, "memory_merging", limit, idle, counts)
        assert counts["served"] == 32 and counts["lost"] == 0, counts
        _assert_bounded(peak, after, idle, limit)
        gauge = _settled_budget_metrics(proc)  # they waited for memory, none shed; all given back
        assert gauge["limit_bytes"] == limit and gauge["waits_total"] >= 1 and gauge["shed_total"] == 0, gauge
        assert gauge["reserved_bytes"] == 0 and gauge["waiters"] == 0 and gauge["wait_timeouts_total"] == 0, gauge
    finally:
        assert proc.stop() == 0, proc.log()[-3000:]


# -- the documented overload -----------------------------------------------------------------

STREAMS = 16  # --max-concurrent-streams where a case sets it
CLIENTS = 64


def test_overload_without_deadlines_is_shed_at_once_within_the_budget(model_repository, eager_modules):
    limit = 512 * MIB
    proc, _ = _start(model_repository, limit)
    try:
        idle = _warm(proc, eager_modules)
        _reset_peak(proc)
        rng = np.random.default_rng(3)
        # 64 clients x (4, 512, 512), output only: 3.9 GB within seconds before. No deadline:
        # what does not fit now is shed at once.
        xs = [random_inputs(rng, 4, 512, 512, 512, 512) for _ in range(4)]
        wants = [{"output": eager(eager_modules["self_attention"], **x)["output"]} for x in xs]
        requests = [infer_request("self_attention", outputs=("output",), **xs[i % 4]) for i in range(CLIENTS)]
        outcomes = _concurrent(proc, requests, None)
        counts = _count(outcomes, [wants[i % 4] for i in range(CLIENTS)])
        # Messages gRPC is receiving are not in the budget: at most the gate's receive slots at
        # once, whose bound is --max-receiving-bytes (a quarter of the budget by default; without
        # the slots all 64, 806 MB, were received at once). Two messages held twice (50 MB) was
        # too tight: with both cores busy one run peaked at idle + 670 MiB (the allocator's
        # slack grows with 64 clients' buffers freed in another order); the slots themselves are
        # held to 2 messages by test_messages_being_received_are_bounded_by_the_receive_slots.
        margin = SLACK + limit // 4
        peak, after = _after_attack(proc, eager_modules, "memory_overload", limit, idle, counts, margin=margin,
                                    lost_examples=counts["lost_details"][:2])
        assert counts["lost"] == 0 and counts["served"] >= 1 and counts["shed"] >= 1, counts
        assert counts["served"] + counts["shed"] == CLIENTS
        _assert_bounded(peak, after, idle, limit, margin)
        gauge = _settled_budget_metrics(proc)  # every shed call counted; nothing held once all is answered
        assert gauge["shed_total"] == counts["shed"] and gauge["waits_total"] == 0, (gauge, counts)
        assert gauge["reserved_bytes"] == 0 and gauge["limit_bytes"] == limit, gauge
        receive = _receive_metrics(proc)
        assert receive["slots"] == 2 and receive["deferred_total"] >= 1, receive
    finally:
        assert proc.stop() == 0, proc.log()[-3000:]


def test_messages_being_received_are_bounded_by_the_receive_slots(model_repository, eager_modules):
    """32 ModelInfer calls on one connection each send all of a 12.6 MB message but its last 16
    bytes, and wait: none is complete, so none is parsed or in the budget. Only the receive slots'
    messages (a quarter of the budget / --max-message-bytes: 2) are let in; the others are held
    back by flow control at HTTP/2's initial window. (Without the slots, or with BDP probing,
    gRPC's core takes in all 32: 403 MB.) Then every message is completed: each is answered."""
    from tests.h2_client import grpc_frame

    limit = 512 * MIB
    calls = 32
    proc, _ = _start(model_repository, limit)
    try:
        idle = _warm(proc, eager_modules)
        _reset_peak(proc)
        rng = np.random.default_rng(10)
        x = random_inputs(rng, 4, 512, 512, 512, 512)
        want = {"output": eager(eager_modules["self_attention"], **x)["output"]}
        frame = grpc_frame(infer_request("self_attention", outputs=("output",), **x).SerializeToString())
        client = RawGrpcClient(proc.port)
        try:
            sids = []
            for _ in range(calls):
                sids.append(client.start_call(INFER, None))
                client.send_bytes(sids[-1], frame[:-16])
            # Until every call has sent all it may: all of it (but the last 16 bytes), or as much
            # as the server's flow control lets through (a state on the client's side).
            give_up = time.monotonic() + 300
            while not all(client.unsent_bytes(s) == 0 or client.window_blocked(s) for s in sids):
                assert time.monotonic() < give_up, "the calls neither went through nor were held back"
                assert not client.closed, "the server closed the connection"
                client.pump(0.05)
            let_in = sum(client.unsent_bytes(s) == 0 for s in sids)
            receive = _receive_metrics(proc)
            peak_held = _peak(proc)
            for s in sids:
                client.send_bytes(s, frame[-16:], end=True)
            client.open_window()
            _answers(client, sids, timeout_s=600)
        finally:
            client.close()
        outcomes = []
        for s in sids:
            call = client.calls[s]
            if call.status == 0:
                outcomes.append((pb.ModelInferResponse.FromString(call.messages[0]), None, ""))
            else:
                outcomes.append((None, grpc.StatusCode(_code(call.status)), call.message))
        counts = _count(outcomes, [want] * calls)
        peak, after = _after_attack(proc, eager_modules, "memory_receiving", limit, idle, counts,
                                    peak_while_held=peak_held, let_in=let_in, receive=receive)
        assert counts["lost"] == 0 and counts["served"] + counts["shed"] == calls, counts
        assert let_in <= 2 and receive["slots"] == 2, (let_in, receive)
        # What is held while the messages are incomplete: the slots' two messages (gRPC's core
        # holds each once) and the others' initial windows, beside the usual slack.
        assert peak_held <= idle + 2 * len(frame) + SLACK, (peak_held - idle) / MIB
        _assert_bounded(peak, after, idle, limit, SLACK + 2 * 2 * len(frame))
    finally:
        assert proc.stop() == 0, proc.log()[-3000:]


# -- answers nobody reads --------------------------------------------------------------------


def _answers(client: RawGrpcClient, sids: list[int], timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not all(client.calls[s].ended for s in sids):
        assert time.monotonic() < deadline, "calls not answered: one hangs"
        assert not client.closed, "the server closed the connection"
        client.pump(0.1)


def test_unary_answers_nobody_reads_are_held_back_by_flow_control_and_the_budget(model_repository, eager_modules):
    limit = 512 * MIB
    proc, _ = _start(model_repository, limit, "--max-concurrent-streams", str(STREAMS))
    try:
        idle = _warm(proc, eager_modules)
        _reset_peak(proc)
        rng = np.random.default_rng(4)
        x = random_inputs(rng, 2, 512, 512, 512, 512)
        want = eager(eager_modules["self_attention"], **x)
        message = infer_request("self_attention", **x).SerializeToString()  # a 19 MB answer each
        client = RawGrpcClient(proc.port)
        try:
            assert client.conn.remote_settings.max_concurrent_streams == STREAMS
            sids: list[int] = []
            refusals = 0  # REFUSED_STREAM at the stream limit (never seen by the server): retried
            # 40 calls on one connection that sends no WINDOW_UPDATE (the answers stop at 64 KiB).
            # Each is either answered at once (shed: headers only, not flow-controlled) or
            # computed and held, its answer stuck; new calls open as streams free up.
            deadline = time.monotonic() + 200
            while len(sids) < 40 or not all(client.calls[s].ended or client.calls[s].got_headers for s in sids):
                assert time.monotonic() < deadline, "the server neither answered nor held a call"
                if len(sids) < 40 and client.can_start():
                    sids.append(client.start_call(INFER, message))
                    continue
                open_sids = [s for s in sids if not client.calls[s].ended]
                if not client.can_start() and all(client.calls[s].got_headers for s in open_sids):
                    break  # every open stream holds a computed answer: HTTP/2 holds the client back
                client.pump(0.1)
            held = [s for s in sids if not client.calls[s].ended]
            peak_held = _peak(proc)
            client.open_window()  # now read everything, and let the rest through
            while True:
                retry = [s for s in sids if client.calls[s].refused]
                if len(sids) - len(retry) >= 40 and all(client.calls[s].ended for s in sids):
                    break
                if client.can_start() and (len(sids) - len(retry) < 40 or retry):
                    if retry:
                        sids.remove(retry[0])
                        refusals += 1
                    sids.append(client.start_call(INFER, message))
                client.pump(0.05)
            _answers(client, sids)
        finally:
            client.close()
        outcomes = []
        for s in sids:
            call = client.calls[s]
            if call.status == 0:
                response = pb.ModelInferResponse.FromString(call.messages[0])
                outcomes.append((response, None, ""))
            else:
                outcomes.append((None, grpc.StatusCode(_code(call.status)), call.message))
        counts = _count(outcomes, [want] * len(sids))
        margin = SLACK + 2 * 2 * len(message)  # 2 receive slots (a quarter of the budget / 64 MiB)
        peak, after = _after_attack(proc, eager_modules, "memory_unread_unary", limit, idle, counts,
                                    peak_while_held=peak_held, held=len(held), margin=margin, refusals=refusals)
        assert counts["lost"] == 0 and counts["served"] + counts["shed"] == 40, counts
        assert counts["shed"] >= 1, counts  # the budget, not only the stream limit, held it back
        _assert_bounded(peak, after, idle, limit, margin)
    finally:
        assert proc.stop() == 0, proc.log()[-3000:]


def _code(value: int) -> tuple:
    return next(c.value for c in grpc.StatusCode if c.value[0] == value)


def _read_stream_to_its_end(client, sid: int, message: bytes, sent: int, count: int):
    """Open the stream's window, send the rest of its `count` messages and read every answer."""
    client.open_window()
    while sent < count:
        if client.unsent_bytes(sid) == 0:
            client.send(sid, message, end=sent == count - 1)
            sent += 1
        client.pump(0.05)
    _answers(client, [sid], timeout_s=600)
    return client.calls[sid]


def _stream_outcomes(call) -> list:
    """A finished ModelStreamInfer call's answers as (response, None, "") or (None, code, details)."""
    assert call.status == 0, (call.status, call.message)
    outcomes = []
    for raw in call.messages:
        answer = pb.ModelStreamInferResponse.FromString(raw)
        if answer.error_message:
            code_name, _, details = answer.error_message.partition(": ")
            outcomes.append((None, grpc.StatusCode[code_name], details))
        else:
            outcomes.append((answer.infer_response, None, ""))
    return outcomes


def test_a_stream_that_stops_reading_holds_no_more_than_its_share(model_repository, eager_modules):
    limit = 512 * MIB
    proc, _ = _start(model_repository, limit, "--max-batch-size", "32")
    try:
        idle = _warm(proc, eager_modules)
        _reset_peak(proc)
        rng = np.random.default_rng(5)
        x = random_inputs(rng, 2, 512, 512, 512, 512)
        want = eager(eager_modules["self_attention"], **x)
        message = infer_request("self_attention", **x).SerializeToString()
        count = 87
        client = RawGrpcClient(proc.port)
        try:
            sid = client.start_call(STREAM, None, timeout_s=600)
            # Send all 87 requests as fast as flow control lets us, reading nothing. The server
            # stops reading this stream once its answers fill its share of the budget; then our
            # sends stop at its flow-control window. "Stopped" = nothing moved for 3 s (the
            # assertions below do not depend on it: stopping early only makes the case milder).
            sent = 0
            quiet_since = time.monotonic()
            give_up = time.monotonic() + 120
            while time.monotonic() < give_up:
                if sent < count and client.unsent_bytes(sid) == 0:
                    client.send(sid, message, end=sent == count - 1)
                    sent += 1
                    quiet_since = time.monotonic()
                    continue
                before = client.unsent_bytes(sid)
                if client.pump(0.1) or client.unsent_bytes(sid) != before:
                    quiet_since = time.monotonic()
                if time.monotonic() - quiet_since > 3.0:
                    break
            peak_held = _peak(proc)
            sent_while_held = sent
            call = _read_stream_to_its_end(client, sid, message, sent, count)
        finally:
            client.close()
        outcomes = _stream_outcomes(call)
        counts = _count(outcomes, [want] * len(outcomes))
        margin = SLACK + 2 * len(message)
        peak, after = _after_attack(proc, eager_modules, "memory_unread_stream", limit, idle, counts,
                                    peak_while_held=peak_held, sent_while_held=sent_while_held, margin=margin)
        assert len(outcomes) == count and counts["lost"] == 0, counts
        assert counts["served"] + counts["shed"] == count, counts
        _assert_bounded(peak, after, idle, limit, margin)
    finally:
        assert proc.stop() == 0, proc.log()[-3000:]


def test_a_stream_that_stops_reading_leaves_the_rest_of_the_budget_to_other_clients(model_repository,
                                                                                    eager_modules):
    """Fairness: one ModelStreamInfer stream sends requests that each reserve more than its share
    of the budget (a quarter) and reads nothing. It holds its share and one request at most (its
    reading waits, a request at a time until its cost is known); other clients are served
    meanwhile. (Before, its reading ran ahead of its runs: three requests reserved, five waiting
    for memory in front of everyone else, until the stream's deadline.)"""
    limit = 512 * MIB
    proc, _ = _start(model_repository, limit)
    try:
        idle = _warm(proc, eager_modules)
        _reset_peak(proc)
        rng = np.random.default_rng(9)
        x = random_inputs(rng, 2, 512, 512, 512, 512)  # reserves about 144 MB: a 19 MB answer
        want = eager(eager_modules["self_attention"], **x)
        message = infer_request("self_attention", **x).SerializeToString()
        y = random_inputs(rng, 1, 256, 256, 512, 512)
        other_want = {"output": eager(eager_modules["self_attention"], **y)["output"]}
        other = infer_request("self_attention", outputs=("output",), **y)
        count, others = 12, 6
        client = RawGrpcClient(proc.port)
        try:
            sid = client.start_call(STREAM, None, timeout_s=600)
            sent, first_cost = 0, 0
            give_up = time.monotonic() + 300
            # Until the stream's first request is reserved (a state, read from /metrics).
            while not (first_cost := _budget_metrics(proc)["reserved_bytes"]):
                assert time.monotonic() < give_up, "the stream's first request never reserved"
                if sent < count and client.unsent_bytes(sid) == 0:
                    client.send(sid, message, end=sent == count - 1)
                    sent += 1
                client.pump(0.05)
            with proc.channel() as channel, concurrent.futures.ThreadPoolExecutor(1) as pool:
                stub = pb_grpc.GRPCInferenceServiceStub(channel)

                def serve_others() -> list:
                    outcomes = []
                    for _ in range(others):
                        try:
                            outcomes.append((stub.ModelInfer(other, timeout=30), None, ""))
                        except grpc.RpcError as err:
                            outcomes.append((None, err.code(), err.details() or ""))
                    return outcomes

                served_others = pool.submit(serve_others)
                while not served_others.done():  # the stream keeps sending, reading nothing
                    assert time.monotonic() < give_up, "the other clients were not answered"
                    if sent < count and client.unsent_bytes(sid) == 0:
                        client.send(sid, message, end=sent == count - 1)
                        sent += 1
                    client.pump(0.05)
                other_outcomes = served_others.result()
            held = _budget_metrics(proc)["reserved_bytes"]  # all the stream's: the others are done
            peak_held = _peak(proc)
            sent_while_held = sent
            call = _read_stream_to_its_end(client, sid, message, sent, count)
        finally:
            client.close()
        outcomes = _stream_outcomes(call)
        counts = _count(outcomes, [want] * len(outcomes))
        other_counts = _count(other_outcomes, [other_want] * others)
        share = limit // 4
        peak, after = _after_attack(proc, eager_modules, "memory_stream_fairness", limit, idle, counts,
                                    peak_while_held=peak_held, sent_while_held=sent_while_held, held_by_stream=held,
                                    share=share, one_request=first_cost, others=other_counts["served"])
        assert other_counts["served"] == others, other_counts  # served while the stream held its share
        assert held <= share + first_cost, (held, share, first_cost)
        assert len(outcomes) == count and counts["lost"] == 0 and counts["served"] + counts["shed"] == count, counts
        _assert_bounded(peak, after, idle, limit, SLACK + 2 * 2 * len(message))
    finally:
        assert proc.stop() == 0, proc.log()[-3000:]


# -- typed contents: refused over --max-typed-bytes -------------------------------------------

# (1, 2800, 32) over 2800 keys: a 63 MB typed answer (attn_probs); (1, 700, 32) over 700 keys:
# 4.0 MB, within the default --max-typed-bytes (4 MiB).
OVER_TYPED, AT_TYPED = 2800, 700


def _typed_calls(address: str, calls: int) -> list[str]:
    """In a process of its own (its answers' parsing must not hold this process's GIL): per
    round, one typed cross_attention call whose 63 MB typed answer is over --max-typed-bytes and
    one whose 4.0 MB answer is within it. Returns each call's outcome: "OK" with its answer
    checked against the raw answer (asked first), "SERVED" for one over the limit that was
    answered, or the status and its details."""
    import grpc as grpc_
    from attnserve.proto import inference_pb2_grpc as pb_grpc_

    rng = np.random.default_rng(6)
    over, within = (random_inputs(rng, 1, n, n, 32, 32) for n in (OVER_TYPED, AT_TYPED))
    options = [("grpc.max_send_message_length", 64 << 20), ("grpc.max_receive_message_length", 64 << 20)]
    outcomes = []
    with grpc_.insecure_channel(address, options=options) as channel:
        stub = pb_grpc_.GRPCInferenceServiceStub(channel)
        want = outputs_of(stub.ModelInfer(infer_request("cross_attention", **within), timeout=300))
        typed = [infer_request("cross_attention", raw=False, **x) for x in (over, within)]
        for _ in range(calls):
            for request, checked in zip(typed, (False, True), strict=True):
                try:
                    response = stub.ModelInfer(request, timeout=300)
                    # Read at C speed (its packed bytes), so that this process does not take the
                    # two cores from the server being measured.
                    same = all(_packed_floats(t.contents.SerializeToString(), want[t.name].size).tobytes()
                               == want[t.name].tobytes() for t in response.outputs)
                    outcomes.append(("OK" if same else "WRONG") if checked else "SERVED")
                except grpc_.RpcError as err:
                    outcomes.append(f"{err.code().name}: {err.details()}")
    return outcomes


def _packed_floats(serialized: bytes, count: int) -> np.ndarray:
    """The floats of an InferTensorContents holding one packed fp32_contents field."""
    return np.frombuffer(serialized[len(serialized) - 4 * count:], dtype="<f4")


def _small_latencies(stub, request, count: int) -> list[float]:
    times = []
    for _ in range(count):
        started = time.perf_counter()
        stub.ModelInfer(request, timeout=120)
        times.append(time.perf_counter() - started)
    return sorted(times)


def test_large_typed_answers_are_refused_pointing_to_raw_contents_and_small_calls_go_on(model_repository,
                                                                                        eager_modules):
    """Typed contents are built on the event loop (protobuf and gRPC's serialization: a 63 MB
    typed answer held it about 190 ms, a small request's p99 went to 1 s): over --max-typed-bytes
    a call is refused before it is computed, naming the size and raw contents; within it served."""
    import multiprocessing

    limit = 1024 * MIB
    proc, _ = _start(model_repository, limit)
    try:
        idle = _warm(proc, eager_modules)
        rng = np.random.default_rng(8)
        small = infer_request("cross_attention", outputs=("output",), **random_inputs(rng, 1, 10, 10, 32, 32))
        with proc.channel() as channel:
            stub = pb_grpc.GRPCInferenceServiceStub(channel)
            _small_latencies(stub, small, 20)  # warm
            alone = _small_latencies(stub, small, 100)
            _reset_peak(proc)
            # Three clients of large typed calls, while this one measures its small requests.
            with concurrent.futures.ProcessPoolExecutor(3, mp_context=multiprocessing.get_context("spawn")) as pool:
                heavy = [pool.submit(_typed_calls, proc.address, 3) for _ in range(3)]
                during: list[float] = []
                while not all(f.done() for f in heavy) and len(during) < 2000:
                    during += _small_latencies(stub, small, 10)
                outcomes = [o for f in heavy for o in f.result()]
            during.sort()
        p = lambda xs, q: xs[min(int(q * len(xs)), len(xs) - 1)] * 1000  # noqa: E731
        peak, after = _after_attack(
            proc, eager_modules, "memory_typed", limit, idle, outcomes=sorted(set(o[:120] for o in outcomes)),
            small_requests=len(during), load=os.getloadavg()[0],
            alone_p50_ms=p(alone, 0.5), alone_p99_ms=p(alone, 0.99), during_p50_ms=p(during, 0.5),
            during_p99_ms=p(during, 0.99), during_p999_ms=p(during, 0.999), during_max_ms=during[-1] * 1000)
        over, within = outcomes[0::2], outcomes[1::2]
        assert within == ["OK"] * 9, within
        for outcome in over:
            assert outcome.startswith("INVALID_ARGUMENT: ") and "--max-typed-bytes" in outcome, outcome
            assert f"{1 * 2 * OVER_TYPED * OVER_TYPED * 4 + OVER_TYPED * 32 * 4:,} bytes" in outcome, outcome
            assert "raw_input_contents" in outcome and "raw_output_contents" in outcome, outcome
        assert len(during) >= 10
        # The small requests' latency is printed, not asserted (CPU contention on two shared cores
        # sets the tail as much as the event loop does): the refusal above is the protection.
        _assert_bounded(peak, after, idle, limit, SLACK + 3 * 2 * 2 * MIB)
    finally:
        assert proc.stop() == 0, proc.log()[-3000:]


# -- the REST port ---------------------------------------------------------------------------


def test_rest_answers_give_their_reservation_back_once_written(model_repository, eager_modules):
    """A REST call's share of the budget goes back once its answer is written: under a budget
    that holds one such request at a time (each reserves over half of it, and REST calls carry no
    deadline to wait within), twenty calls in a row are all served, exactly."""
    import tritonclient.http as httpclient

    limit = 24 * MIB  # one (1, 256, 256) self_attention request with a mask reserves about 17 MB
    proc, _ = _start(model_repository, limit)
    try:
        rng = np.random.default_rng(11)
        x = random_inputs(rng, 1, 256, 256, 512, 512, masked=True)
        want = eager(eager_modules["self_attention"], **x)["output"]
        client = httpclient.InferenceServerClient(url=proc.http_address)
        try:
            for _ in range(20):
                inputs = []
                for name in ("query", "key", "value", "mask"):
                    tensor = httpclient.InferInput(name, list(x[name].shape), "BOOL" if name == "mask" else "FP32")
                    tensor.set_data_from_numpy(x[name], binary_data=True)
                    inputs.append(tensor)
                result = client.infer("self_attention", inputs,
                                      outputs=[httpclient.InferRequestedOutput("output", binary_data=True)])
                assert float(np.max(np.abs(result.as_numpy("output") - want))) <= TOLERANCE
        finally:
            client.close()
    finally:
        assert proc.stop() == 0, proc.log()[-3000:]
