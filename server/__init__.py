"""The inference server: Open Inference Protocol over gRPC, dynamic batching, ONNX Runtime."""

__version__ = "0.1.0"
