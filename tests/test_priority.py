"""server.priority: the threads that compute run below the event loop's priority.

Read from /proc (each thread's nice value, field 19 of /proc/PID/task/TID/stat): the calling
thread's own, the threads ONNX Runtime starts when a session is opened (they inherit the
opening thread's), and a served process's after a request.
"""

from __future__ import annotations

import os
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
from attnserve.proto import inference_pb2_grpc as pb_grpc
from attnserve.server import priority

from tests.oip import infer_request, random_inputs
from tests.server_process import ServerProcess

pytestmark = [pytest.mark.e2e,  # starts a server process
              pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a thread's own nice value is Linux's")]


def _nice(pid: int, tid: int) -> int:
    stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
    return int(stat[stat.rindex(")") + 2:].split()[16])


def _threads(pid: int) -> dict[int, tuple[str, int]]:
    """tid -> (name, nice) of every thread of process `pid`."""
    found = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            found[int(task.name)] = ((task / "comm").read_text().strip(), _nice(pid, int(task.name)))
        except (OSError, ValueError, IndexError):  # the thread ended meanwhile
            pass
    return found


def _in_thread(work):
    box = []
    thread = threading.Thread(target=lambda: box.append(work()))
    thread.start()
    thread.join()
    return box[0]


def test_lower_this_thread_raises_the_calling_threads_nice_only():
    pid, base = os.getpid(), _nice(os.getpid(), threading.get_native_id())

    def lowered(increment):
        priority.lower_this_thread(increment)
        return _nice(pid, threading.get_native_id())

    assert _in_thread(lambda: lowered(3)) == min(base + 3, 19)
    assert _in_thread(lambda: lowered(0)) == base
    assert _in_thread(lambda: lowered(50)) == 19  # capped where the kernel caps it
    assert _nice(pid, threading.get_native_id()) == base  # the caller's own thread untouched


def test_threads_started_by_a_lowered_opening_inherit_its_priority(model_repository):
    from attnserve.server.engine import Engine, choose_device
    from attnserve.server.repository import read_model_spec

    pid, base = os.getpid(), _nice(os.getpid(), threading.get_native_id())
    before = set(_threads(pid))
    spec = read_model_spec(model_repository / "cross_attention")
    # Two intra-op threads: ONNX Runtime starts a pool thread for each session, whatever the CPUs.
    engine = priority.run_lowered(4, lambda: Engine(spec, choose_device("cpu"), intra_op_threads=2, solo=False))
    started = {tid: nice for tid, (_, nice) in _threads(pid).items() if tid not in before}
    assert started, "opening the sessions started no thread"
    assert set(started.values()) == {min(base + 4, 19)}, started
    assert _nice(pid, threading.get_native_id()) == base
    del engine

    assert priority.run_lowered(4, lambda: "made") == "made"
    with pytest.raises(KeyError, match="raised inside"):
        priority.run_lowered(4, lambda: {}["raised inside"])


@pytest.mark.parametrize("compute_nice", [5, 0])
def test_a_served_process_computes_below_its_event_loop(model_repository, compute_nice):
    server = ServerProcess(model_repository, "--compute-nice", str(compute_nice))
    try:
        rng = np.random.default_rng(0)
        with server.channel() as channel:  # one request: the batcher's run thread starts
            pb_grpc.GRPCInferenceServiceStub(channel).ModelInfer(
                infer_request("cross_attention", **random_inputs(rng, 1, 4, 5, 32, 32)), timeout=60)
        pid = server.proc.pid
        threads = _threads(pid)
        base = threads[pid][1]  # the main thread: the event loop
        grpc_threads = {nice for name, nice in threads.values() if name.startswith(("event_engine", "grpc"))}
        assert grpc_threads == {base}  # gRPC's own threads keep the loop's priority
        lowered = [tid for tid, (_, nice) in threads.items() if nice == min(base + compute_nice, 19) and tid != pid]
        if compute_nice:
            # The run thread of the batch just computed, and ONNX Runtime's pool threads where
            # the machine gives ONNX Runtime more than one thread.
            assert len(lowered) >= (2 if len(os.sched_getaffinity(pid)) > 1 else 1), threads
            assert max(nice for _, nice in threads.values()) == min(base + compute_nice, 19)
        else:
            assert {nice for _, nice in threads.values()} == {base}, threads
    finally:
        assert server.stop() == 0
