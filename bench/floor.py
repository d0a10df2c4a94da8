"""`python -m bench.floor [server flags]`: the server's own stack, answering without a model.

The same process, flags, gRPC server, gate, servicer and codec as `attnserve serve`, but each
ModelInfer request, once decoded and checked as usual, is answered with zeros of the right
shapes: no batcher, no ONNX Runtime. What a load generator measures against it is the cost of
gRPC and of Python per call on this machine, the floor under any model served through this
stack. The benchmark runs it beside the real server, in the same run.
"""

from __future__ import annotations

import sys

import numpy as np

from attnserve.proto import inference_pb2 as pb
from attnserve.server import codec
from attnserve.server.__main__ import main
from attnserve.server.batcher import Result
from attnserve.server.service import InferenceServicer


class FloorServicer(InferenceServicer):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._zeros: dict[tuple, Result] = {}

    async def _infer(self, request: pb.ModelInferRequest, time_remaining: float | None) -> pb.ModelInferResponse:
        model = self._registry.get(request.model_name, request.model_version)
        spec = model.spec
        decoded = codec.decode(request, spec, model.limits)
        w = decoded.work
        key = (spec.name, w.rows, w.q_len, w.k_len)
        result = self._zeros.get(key)
        if result is None:
            result = self._zeros[key] = Result(
                output=np.zeros((w.rows, w.q_len, spec.out_dim), np.float32),  # (b, lq, out_dim)
                attn_probs=np.zeros((w.rows, spec.num_heads, w.q_len, w.k_len), np.float32),  # (b, h, lq, lk)
                queue_s=0.0, compute_s=0.0, batch_requests=1)
        return codec.encode(request, decoded, result, spec.version)


if __name__ == "__main__":
    sys.exit(main(servicer_class=FloorServicer))
