"""Long sequences through a real server process: fused attention serves what the attention-matrix
bound would refuse on the unfused graph, with eager PyTorch's answers; a repository exported
before the fused graphs still serves exactly as before (and is still bounded as before)."""

from __future__ import annotations

import grpc
import numpy as np
import pytest
import torch
from attnserve.proto import inference_pb2_grpc as pb_grpc

from tests.export_helpers import old_layout
from tests.oip import eager, infer_request, outputs_of
from tests.server_process import ServerProcess

TOLERANCE = 1e-5


def _chunked_eager(module, query, key, value, rows: int = 512) -> np.ndarray:
    """The eager module, a block of query rows at a time: each row of attention depends on its
    own query and every key only, so the answer is the module's own without an L x L matrix
    (8 heads x 8,192^2 floats is 2 GiB) per block."""
    k, v = torch.from_numpy(key), torch.from_numpy(value)
    parts = []
    with torch.no_grad():
        for start in range(0, query.shape[1], rows):
            parts.append(module(torch.from_numpy(query[:, start:start + rows]), k, v)[0].numpy())
    return np.concatenate(parts, axis=1)


def test_a_long_output_only_request_is_served_with_default_limits(server, eager_modules):
    """(1, 8192, 512): its attention matrix, 8 x 8192 x 8192 x 4 bytes = 2 GiB, is what the unfused
    graph would hold; the flash graph holds none of it. Default flags, inputs of 50 MB."""
    rng = np.random.default_rng(8192)
    x = {n: rng.standard_normal((1, 8192, 512), dtype=np.float32) for n in ("query", "key", "value")}
    with server.channel() as channel:
        response = pb_grpc.GRPCInferenceServiceStub(channel).ModelInfer(
            infer_request("self_attention", outputs=("output",), **x), timeout=300)
    got = outputs_of(response)["output"]
    want = _chunked_eager(eager_modules["self_attention"], x["query"], x["key"], x["value"])
    assert got.shape == (1, 8192, 512)
    assert float(np.max(np.abs(got - want))) <= TOLERANCE


BOUND = 16 << 20  # 16 MiB: (1, 1024, 1024) over 8 heads needs 32 MiB


@pytest.fixture(scope="module")
def bounded_servers(model_repository, tmp_path_factory):
    """The same repository, and a copy of self_attention as an older export wrote it (no fused
    graphs, no crossover), each served with --max-attention-bytes 16 MiB."""
    old = old_layout(model_repository, "self_attention", tmp_path_factory.mktemp("old_layout"))
    servers = {"new": ServerProcess(model_repository, "--max-attention-bytes", str(BOUND)),
               "old": ServerProcess(old, "--max-attention-bytes", str(BOUND))}
    yield servers
    for proc in servers.values():
        assert proc.stop() == 0


def _infer(proc, **kw):
    with proc.channel() as channel:
        return outputs_of(pb_grpc.GRPCInferenceServiceStub(channel).ModelInfer(infer_request("self_attention", **kw),
                                                                                timeout=120))


def test_the_bound_follows_the_graph_and_an_old_layout_serves_as_before(bounded_servers, eager_modules):
    module = eager_modules["self_attention"]
    rng = np.random.default_rng(1024)
    x = {n: rng.standard_normal((1, 1024, 512), dtype=np.float32) for n in ("query", "key", "value")}
    general = rng.random((1, 1024, 1024)) > 0.3
    # New layout: no mask, output alone -> flash attention, served; the others hold 32 MiB: refused.
    got = _infer(bounded_servers["new"], outputs=("output",), **x)["output"]
    assert float(np.max(np.abs(got - eager(module, **x)["output"]))) <= TOLERANCE
    refused = {"new, attn_probs": ("new", dict(outputs=("output", "attn_probs"), **x)),
               "new, general mask": ("new", dict(outputs=("output",), mask=general, **x)),
               "old, no mask": ("old", dict(outputs=("output",), **x))}
    for case, (which, kw) in refused.items():
        with pytest.raises(grpc.RpcError) as exc:
            _infer(bounded_servers[which], **kw)
        assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT, case
        assert "33,554,432-byte attention matrix" in exc.value.details(), case
    # The old layout serves what fits, with and without masks, both outputs or one, as before.
    small = {n: a[:, :300] for n, a in x.items()}
    for mask in (None, general[:, :300, :300].copy()):
        want = eager(module, mask=mask, **small)
        both = _infer(bounded_servers["old"], mask=mask, **small)
        for name in ("output", "attn_probs"):
            assert float(np.max(np.abs(both[name] - want[name]))) <= TOLERANCE
        alone = _infer(bounded_servers["old"], outputs=("output",), mask=mask, **small)
        assert float(np.max(np.abs(alone["output"] - want["output"]))) <= TOLERANCE
