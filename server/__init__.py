"""The inference server: Open Inference Protocol over gRPC, dynamic batching, ONNX Runtime."""

from attnserve import __version__  # one version for the distribution

__all__ = ["__version__"]
