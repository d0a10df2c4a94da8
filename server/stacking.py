"""Stacking requests into a batch: copies of their tensors on the run thread that keep the GIL.

numpy's copy loops let go of the GIL for every array of more than 500 values, and take it back
when the event loop next gives it up: while the loop is busy that is one switch interval later
(5 ms by default). A batch merged with np.concatenate waited that long for every request in it,
and under load the run thread spent more of each batch waiting inside its merge than ONNX
Runtime spent computing it (docs/record/performance.md, "The event loop first"). These copies are one
memcpy each, under the GIL (a memoryview's slice assignment), so the run thread waits for the GIL
once per batch, not once per array:

    merged = concat_rows([w.query for w in works])   # np.concatenate(..., axis=0)
    place(padded, start, w.query)                    # padded[start:start + b, :l] = w.query
"""

from __future__ import annotations

import numpy as np


def _bytes_of(array: np.ndarray) -> memoryview:
    return memoryview(np.ascontiguousarray(array).reshape(-1).view(np.uint8))


def concat_rows(arrays: list[np.ndarray]) -> np.ndarray:
    """np.concatenate(arrays) along the first axis, for arrays of one dtype and trailing shape."""
    first = arrays[0]
    out = np.empty((sum(a.shape[0] for a in arrays), *first.shape[1:]), dtype=first.dtype)
    target = _bytes_of(out)
    at = 0
    for array in arrays:
        data = _bytes_of(array)
        target[at:at + data.nbytes] = data
        at += data.nbytes
    return out


def place(padded: np.ndarray, start: int, array: np.ndarray) -> None:
    """padded[start:start + b, :l] = array, for a C-contiguous padded (B, L, ...) and an array
    (b, l, ...) with the same trailing shape: item by item, the first l rows of each of padded's
    items are contiguous."""
    item_bytes = padded[0].nbytes
    data = _bytes_of(array)
    rows_bytes = data.nbytes // array.shape[0] if array.shape[0] else 0
    target = _bytes_of(padded)  # padded is C-contiguous: a view of its own bytes
    for i in range(array.shape[0]):
        at = (start + i) * item_bytes
        target[at:at + rows_bytes] = data[i * rows_bytes:(i + 1) * rows_bytes]
