"""attnserve: multi-head attention served over the Open Inference Protocol (KServe V2).

One import root for everything the distribution installs:

    attnserve.contract   the tensor contract and the model repository's layout (a leaf)
    attnserve.server     the gRPC server (never imports torch)
    attnserve.client     the Python client and the resumable batch job
    attnserve.export     the PyTorch module and its ONNX export (needs the `export` extra)
    attnserve.proto      the protocol's checked-in stubs

The repository keeps its top-level folders (server/, client/, export/, proto/); pyproject.toml
maps each one under this package. `attnserve` (or `python -m attnserve`) is the command line.
"""

__version__ = "0.1.0"
