"""The attention module, its weights, and the ONNX export that proves parity before it writes.

Importing this package is cheap: torch is imported by the submodules that need it.
"""
