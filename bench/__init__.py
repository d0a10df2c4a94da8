"""The benchmark: the server under load against in-process ONNX Runtime, in the same run."""
