"""Scheduling priority of the threads that compute: the event loop goes first.

The event loop is one thread, and under load the server's bottleneck: every call's gRPC and
Python work runs on it. ONNX Runtime's runs take every core (intra-op threads), and while they
run the loop waited for a core like any other thread: at concurrency 32 on two cores the loop
got about two thirds of one. So the threads that compute run at a lower priority than the
loop (a higher nice value, by --compute-nice): each batcher's run threads, and ONNX Runtime's
intra-op pool threads, which a session starts when it is opened and which inherit the nice value
of the thread that opens it. Where both want a core the kernel serves the loop first; a run
alone has the cores to itself as before (docs/record/performance.md, "The event loop first").

    lower_this_thread(increment)        # the calling thread (a batcher's run thread, as it starts)
    run_lowered(increment, open_model)  # open_model() in a new thread at that priority

Linux only (a thread's own nice value, setpriority on its thread id); elsewhere nothing changes.
Lowering a priority needs no privilege; nothing here raises one.
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def lower_this_thread(increment: int) -> None:
    """Add `increment` to the calling thread's nice value (capped at 19); 0 changes nothing."""
    if increment <= 0 or not sys.platform.startswith("linux"):
        return
    tid = threading.get_native_id()
    current = os.getpriority(os.PRIO_PROCESS, tid)
    os.setpriority(os.PRIO_PROCESS, tid, min(current + increment, 19))


def run_lowered(increment: int, make: Callable[[], T]) -> T:
    """make(), in a new thread whose nice value is raised by `increment`: the threads it starts
    (ONNX Runtime's pool threads, when it opens sessions) inherit that priority. Returns or
    raises what make() did. With 0, make() runs in the calling thread."""
    if increment <= 0 or not sys.platform.startswith("linux"):
        return make()
    outcome: dict[str, object] = {}

    def lowered() -> None:
        lower_this_thread(increment)
        try:
            outcome["value"] = make()
        except BaseException as err:  # handed to the caller below
            outcome["error"] = err

    thread = threading.Thread(target=lowered, name="open-lowered")
    thread.start()
    thread.join()
    if "error" in outcome:
        raise outcome["error"]  # type: ignore[misc]
    return outcome["value"]  # type: ignore[return-value]
