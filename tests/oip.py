"""Building and reading Open Inference Protocol messages in tests, straight from the stubs."""

from __future__ import annotations

import grpc
import numpy as np
import pytest
from attnserve.proto import inference_pb2 as pb

_DATATYPE = {np.dtype(np.float32): "FP32", np.dtype(np.bool_): "BOOL"}
_TYPED_FIELD = {"FP32": "fp32_contents", "BOOL": "bool_contents"}


# Both presets over the clients' parity tests (tritonclient over gRPC and over REST).
CASES = {  # case -> (model, b, lq, lk, masked)
    "a.self_attention": ("self_attention", 2, 10, 10, False),
    "b.self_attention": ("self_attention", 3, 7, 12, True),
    "c.cross_attention": ("cross_attention", 4, 256, 77, False),
    "d.cross_attention": ("cross_attention", 1, 256, 77, True),
}
WIDTHS = {"self_attention": 512, "cross_attention": 32}

def infer_request(model: str, raw: bool = True, outputs: tuple[str, ...] = (), version: str = "",
                  request_id: str = "", **tensors: np.ndarray | None) -> pb.ModelInferRequest:
    request = pb.ModelInferRequest(model_name=model, model_version=version, id=request_id)
    for name, array in tensors.items():
        if array is None:
            continue
        datatype = _DATATYPE[array.dtype]
        tensor = request.inputs.add(name=name, datatype=datatype, shape=array.shape)
        if raw:
            request.raw_input_contents.append(np.ascontiguousarray(array).tobytes())
        else:
            getattr(tensor.contents, _TYPED_FIELD[datatype]).extend(array.ravel().tolist())
    for name in outputs:
        request.outputs.add(name=name)
    return request


def outputs_of(response: pb.ModelInferResponse) -> dict[str, np.ndarray]:
    result = {}
    for index, tensor in enumerate(response.outputs):
        assert tensor.datatype == "FP32", tensor.datatype
        if response.raw_output_contents:
            array = np.frombuffer(response.raw_output_contents[index], dtype="<f4")
        else:
            array = np.asarray(tensor.contents.fp32_contents, dtype=np.float32)
        result[tensor.name] = array.reshape(tuple(tensor.shape))
    return result


def random_inputs(rng: np.random.Generator, b: int, lq: int, lk: int, q_dim: int, kv_dim: int,
                  masked: bool = False, fully_masked_row: bool = False) -> dict[str, np.ndarray | None]:
    mask = None
    if masked or fully_masked_row:
        mask = rng.random((b, lq, lk)) > 0.3
        if fully_masked_row:
            mask[0, 0, :] = False
    return {
        "query": rng.standard_normal((b, lq, q_dim), dtype=np.float32),
        "key": rng.standard_normal((b, lk, kv_dim), dtype=np.float32),
        "value": rng.standard_normal((b, lk, kv_dim), dtype=np.float32),
        "mask": mask,
    }


def eager(module, query, key, value, mask=None) -> dict[str, np.ndarray]:
    import torch

    with torch.no_grad():
        output, attn_probs = module(torch.from_numpy(query), torch.from_numpy(key), torch.from_numpy(value),
                                    mask=None if mask is None else torch.from_numpy(mask))
    return {"output": output.numpy(), "attn_probs": attn_probs.numpy()}


def rest_infer(client, model: str, x: dict[str, np.ndarray | None], binary: bool,
               outputs: tuple[str, ...] = ("output", "attn_probs")) -> dict[str, np.ndarray]:
    """One inference over REST with tritonclient.http's `client`: inputs and outputs as binary
    tensors (binary=True) or as JSON numbers."""
    import tritonclient.http as httpclient

    from attnserve.contract import DATATYPES, INPUT_NAMES

    inputs = []
    for name in INPUT_NAMES:
        if x.get(name) is not None:
            tensor = httpclient.InferInput(name, list(x[name].shape), DATATYPES[name])
            tensor.set_data_from_numpy(x[name], binary_data=binary)
            inputs.append(tensor)
    requested = [httpclient.InferRequestedOutput(name, binary_data=binary) for name in outputs]
    result = client.infer(model, inputs, outputs=requested)
    return {name: result.as_numpy(name) for name in outputs}


def refusal(stub, request: pb.ModelInferRequest, timeout: float | None = 60) -> tuple[grpc.StatusCode, str]:
    """The status code and details of a ModelInfer the test expects to be refused."""
    with pytest.raises(grpc.RpcError) as exc:
        stub.ModelInfer(request, timeout=timeout)
    return exc.value.code(), exc.value.details()
