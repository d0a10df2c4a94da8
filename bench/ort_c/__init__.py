"""ONNX Runtime's C API against its Python session for the native plane (issue 26): bench.ort_c.bench."""
