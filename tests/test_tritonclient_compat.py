"""NVIDIA's tritonclient, unmodified, against our server: the wire protocol is the standard one.

tritonclient runs in this process, beside our own stubs and client: its grpc_service.proto
defines the same `inference.*` protobuf names in protobuf's default descriptor pool, and ours
live in a pool of their own (attnserve.proto.generate), so the two import together.
"""

from __future__ import annotations

import sys

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from attnserve.client import InferenceClient
from attnserve.proto import inference_pb2 as pb
from google.protobuf import descriptor_pool

from attnserve.contract import DATATYPES, INPUT_NAMES, OUTPUT_NAMES
from tests.conftest import PRESET_NAMES
from tests.oip import CASES, WIDTHS, eager, random_inputs

TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def triton(server):
    client = grpcclient.InferenceServerClient(url=server.address)
    yield client
    client.close()


def _triton_infer(client: grpcclient.InferenceServerClient, model: str, x: dict, request_id: str = ""):
    inputs = []
    for name in INPUT_NAMES:
        if x.get(name) is None:
            continue
        tensor = grpcclient.InferInput(name, list(x[name].shape), DATATYPES[name])
        tensor.set_data_from_numpy(x[name])
        inputs.append(tensor)
    outputs = [grpcclient.InferRequestedOutput(name) for name in OUTPUT_NAMES]
    result = client.infer(model, inputs, outputs=outputs, request_id=request_id)
    return {name: result.as_numpy(name) for name in OUTPUT_NAMES}


def test_tritonclient_gets_eager_numbers(triton, eager_modules):
    rng = np.random.default_rng(42)
    for case, (model, b, lq, lk, masked) in CASES.items():
        x = random_inputs(rng, b, lq, lk, WIDTHS[model], WIDTHS[model], masked=masked, fully_masked_row=masked)
        got = _triton_infer(triton, model, x, request_id=case)
        want = eager(eager_modules[model], **x)
        for name in OUTPUT_NAMES:
            err = float(np.max(np.abs(got[name] - want[name])))
            assert err <= TOLERANCE, f"{case} {name}: max abs error {err}"


def test_tritonclient_metadata_calls(triton):
    assert triton.is_server_live() and triton.is_server_ready()
    assert triton.get_server_metadata(as_json=True)["name"] == "attnserve"
    for model in WIDTHS:
        assert triton.is_model_ready(model)
        metadata = triton.get_model_metadata(model, as_json=True)
        assert [i["name"] for i in metadata["inputs"]] == list(INPUT_NAMES)
        config = triton.get_model_config(model, as_json=True)["config"]
        assert config["name"] == model
        assert int(config.get("max_batch_size", 0)) == 0  # JSON omits a zero
        _triton_infer(triton, model, random_inputs(np.random.default_rng(0), 1, 3, 3, WIDTHS[model], WIDTHS[model]))
        stats = triton.get_inference_statistics(model, as_json=True)["model_stats"][0]
        assert int(stats["inference_count"]) >= 1


def test_tritonclient_repository_index(triton):
    index = triton.get_model_repository_index(as_json=True)
    states = {m["name"]: m.get("state") for m in index["models"]}
    assert {name: states.get(name) for name in PRESET_NAMES} == {name: "READY" for name in PRESET_NAMES}, index
    assert all(m.get("version") for m in index["models"] if m["name"] in PRESET_NAMES), index


def test_tritonclient_and_our_client_in_one_process(triton, server):
    # Both stubs are loaded here: tritonclient's in the default descriptor pool, ours in our own.
    assert "tritonclient.grpc" in sys.modules and "attnserve.proto.inference_pb2" in sys.modules
    theirs = descriptor_pool.Default().FindMessageTypeByName("inference.ModelInferRequest")
    assert theirs.file.name != pb.DESCRIPTOR.name
    assert pb.ModelInferRequest.DESCRIPTOR.file.pool is not descriptor_pool.Default()

    x = random_inputs(np.random.default_rng(7), 2, 256, 77, 32, 32, masked=True)
    via_triton = _triton_infer(triton, "cross_attention", x)
    with InferenceClient(server.address) as ours:
        via_ours = ours.infer("cross_attention", x["query"], x["key"], x["value"], mask=x["mask"],
                              outputs=OUTPUT_NAMES)
        assert {e.name for e in ours.repository_index() if e.ready} >= set(PRESET_NAMES)
    for name in OUTPUT_NAMES:
        np.testing.assert_array_equal(via_ours[name], via_triton[name])
