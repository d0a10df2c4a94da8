"""The checked-in gRPC stubs: fresh, wire-compatible, and usable."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from attnserve.proto import inference_pb2 as pb
from attnserve.proto import inference_pb2_grpc as pb_grpc
from google.protobuf import descriptor as _d

pytestmark = pytest.mark.e2e  # imports the stubs in fresh interpreters and regenerates them

REPO_ROOT = Path(__file__).resolve().parent.parent
PROTO_DIR = REPO_ROOT / "proto"

F = _d.FieldDescriptor
OPTIONAL, REPEATED = "optional", "repeated"


def _label(field: _d.FieldDescriptor) -> str:
    # FieldDescriptor.label is deprecated in newer protobuf; is_repeated replaces it.
    rep = getattr(field, "is_repeated", None)
    if rep is None:
        rep = field.label == F.LABEL_REPEATED
    return REPEATED if rep else OPTIONAL


# --------------------------------------------------------------------------
# (a) the checked-in stubs are what the .proto generates now
# --------------------------------------------------------------------------


def test_checked_in_stubs_match_fresh_generation(tmp_path):
    pytest.importorskip("grpc_tools", reason="grpcio-tools (dev extra) not installed")
    from attnserve.proto import generate

    fresh = generate.generate(tmp_path)
    assert [p.name for p in fresh] == list(generate.GENERATED)
    stale = [p.name for p in fresh if p.read_bytes() != (PROTO_DIR / p.name).read_bytes()]
    assert not stale, f"stale stubs {stale}: run `python -m attnserve.proto.generate`"


def test_grpc_stub_uses_package_import():
    text = (PROTO_DIR / "inference_pb2_grpc.py").read_text(encoding="utf-8")
    assert "from attnserve.proto import inference_pb2 as " in text
    assert "\nimport inference_pb2" not in text


def test_stubs_import_without_grpc_tools():
    # The server must not need grpcio-tools at run time.
    code = (
        "import sys; sys.modules['grpc_tools'] = None\n"
        "from attnserve.proto import inference_pb2, inference_pb2_grpc\n"
        "assert inference_pb2_grpc.GRPCInferenceServiceStub\n"
    )
    subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, check=True)


def test_declared_floors_are_what_the_stubs_need():
    # The stubs refuse a protobuf older than their gencode and a grpcio older than
    # GRPC_GENERATED_VERSION; pyproject.toml's floors must be exactly those (why these versions:
    # proto/generate.py), and the dev extra must pin the grpcio-tools that wrote them.
    import re
    import tomllib

    pb2 = (PROTO_DIR / "inference_pb2.py").read_text(encoding="utf-8")
    gencode = ".".join(re.search(
        r"ValidateProtobufRuntimeVersion\(\s*_runtime_version\.Domain\.PUBLIC,\s*(\d+),\s*(\d+),\s*(\d+),",
        pb2).groups())
    grpc_generated = re.search(r"GRPC_GENERATED_VERSION = '([0-9.]+)'",
                               (PROTO_DIR / "inference_pb2_grpc.py").read_text(encoding="utf-8")).group(1)
    project = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    declared = {re.match(r"[A-Za-z0-9._-]+", d).group(0): d for d in project["dependencies"]}
    assert declared["protobuf"].replace(" ", "") == f"protobuf>={gencode},<8"
    for name in ("grpcio", "grpcio-health-checking", "grpcio-reflection"):
        assert declared[name].replace(" ", "") == f"{name}>={grpc_generated}"
    assert f"grpcio-tools=={grpc_generated}" in [d.split("#")[0].replace(" ", "") for d in
                                                  project["optional-dependencies"]["dev"]]


def test_messages_live_in_a_private_descriptor_pool():
    from google.protobuf import descriptor_pool

    assert pb.DESCRIPTOR.pool is not descriptor_pool.Default()
    assert pb.ModelInferRequest.DESCRIPTOR.file is pb.DESCRIPTOR
    with pytest.raises(KeyError):
        descriptor_pool.Default().FindFileByName(pb.DESCRIPTOR.name)


def test_stubs_import_beside_other_inference_definitions():
    # What tritonclient's grpc_service.proto and KServe's grpc_predict_v2.proto do: define
    # inference.* names in the default pool. Our stubs import after them, and before them.
    code = (
        "from google.protobuf import descriptor_pb2, descriptor_pool\n"
        "def other():\n"
        "    f = descriptor_pb2.FileDescriptorProto(name='theirs/grpc_service.proto', package='inference',\n"
        "                                           syntax='proto3')\n"
        "    m = f.message_type.add(name='ServerLiveResponse')\n"
        "    m.field.add(name='live', number=1, type=8, label=1)\n"
        "    return descriptor_pool.Default().AddSerializedFile(f.SerializeToString())\n"
        "import sys\n"
        "if sys.argv[1] == 'theirs-first': other()\n"
        "from attnserve.proto import inference_pb2, inference_pb2_grpc\n"
        "if sys.argv[1] == 'ours-first': other()\n"
        "wire = inference_pb2.ServerLiveResponse(live=True).SerializeToString()\n"
        "assert wire == b'\\x08\\x01', wire\n"
        "found = descriptor_pool.Default().FindMessageTypeByName('inference.ServerLiveResponse')\n"
        "assert found.file.name == 'theirs/grpc_service.proto'\n"
    )
    for order in ("theirs-first", "ours-first"):
        subprocess.run([sys.executable, "-c", code, order], cwd=REPO_ROOT, check=True)


def test_generate_refuses_output_it_does_not_recognise():
    from attnserve.proto import generate

    with pytest.raises(RuntimeError, match="has grpcio-tools changed"):
        generate._private_pool("DESCRIPTOR = _descriptor_pool.Default().FindFileByName('x')\n")


def test_reflection_pool_resolves_each_service():
    from attnserve.proto import reflection_pool
    from grpc_health.v1 import health_pb2

    health = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name
    pool = reflection_pool(["inference.GRPCInferenceService", health])
    assert pool.FindFileContainingSymbol("inference.GRPCInferenceService").name == pb.DESCRIPTOR.name
    assert pool.FindFileContainingSymbol(health).name == health_pb2.DESCRIPTOR.name
    assert pool.FindMessageTypeByName("inference.ModelInferRequest").fields_by_name["raw_input_contents"].number == 7
    with pytest.raises(KeyError, match="no.such.Service"):
        reflection_pool(["no.such.Service"])


# --------------------------------------------------------------------------
# (b) wire facts, read from the generated descriptors
# --------------------------------------------------------------------------


def test_file_descriptor():
    assert pb.DESCRIPTOR.package == "inference"
    assert pb.DESCRIPTOR.name == "attnserve/proto/inference.proto"


SERVICE_RPCS = {
    # name: (input, output, client_streaming, server_streaming)
    "ServerLive": ("ServerLiveRequest", "ServerLiveResponse", False, False),
    "ServerReady": ("ServerReadyRequest", "ServerReadyResponse", False, False),
    "ModelReady": ("ModelReadyRequest", "ModelReadyResponse", False, False),
    "ServerMetadata": ("ServerMetadataRequest", "ServerMetadataResponse", False, False),
    "ModelMetadata": ("ModelMetadataRequest", "ModelMetadataResponse", False, False),
    "ModelInfer": ("ModelInferRequest", "ModelInferResponse", False, False),
    "ModelStreamInfer": ("ModelInferRequest", "ModelStreamInferResponse", True, True),
    "ModelConfig": ("ModelConfigRequest", "ModelConfigResponse", False, False),
    "ModelStatistics": ("ModelStatisticsRequest", "ModelStatisticsResponse", False, False),
    "RepositoryIndex": ("RepositoryIndexRequest", "RepositoryIndexResponse", False, False),
    "RepositoryModelLoad": ("RepositoryModelLoadRequest", "RepositoryModelLoadResponse", False, False),
    "RepositoryModelUnload": ("RepositoryModelUnloadRequest", "RepositoryModelUnloadResponse", False, False),
    **{f"{kind}SharedMemory{call}": (f"{kind}SharedMemory{call}Request", f"{kind}SharedMemory{call}Response", False,
                                     False)
       for kind in ("System", "Cuda") for call in ("Status", "Register", "Unregister")},
}


def test_service_and_rpcs():
    svc = pb.DESCRIPTOR.services_by_name["GRPCInferenceService"]
    assert svc.full_name == "inference.GRPCInferenceService"
    assert {m.name for m in svc.methods} == set(SERVICE_RPCS)
    for name, (inp, out, cstream, sstream) in SERVICE_RPCS.items():
        m = svc.methods_by_name[name]
        assert m.input_type.full_name == f"inference.{inp}", name
        assert m.output_type.full_name == f"inference.{out}", name
        assert m.client_streaming is cstream, name
        assert m.server_streaming is sstream, name


def test_grpc_stub_method_paths():
    class _Channel:
        def __init__(self):
            self.paths = []

        def _record(self, path, *args, **kwargs):
            self.paths.append(path)

        unary_unary = unary_stream = stream_unary = stream_stream = _record

    ch = _Channel()
    pb_grpc.GRPCInferenceServiceStub(ch)
    assert sorted(ch.paths) == sorted(f"/inference.GRPCInferenceService/{n}" for n in SERVICE_RPCS)


STR, BOOL, BYTES = F.TYPE_STRING, F.TYPE_BOOL, F.TYPE_BYTES
I32, I64, U32, U64 = F.TYPE_INT32, F.TYPE_INT64, F.TYPE_UINT32, F.TYPE_UINT64
FLT, DBL, MSG, ENUM = F.TYPE_FLOAT, F.TYPE_DOUBLE, F.TYPE_MESSAGE, F.TYPE_ENUM

# (message, field, number, type, label, message/enum type or None)
WIRE_TABLE = [
    ("ServerLiveResponse", "live", 1, BOOL, OPTIONAL, None),
    ("ServerReadyResponse", "ready", 1, BOOL, OPTIONAL, None),
    ("ModelReadyRequest", "name", 1, STR, OPTIONAL, None),
    ("ModelReadyRequest", "version", 2, STR, OPTIONAL, None),
    ("ModelReadyResponse", "ready", 1, BOOL, OPTIONAL, None),
    ("ServerMetadataResponse", "name", 1, STR, OPTIONAL, None),
    ("ServerMetadataResponse", "version", 2, STR, OPTIONAL, None),
    ("ServerMetadataResponse", "extensions", 3, STR, REPEATED, None),
    ("ModelMetadataRequest", "name", 1, STR, OPTIONAL, None),
    ("ModelMetadataRequest", "version", 2, STR, OPTIONAL, None),
    ("ModelMetadataResponse", "name", 1, STR, OPTIONAL, None),
    ("ModelMetadataResponse", "versions", 2, STR, REPEATED, None),
    ("ModelMetadataResponse", "platform", 3, STR, OPTIONAL, None),
    ("ModelMetadataResponse", "inputs", 4, MSG, REPEATED, "ModelMetadataResponse.TensorMetadata"),
    ("ModelMetadataResponse", "outputs", 5, MSG, REPEATED, "ModelMetadataResponse.TensorMetadata"),
    ("ModelMetadataResponse.TensorMetadata", "name", 1, STR, OPTIONAL, None),
    ("ModelMetadataResponse.TensorMetadata", "datatype", 2, STR, OPTIONAL, None),
    ("ModelMetadataResponse.TensorMetadata", "shape", 3, I64, REPEATED, None),
    ("InferParameter", "bool_param", 1, BOOL, OPTIONAL, None),
    ("InferParameter", "int64_param", 2, I64, OPTIONAL, None),
    ("InferParameter", "string_param", 3, STR, OPTIONAL, None),
    ("InferParameter", "double_param", 4, DBL, OPTIONAL, None),
    ("InferParameter", "uint64_param", 5, U64, OPTIONAL, None),
    ("InferTensorContents", "bool_contents", 1, BOOL, REPEATED, None),
    ("InferTensorContents", "int_contents", 2, I32, REPEATED, None),
    ("InferTensorContents", "int64_contents", 3, I64, REPEATED, None),
    ("InferTensorContents", "uint_contents", 4, U32, REPEATED, None),
    ("InferTensorContents", "uint64_contents", 5, U64, REPEATED, None),
    ("InferTensorContents", "fp32_contents", 6, FLT, REPEATED, None),
    ("InferTensorContents", "fp64_contents", 7, DBL, REPEATED, None),
    ("InferTensorContents", "bytes_contents", 8, BYTES, REPEATED, None),
    ("ModelInferRequest", "model_name", 1, STR, OPTIONAL, None),
    ("ModelInferRequest", "model_version", 2, STR, OPTIONAL, None),
    ("ModelInferRequest", "id", 3, STR, OPTIONAL, None),
    ("ModelInferRequest", "parameters", 4, MSG, REPEATED, "ModelInferRequest.ParametersEntry"),
    ("ModelInferRequest", "inputs", 5, MSG, REPEATED, "ModelInferRequest.InferInputTensor"),
    ("ModelInferRequest", "outputs", 6, MSG, REPEATED, "ModelInferRequest.InferRequestedOutputTensor"),
    ("ModelInferRequest", "raw_input_contents", 7, BYTES, REPEATED, None),
    ("ModelInferRequest.InferInputTensor", "name", 1, STR, OPTIONAL, None),
    ("ModelInferRequest.InferInputTensor", "datatype", 2, STR, OPTIONAL, None),
    ("ModelInferRequest.InferInputTensor", "shape", 3, I64, REPEATED, None),
    ("ModelInferRequest.InferInputTensor", "parameters", 4, MSG, REPEATED,
     "ModelInferRequest.InferInputTensor.ParametersEntry"),
    ("ModelInferRequest.InferInputTensor", "contents", 5, MSG, OPTIONAL, "InferTensorContents"),
    ("ModelInferRequest.InferRequestedOutputTensor", "name", 1, STR, OPTIONAL, None),
    ("ModelInferRequest.InferRequestedOutputTensor", "parameters", 2, MSG, REPEATED,
     "ModelInferRequest.InferRequestedOutputTensor.ParametersEntry"),
    ("ModelInferResponse", "model_name", 1, STR, OPTIONAL, None),
    ("ModelInferResponse", "model_version", 2, STR, OPTIONAL, None),
    ("ModelInferResponse", "id", 3, STR, OPTIONAL, None),
    ("ModelInferResponse", "parameters", 4, MSG, REPEATED, "ModelInferResponse.ParametersEntry"),
    ("ModelInferResponse", "outputs", 5, MSG, REPEATED, "ModelInferResponse.InferOutputTensor"),
    ("ModelInferResponse", "raw_output_contents", 6, BYTES, REPEATED, None),
    ("ModelInferResponse.InferOutputTensor", "name", 1, STR, OPTIONAL, None),
    ("ModelInferResponse.InferOutputTensor", "datatype", 2, STR, OPTIONAL, None),
    ("ModelInferResponse.InferOutputTensor", "shape", 3, I64, REPEATED, None),
    ("ModelInferResponse.InferOutputTensor", "contents", 5, MSG, OPTIONAL, "InferTensorContents"),
    ("ModelStreamInferResponse", "error_message", 1, STR, OPTIONAL, None),
    ("ModelStreamInferResponse", "infer_response", 2, MSG, OPTIONAL, "ModelInferResponse"),
    ("ModelConfigRequest", "name", 1, STR, OPTIONAL, None),
    ("ModelConfigRequest", "version", 2, STR, OPTIONAL, None),
    ("ModelConfigResponse", "config", 1, MSG, OPTIONAL, "ModelConfig"),
    ("ModelConfig", "name", 1, STR, OPTIONAL, None),
    ("ModelConfig", "platform", 2, STR, OPTIONAL, None),
    ("ModelConfig", "max_batch_size", 4, I32, OPTIONAL, None),
    ("ModelConfig", "input", 5, MSG, REPEATED, "ModelInput"),
    ("ModelConfig", "output", 6, MSG, REPEATED, "ModelOutput"),
    ("ModelConfig", "backend", 17, STR, OPTIONAL, None),
    ("ModelInput", "name", 1, STR, OPTIONAL, None),
    ("ModelInput", "data_type", 2, ENUM, OPTIONAL, "DataType"),
    ("ModelInput", "format", 3, ENUM, OPTIONAL, "ModelInput.Format"),
    ("ModelInput", "dims", 4, I64, REPEATED, None),
    ("ModelInput", "optional", 8, BOOL, OPTIONAL, None),
    ("ModelOutput", "name", 1, STR, OPTIONAL, None),
    ("ModelOutput", "data_type", 2, ENUM, OPTIONAL, "DataType"),
    ("ModelOutput", "dims", 3, I64, REPEATED, None),
    ("ModelConfig", "dynamic_batching", 11, MSG, OPTIONAL, "ModelDynamicBatching"),
    ("ModelDynamicBatching", "priority_levels", 4, U64, OPTIONAL, None),
    ("ModelDynamicBatching", "default_priority_level", 5, U64, OPTIONAL, None),
    ("ModelDynamicBatching", "default_queue_policy", 6, MSG, OPTIONAL, "ModelQueuePolicy"),
    ("ModelQueuePolicy", "timeout_action", 1, ENUM, OPTIONAL, "ModelQueuePolicy.TimeoutAction"),
    ("ModelQueuePolicy", "default_timeout_microseconds", 2, U64, OPTIONAL, None),
    ("ModelQueuePolicy", "allow_timeout_override", 3, BOOL, OPTIONAL, None),
    ("ModelStatisticsRequest", "name", 1, STR, OPTIONAL, None),
    ("ModelStatisticsRequest", "version", 2, STR, OPTIONAL, None),
    ("ModelStatisticsResponse", "model_stats", 1, MSG, REPEATED, "ModelStatistics"),
    ("ModelStatistics", "name", 1, STR, OPTIONAL, None),
    ("ModelStatistics", "version", 2, STR, OPTIONAL, None),
    ("ModelStatistics", "last_inference", 3, U64, OPTIONAL, None),
    ("ModelStatistics", "inference_count", 4, U64, OPTIONAL, None),
    ("ModelStatistics", "execution_count", 5, U64, OPTIONAL, None),
    ("ModelStatistics", "inference_stats", 6, MSG, OPTIONAL, "InferStatistics"),
    ("ModelStatistics", "batch_stats", 7, MSG, REPEATED, "InferBatchStatistics"),
    ("InferStatistics", "success", 1, MSG, OPTIONAL, "StatisticDuration"),
    ("InferStatistics", "fail", 2, MSG, OPTIONAL, "StatisticDuration"),
    ("InferStatistics", "queue", 3, MSG, OPTIONAL, "StatisticDuration"),
    ("InferStatistics", "compute_input", 4, MSG, OPTIONAL, "StatisticDuration"),
    ("InferStatistics", "compute_infer", 5, MSG, OPTIONAL, "StatisticDuration"),
    ("InferStatistics", "compute_output", 6, MSG, OPTIONAL, "StatisticDuration"),
    ("InferStatistics", "cache_hit", 7, MSG, OPTIONAL, "StatisticDuration"),
    ("InferStatistics", "cache_miss", 8, MSG, OPTIONAL, "StatisticDuration"),
    ("StatisticDuration", "count", 1, U64, OPTIONAL, None),
    ("StatisticDuration", "ns", 2, U64, OPTIONAL, None),
    ("InferBatchStatistics", "batch_size", 1, U64, OPTIONAL, None),
    ("InferBatchStatistics", "compute_input", 2, MSG, OPTIONAL, "StatisticDuration"),
    ("InferBatchStatistics", "compute_infer", 3, MSG, OPTIONAL, "StatisticDuration"),
    ("InferBatchStatistics", "compute_output", 4, MSG, OPTIONAL, "StatisticDuration"),
    # Triton's model repository extension (grpc_service.proto)
    ("RepositoryIndexRequest", "repository_name", 1, STR, OPTIONAL, None),
    ("RepositoryIndexRequest", "ready", 2, BOOL, OPTIONAL, None),
    ("RepositoryIndexResponse", "models", 1, MSG, REPEATED, "RepositoryIndexResponse.ModelIndex"),
    ("RepositoryIndexResponse.ModelIndex", "name", 1, STR, OPTIONAL, None),
    ("RepositoryIndexResponse.ModelIndex", "version", 2, STR, OPTIONAL, None),
    ("RepositoryIndexResponse.ModelIndex", "state", 3, STR, OPTIONAL, None),
    ("RepositoryIndexResponse.ModelIndex", "reason", 4, STR, OPTIONAL, None),
    ("ModelRepositoryParameter", "bool_param", 1, BOOL, OPTIONAL, None),
    ("ModelRepositoryParameter", "int64_param", 2, I64, OPTIONAL, None),
    ("ModelRepositoryParameter", "string_param", 3, STR, OPTIONAL, None),
    ("ModelRepositoryParameter", "bytes_param", 4, BYTES, OPTIONAL, None),
    ("RepositoryModelLoadRequest", "repository_name", 1, STR, OPTIONAL, None),
    ("RepositoryModelLoadRequest", "model_name", 2, STR, OPTIONAL, None),
    ("RepositoryModelUnloadRequest", "repository_name", 1, STR, OPTIONAL, None),
    ("RepositoryModelUnloadRequest", "model_name", 2, STR, OPTIONAL, None),
    # Triton's shared memory extensions (grpc_service.proto)
    ("SystemSharedMemoryStatusRequest", "name", 1, STR, OPTIONAL, None),
    ("SystemSharedMemoryStatusResponse", "regions", 1, MSG, REPEATED, "SystemSharedMemoryStatusResponse.RegionsEntry"),
    ("SystemSharedMemoryStatusResponse.RegionStatus", "name", 1, STR, OPTIONAL, None),
    ("SystemSharedMemoryStatusResponse.RegionStatus", "key", 2, STR, OPTIONAL, None),
    ("SystemSharedMemoryStatusResponse.RegionStatus", "offset", 3, U64, OPTIONAL, None),
    ("SystemSharedMemoryStatusResponse.RegionStatus", "byte_size", 4, U64, OPTIONAL, None),
    ("SystemSharedMemoryRegisterRequest", "name", 1, STR, OPTIONAL, None),
    ("SystemSharedMemoryRegisterRequest", "key", 2, STR, OPTIONAL, None),
    ("SystemSharedMemoryRegisterRequest", "offset", 3, U64, OPTIONAL, None),
    ("SystemSharedMemoryRegisterRequest", "byte_size", 4, U64, OPTIONAL, None),
    ("SystemSharedMemoryUnregisterRequest", "name", 1, STR, OPTIONAL, None),
    ("CudaSharedMemoryStatusRequest", "name", 1, STR, OPTIONAL, None),
    ("CudaSharedMemoryStatusResponse", "regions", 1, MSG, REPEATED, "CudaSharedMemoryStatusResponse.RegionsEntry"),
    ("CudaSharedMemoryStatusResponse.RegionStatus", "name", 1, STR, OPTIONAL, None),
    ("CudaSharedMemoryStatusResponse.RegionStatus", "device_id", 2, U64, OPTIONAL, None),
    ("CudaSharedMemoryStatusResponse.RegionStatus", "byte_size", 3, U64, OPTIONAL, None),
    ("CudaSharedMemoryRegisterRequest", "name", 1, STR, OPTIONAL, None),
    ("CudaSharedMemoryRegisterRequest", "raw_handle", 2, BYTES, OPTIONAL, None),
    ("CudaSharedMemoryRegisterRequest", "device_id", 3, I64, OPTIONAL, None),
    ("CudaSharedMemoryRegisterRequest", "byte_size", 4, U64, OPTIONAL, None),
    ("CudaSharedMemoryUnregisterRequest", "name", 1, STR, OPTIONAL, None),
]


def _message(dotted: str) -> _d.Descriptor:
    head, *rest = dotted.split(".")
    desc = pb.DESCRIPTOR.message_types_by_name[head]
    for part in rest:
        desc = desc.nested_types_by_name[part]
    return desc


@pytest.mark.parametrize(
    "message,field,number,ftype,label,ref",
    WIRE_TABLE,
    ids=[f"{m}.{f}" for m, f, *_ in WIRE_TABLE],
)
def test_wire_field(message, field, number, ftype, label, ref):
    fd = _message(message).fields_by_name[field]
    assert fd.number == number
    assert fd.type == ftype
    assert _label(fd) == label
    if ftype == MSG:
        assert fd.message_type.full_name == f"inference.{ref}"
    elif ftype == ENUM:
        assert fd.enum_type.full_name == f"inference.{ref}"


def test_wire_table_covers_every_field():
    # Every field we define is pinned above (map entries aside).
    listed = {(m, f) for m, f, *_ in WIRE_TABLE}
    missing = []

    def walk(desc, prefix):
        if desc.GetOptions().map_entry:
            return
        for fd in desc.fields:
            if (prefix, fd.name) not in listed and not (
                fd.message_type is not None and fd.message_type.GetOptions().map_entry
            ):
                missing.append(f"{prefix}.{fd.name}")
        for nested in desc.nested_types:
            walk(nested, f"{prefix}.{nested.name}")

    for name, desc in pb.DESCRIPTOR.message_types_by_name.items():
        walk(desc, name)
    assert not missing, missing


@pytest.mark.parametrize(
    "message", ["ModelInferRequest", "ModelInferRequest.InferInputTensor",
                "ModelInferRequest.InferRequestedOutputTensor", "ModelInferResponse",
                "ModelInferResponse.InferOutputTensor"],
)
def test_parameters_are_string_to_infer_parameter_maps(message):
    entry = _message(message).fields_by_name["parameters"].message_type
    assert entry.GetOptions().map_entry
    assert entry.fields_by_name["key"].type == STR
    assert entry.fields_by_name["value"].message_type.full_name == "inference.InferParameter"


def test_infer_parameter_oneof():
    oneof = pb.InferParameter.DESCRIPTOR.oneofs_by_name["parameter_choice"]
    assert [f.name for f in oneof.fields] == [
        "bool_param", "int64_param", "string_param", "double_param", "uint64_param"]


def test_datatype_enum():
    expected = ["INVALID", "BOOL", "UINT8", "UINT16", "UINT32", "UINT64", "INT8", "INT16",
                "INT32", "INT64", "FP16", "FP32", "FP64", "STRING", "BF16"]
    values = pb.DESCRIPTOR.enum_types_by_name["DataType"].values
    assert [(v.name, v.number) for v in values] == [
        (f"TYPE_{n}", i) for i, n in enumerate(expected)]
    fmt = pb.ModelInput.DESCRIPTOR.enum_types_by_name["Format"]
    assert [(v.name, v.number) for v in fmt.values] == [
        ("FORMAT_NONE", 0), ("FORMAT_NHWC", 1), ("FORMAT_NCHW", 2)]
    action = pb.ModelQueuePolicy.DESCRIPTOR.enum_types_by_name["TimeoutAction"]
    assert [(v.name, v.number) for v in action.values] == [("REJECT", 0), ("DELAY", 1)]


# --------------------------------------------------------------------------
# (c) round trip
# --------------------------------------------------------------------------


def test_model_infer_request_round_trip():
    import struct

    query = struct.pack("<6f", *[0.5, -1.0, 2.25, 3.0, 0.0, -0.125])
    mask = bytes([1, 0, 1])
    req = pb.ModelInferRequest(model_name="self_attention", model_version="1", id="req-7")
    req.parameters["priority"].uint64_param = 2
    req.parameters["tag"].string_param = "bench"
    q = req.inputs.add(name="query", datatype="FP32", shape=[1, 2, 3])
    q.parameters["note"].bool_param = True
    req.inputs.add(name="mask", datatype="BOOL", shape=[1, 3])
    req.outputs.add(name="output")
    req.raw_input_contents.extend([query, mask])

    wire = req.SerializeToString()
    back = pb.ModelInferRequest.FromString(wire)

    assert back == req
    assert back.model_name == "self_attention" and back.id == "req-7"
    assert [(t.name, t.datatype, list(t.shape)) for t in back.inputs] == [
        ("query", "FP32", [1, 2, 3]), ("mask", "BOOL", [1, 3])]
    assert not back.inputs[0].HasField("contents")
    assert list(back.raw_input_contents) == [query, mask]
    assert struct.unpack("<6f", back.raw_input_contents[0])[2] == 2.25
    assert back.parameters["priority"].WhichOneof("parameter_choice") == "uint64_param"
    assert back.parameters["priority"].uint64_param == 2
    assert back.inputs[0].parameters["note"].bool_param is True
    assert [o.name for o in back.outputs] == ["output"]


def test_raw_input_contents_wire_bytes():
    # Field 7, wire type 2 (length-delimited): tag byte 0x3a, then length, then data.
    req = pb.ModelInferRequest(raw_input_contents=[b"\x01\x02\x03"])
    assert req.SerializeToString() == b"\x3a\x03\x01\x02\x03"
    resp = pb.ModelInferResponse(raw_output_contents=[b"\xff"])
    assert resp.SerializeToString() == b"\x32\x01\xff"  # field 6


def test_stream_response_and_statistics_round_trip():
    resp = pb.ModelStreamInferResponse(
        infer_response=pb.ModelInferResponse(model_name="m", raw_output_contents=[b"abc"]))
    assert pb.ModelStreamInferResponse.FromString(resp.SerializeToString()) == resp

    stats = pb.ModelStatisticsResponse(model_stats=[pb.ModelStatistics(
        name="m", version="1", last_inference=1_700_000_000_000, inference_count=64,
        execution_count=1,
        inference_stats=pb.InferStatistics(success=pb.StatisticDuration(count=64, ns=10**9)),
        batch_stats=[pb.InferBatchStatistics(
            batch_size=64, compute_infer=pb.StatisticDuration(count=1, ns=5000))])])
    back = pb.ModelStatisticsResponse.FromString(stats.SerializeToString())
    assert back == stats
    assert back.model_stats[0].inference_stats.success.ns == 10**9


@pytest.mark.parametrize("message", ["ModelRepositoryParameter", "RepositoryIndexRequest", "RepositoryIndexResponse",
                                     "RepositoryModelLoadRequest", "RepositoryModelLoadResponse",
                                     "RepositoryModelUnloadRequest", "RepositoryModelUnloadResponse"])
def test_repository_messages_are_tritons(message):
    """The model repository messages are Triton's own, field for field (tritonclient's
    grpc_service.proto, which the package pins as a test dependency), maps and oneofs included."""
    service_pb2 = pytest.importorskip("tritonclient.grpc.service_pb2")
    from google.protobuf import descriptor_pb2

    def shape(desc):
        proto = descriptor_pb2.DescriptorProto()
        desc.CopyToProto(proto)
        return proto

    ours, theirs = shape(_message(message)), shape(service_pb2.DESCRIPTOR.message_types_by_name[message])
    assert ours == theirs


def test_repository_rpcs_are_tritons():
    service_pb2 = pytest.importorskip("tritonclient.grpc.service_pb2")
    ours = pb.DESCRIPTOR.services_by_name["GRPCInferenceService"].methods_by_name
    theirs = service_pb2.DESCRIPTOR.services_by_name["GRPCInferenceService"].methods_by_name
    for name in ("RepositoryIndex", "RepositoryModelLoad", "RepositoryModelUnload"):
        assert (ours[name].input_type.full_name, ours[name].output_type.full_name) == (
            theirs[name].input_type.full_name, theirs[name].output_type.full_name)


@pytest.mark.parametrize("message", ["ModelConfig", "ModelDynamicBatching", "ModelQueuePolicy"])
def test_model_configuration_fields_are_tritons(message):
    """The fields of Triton's model configuration we define have Triton's numbers and types
    (tritonclient's model_config.proto), so its clients read our dynamic_batching."""
    config_pb2 = pytest.importorskip("tritonclient.grpc.model_config_pb2")
    theirs = {f.name: (f.number, f.type) for f in config_pb2.DESCRIPTOR.message_types_by_name[message].fields}
    ours = {f.name: (f.number, f.type) for f in _message(message).fields}
    assert ours.items() <= theirs.items()
