"""Open Inference Protocol (KServe V2) gRPC definitions for attnserve.

``inference.proto`` is the hand-written source; ``inference_pb2``,
``inference_pb2.pyi`` and ``inference_pb2_grpc`` are generated from it and
checked in (regenerate with ``python -m attnserve.proto.generate``). Import them as
``from attnserve.proto import inference_pb2, inference_pb2_grpc``.
"""
