"""server.stacking: a batch's copies equal numpy's, and keep the GIL while they copy.

The second is the point: numpy's copy loops let go of the GIL for any array of more than 500
values, and while the event loop wants the GIL the run thread then waits for it to give it
back (up to a switch interval, 5 ms, each time): 12 (1, 10, 512) requests merged with
np.concatenate took 35-50 ms beside a busy thread, 0.01 ms alone. Whether a copy lets go is
seen without timing anything: another thread is woken and then needs only the GIL, the switch
interval is set far out of reach (no forced hand-over), and the copy runs, of arrays large
enough that a copy letting go of the GIL leaves the other thread ample time to take it; the
other thread can only have run if the copy let go of the GIL.
"""

from __future__ import annotations

import ctypes
import os
import sys
import threading

import numpy as np
import pytest
from attnserve.server.stacking import concat_rows, place


def _lets_go_of_the_gil(copy) -> bool:
    libc = ctypes.PyDLL(None)  # PyDLL: its calls keep the GIL (os.write would let go of it)
    read_end, write_end = os.pipe()
    ran = []

    def waiter() -> None:
        os.read(read_end, 1)  # blocked here without the GIL, until the pipe has a byte
        ran.append(True)  # needs the GIL

    thread = threading.Thread(target=waiter)
    thread.start()
    interval = sys.getswitchinterval()
    sys.setswitchinterval(60.0)  # no forced hand-over from here on
    try:
        libc.write(write_end, b"x", 1)  # the waiter wakes, and then needs only the GIL
        copy()
        let_go = bool(ran)
    finally:
        sys.setswitchinterval(interval)
        thread.join()
        os.close(read_end)
        os.close(write_end)
    return let_go


def _requests(n: int, shape=(1, 10, 512), dtype=np.float32) -> list[np.ndarray]:
    rng = np.random.default_rng(n)
    if dtype == np.bool_:
        return [rng.random(shape) < 0.5 for _ in range(n)]
    return [rng.standard_normal(shape).astype(dtype) for _ in range(n)]


def test_numpy_lets_go_of_the_gil_for_a_batch_and_stack_and_place_do_not():
    arrays = _requests(12, (1, 1024, 1024))  # 4 MiB each: each copy a window of milliseconds
    # What the batcher did before. The probe sees a let-go only if the kernel runs the waiter
    # inside one of the copy's windows: on one core that takes a preemption, so a few tries.
    # Holding the GIL (below) is seen on every try: the waiter can never run then.
    assert any(_lets_go_of_the_gil(lambda: np.concatenate(arrays)) for _ in range(10))
    assert not _lets_go_of_the_gil(lambda: concat_rows(arrays))
    padded = np.zeros((12, 1100, 1024), np.float32)
    assert not _lets_go_of_the_gil(lambda: [place(padded, i, a) for i, a in enumerate(arrays)])


@pytest.mark.parametrize("shape,dtype", [((1, 10, 512), np.float32), ((3, 7, 5), np.float32),
                                         ((2, 9, 11), np.bool_), ((1, 2, 3, 4), np.bool_), ((0, 4, 8), np.float32)])
def test_stack_is_concatenate(shape, dtype):
    arrays = _requests(5, shape, dtype)
    got = concat_rows(arrays)
    assert got.dtype == dtype and got.flags.c_contiguous and got.flags.writeable
    np.testing.assert_array_equal(got, np.concatenate(arrays))


def test_stack_takes_views_that_are_not_contiguous():
    base = _requests(3, (2, 10, 16))
    views = [a[:, ::2] for a in base]  # every other row
    np.testing.assert_array_equal(concat_rows(views), np.concatenate(views))


def test_place_is_the_padded_slice_assignment():
    rng = np.random.default_rng(0)
    works = [rng.standard_normal((b, length, 8)).astype(np.float32) for b, length in ((2, 5), (1, 9), (3, 1))]
    padded, expected = np.zeros((6, 9, 8), np.float32), np.zeros((6, 9, 8), np.float32)
    start = 0
    for w in works:
        place(padded, start, w)
        expected[start:start + w.shape[0], : w.shape[1]] = w
        start += w.shape[0]
    np.testing.assert_array_equal(padded, expected)
