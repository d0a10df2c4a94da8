"""Open Inference Protocol (KServe V2) gRPC definitions for attnserve.

``inference.proto`` is the hand-written source; ``inference_pb2``,
``inference_pb2.pyi`` and ``inference_pb2_grpc`` are generated from it and
checked in (regenerate with ``python -m attnserve.proto.generate``). Import them as
``from attnserve.proto import inference_pb2, inference_pb2_grpc``.

The messages live in a descriptor pool of their own, not protobuf's default pool, so that they
import beside tritonclient's and KServe's stubs of the same ``inference.*`` names (see
``attnserve.proto.generate``).
"""

from __future__ import annotations

from collections.abc import Iterable

from google.protobuf import descriptor_pool

REFLECTION_V1 = "grpc.reflection.v1.ServerReflection"
REFLECTION_V1_FILE = "grpc/reflection/v1/reflection.proto"
_V1ALPHA, _V1 = "grpc.reflection.v1alpha", "grpc.reflection.v1"


def reflection_v1_file():
    """grpc.reflection.v1's FileDescriptorProto, made from v1alpha's (grpcio-reflection ships
    v1alpha alone): the two files define the same messages and service, field for field, and
    differ only in their package and language options, so v1 calls are served by the v1alpha
    servicer and its (de)serializers, and this file describes them as v1."""
    from google.protobuf import descriptor_pb2
    from grpc_reflection.v1alpha import reflection_pb2

    file = descriptor_pb2.FileDescriptorProto()
    reflection_pb2.DESCRIPTOR.CopyToProto(file)
    file.name, file.package = REFLECTION_V1_FILE, _V1
    file.options.Clear()

    def rename(type_name: str) -> str:
        return type_name.replace(f".{_V1ALPHA}.", f".{_V1}.", 1)

    def fix(message) -> None:
        for field in message.field:
            if field.type_name:  # scalars have none (setting "" would mark it set)
                field.type_name = rename(field.type_name)
        for nested in message.nested_type:
            fix(nested)

    for message in file.message_type:
        fix(message)
    for service in file.service:
        for method in service.method:
            method.input_type, method.output_type = rename(method.input_type), rename(method.output_type)
    return file


def reflection_pool(service_names: Iterable[str]) -> descriptor_pool.DescriptorPool:
    """A new descriptor pool that resolves each of ``service_names``, for server reflection.

    Reflection looks every symbol up in one pool, and no existing one has them all: our service
    is in inference_pb2's private pool, grpc.health.v1 and reflection itself in protobuf's
    default pool. This one holds a copy of inference.proto and, for each other service, the
    default pool's file that defines it, with the files that file imports.
    """
    from attnserve.proto import inference_pb2  # here, so that importing the package stays cheap

    pool = descriptor_pool.DescriptorPool()
    added: set[str] = set()

    def add(file) -> None:
        if file.name in added:
            return
        for dependency in file.dependencies:  # a pool needs a file's imports before the file
            add(dependency)
        pool.AddSerializedFile(file.serialized_pb)
        added.add(file.name)

    add(inference_pb2.DESCRIPTOR)
    for name in service_names:
        try:
            pool.FindServiceByName(name)
            continue
        except KeyError:
            pass
        if name == REFLECTION_V1:
            pool.AddSerializedFile(reflection_v1_file().SerializeToString())
            continue
        try:
            add(descriptor_pool.Default().FindFileContainingSymbol(name))
        except KeyError:
            raise KeyError(f"service {name!r} is neither in {inference_pb2.DESCRIPTOR.name} nor in protobuf's "
                           "default descriptor pool: import its generated _pb2 module first") from None
    return pool
