"""Whether ONNX Runtime's CUDA provider can run here, asked once at start by engine.choose_device.

`onnxruntime.get_available_providers()` lists the providers the package was built with, not the
ones that can load: onnxruntime-gpu lists CUDAExecutionProvider on a machine without CUDA or
cuDNN libraries or a GPU, and every session then falls back to CPU with only a log line of
ONNX Runtime's own. So the probe opens a one-node graph (y = -x, x: float (1,), built here as
ONNX protobuf bytes: the server has no `onnx` package) on CUDA and runs it; it fails when the
session does not run on CUDA. The reason names the library the dynamic loader could not find
when that is why (it tries to load the provider's library itself to ask).
"""

from __future__ import annotations

import ctypes
import os

import numpy as np
import onnxruntime as ort

CUDA = "CUDAExecutionProvider"
CPU = "CPUExecutionProvider"


def _field(number: int, payload: bytes | int) -> bytes:
    """One protobuf field: a varint (int) or length-delimited (bytes) value."""
    if isinstance(payload, int):
        return _varint(number << 3) + _varint(payload)
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def _value_info(name: str) -> bytes:
    # ValueInfoProto{name, type: TypeProto{tensor_type: {elem_type FLOAT, shape [1]}}}
    shape = _field(1, _field(1, 1))  # TensorShapeProto{dim: {dim_value: 1}}
    return _field(1, name.encode()) + _field(2, _field(1, _field(1, 1) + _field(2, shape)))


def probe_model() -> bytes:
    """ModelProto bytes: IR version 7, opset 13, graph y = Neg(x), x and y float (1,)."""
    node = _field(1, b"x") + _field(2, b"y") + _field(4, b"Neg")
    graph = _field(1, node) + _field(2, b"cuda_probe") + _field(11, _value_info("x")) + _field(12, _value_info("y"))
    return _field(1, 7) + _field(8, _field(1, b"") + _field(2, 13)) + _field(7, graph)


def why_cuda_cannot_run() -> str | None:
    """None when a session runs on CUDAExecutionProvider here; else why not, in one line."""
    options = ort.SessionOptions()
    options.log_severity_level = 3  # the probe's own warnings (node placement) are noise
    try:
        session = ort.InferenceSession(probe_model(), sess_options=options, providers=[CUDA, CPU])
        providers = session.get_providers()
        if providers[0] == CUDA:
            (y,) = session.run(None, {"x": np.ones(1, np.float32)})
            if y.tolist() == [-1.0]:
                return None
            return f"a probe run on {CUDA} answered {y.tolist()} for -[1.0]"
        fell_back = f"a session asked for {CUDA} runs on {providers}"
    except Exception as err:  # onnxruntime's own exception types
        fell_back = f"a session on {CUDA} failed: {type(err).__name__}: {' '.join(str(err).split())[:300]}"
    return f"{fell_back}{_library_note()} (onnxruntime {ort.__version__})"


def _library_note() -> str:
    """Why the provider's library does not load, as the dynamic loader says it; '' if it loads."""
    library = os.path.join(os.path.dirname(ort.__file__), "capi", "libonnxruntime_providers_cuda.so")
    if not os.path.exists(library):
        return ""
    try:
        ctypes.CDLL(library)
    except OSError as err:  # e.g. "libcublasLt.so.12: cannot open shared object file: No such file or directory"
        return f": its library does not load: {err}".replace(library + ": ", "")
    return ": its library loads, so no usable GPU or driver is the likely cause"
