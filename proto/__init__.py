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
        try:
            add(descriptor_pool.Default().FindFileContainingSymbol(name))
        except KeyError:
            raise KeyError(f"service {name!r} is neither in {inference_pb2.DESCRIPTOR.name} nor in protobuf's "
                           "default descriptor pool: import its generated _pb2 module first") from None
    return pool
