"""Regenerate the checked-in gRPC stubs from ``proto/inference.proto``.

    python -m attnserve.proto.generate           # rewrite proto/inference_pb2{.py,.pyi,_grpc.py}
    python -m attnserve.proto.generate --check   # exit 1 if the checked-in stubs are stale

The .proto is compiled as ``attnserve/proto/inference.proto`` (the path the installed
package gives it), so the service stub imports ``from attnserve.proto import inference_pb2``.

This is the only module that imports ``grpc_tools`` (grpcio-tools, a dev
dependency); the server and client only need the generated files.

Why grpcio-tools 1.72.1 (pinned in the dev extra). The generated ``inference_pb2.py`` calls
``runtime_version.ValidateProtobufRuntimeVersion(major, minor, patch)`` with the version of the
protoc inside grpcio-tools and refuses any protobuf runtime older than that ("Detected
incompatible Protobuf Gencode/Runtime versions ... Runtime version cannot be older than the
linked gencode version"); protobuf 7 accepts 6.x gencode (one major version back is within
protobuf's cross-version runtime guarantee), silently. ``inference_pb2_grpc.py`` likewise
refuses a grpcio older than its ``GRPC_GENERATED_VERSION``. So the generator's versions are the
floor we can declare, and we generate with the oldest grpcio-tools whose stubs load on the whole
range ``protobuf>=6.30.0,<8`` (tried by import and round trip on protobuf 6.30.0, 6.31.0,
6.31.1, 6.33.5, 6.33.6, 7.34.0, 7.35.1, 7.36.2):

* 1.72.1 writes gencode 6.30.0 and ``GRPC_GENERATED_VERSION = '1.72.1'``: hence
  ``protobuf>=6.30.0,<8`` and grpcio, grpcio-health-checking, grpcio-reflection ``>=1.72.1`` in
  pyproject.toml. (1.72.0 writes the same, but is yanked.)
* 1.71.x writes gencode 5.29.0, two major versions behind protobuf 7 (outside the guarantee;
  protobuf 6.30 and 6.31 already warn about it), and itself needs protobuf<6, so the dev
  extra could not resolve beside tritonclient[grpc] (protobuf>=6.30,<7).
* 1.73.x writes 6.31.0, 1.74-1.80 6.31.1, 1.81.1 6.33.5: each would only raise the floor.
  1.82 and later write 7.35.x gencode, which no protobuf 6 loads, and tritonclient and KServe
  need protobuf<7.

The messages register in a descriptor pool of their own (``_private_pool`` below), not in
protobuf's process-wide default pool: tritonclient's grpc_service.proto and KServe's
grpc_predict_v2.proto define the same ``inference.*`` names there, and a pool refuses a second
definition of a name ("duplicate symbol 'inference.ServerLiveRequest'"). With the private pool
``attnserve.proto`` imports beside either of them. The wire is unchanged: a message serializes
the same whatever pool holds its descriptor. Server reflection is given a pool that holds this
file (``attnserve.proto.reflection_pool``). This isolation holds on protobuf's default (upb)
backend; the pure-Python one (PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION=python) also enters each
generated message class in the default pool through the default symbol database, so there the
conflict remains.
"""

from __future__ import annotations

import argparse
import difflib
import shutil
import sys
import tempfile
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent
REPO_ROOT = PACKAGE_DIR.parent
PROTO_FILE = PACKAGE_DIR / "inference.proto"
# The generated files, in the order generate() returns them.
GENERATED = ("inference_pb2.py", "inference_pb2.pyi", "inference_pb2_grpc.py")

# The stubs are compiled as the installed package sees them: the .proto is laid out as
# attnserve/proto/inference.proto under a temporary include root, so its descriptor is named
# "attnserve/proto/inference.proto", the messages module is attnserve.proto.inference_pb2, and
# the service stub imports `from attnserve.proto import inference_pb2`.
PACKAGE_PATH = Path("attnserve") / "proto"
_PACKAGE_IMPORT = "from attnserve.proto import inference_pb2 as "

# What protoc writes to build the file's descriptor in the default pool, and what we write instead.
_DEFAULT_POOL = "DESCRIPTOR = _descriptor_pool.Default().AddSerializedFile("
_PRIVATE_POOL = (
    "# attnserve: a descriptor pool of its own, not the process-wide default one, so that these\n"
    "# `inference.*` names do not collide with tritonclient's or KServe's (see attnserve.proto.generate).\n"
    "_POOL = _descriptor_pool.DescriptorPool()\n"
    "DESCRIPTOR = _POOL.AddSerializedFile("
)


def _private_pool(text: str) -> str:
    """inference_pb2.py with its file added to a pool of its own instead of the default pool."""
    if text.count(_DEFAULT_POOL) != 1:
        raise RuntimeError(f"inference_pb2.py: expected one `{_DEFAULT_POOL}`, found {text.count(_DEFAULT_POOL)}; "
                           "has grpcio-tools changed what it generates?")
    return text.replace(_DEFAULT_POOL, _PRIVATE_POOL)


def generate(out_dir: Path) -> list[Path]:
    """Compile inference.proto; write the three generated files into ``out_dir``.

    Returns their paths, in the order of ``GENERATED``.
    """
    from grpc_tools import protoc  # dev-only dependency; imported lazily

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="attnserve-proto-") as tmp:
        root = Path(tmp) / "src"
        source = root / PACKAGE_PATH / PROTO_FILE.name
        source.parent.mkdir(parents=True)
        shutil.copyfile(PROTO_FILE, source)
        built = Path(tmp) / "out"
        built.mkdir()
        args = [
            "grpc_tools.protoc",
            f"-I{root}",
            f"--python_out={built}",
            f"--pyi_out={built}",
            f"--grpc_python_out={built}",
            str(source),
        ]
        rc = protoc.main(args)
        if rc != 0:
            raise RuntimeError(f"protoc failed with exit status {rc}: {' '.join(args)}")
        paths = []
        for name in GENERATED:
            src = built / PACKAGE_PATH / name
            if not src.is_file():
                raise RuntimeError(f"protoc did not produce {name}")
            if name == "inference_pb2_grpc.py" and _PACKAGE_IMPORT not in src.read_text(encoding="utf-8"):
                raise RuntimeError(f"inference_pb2_grpc.py does not import `{_PACKAGE_IMPORT.strip()}`")
            dst = out_dir / name
            if name == "inference_pb2.py":
                # bytes, not text: the checked-in file is compared byte for byte
                dst.write_bytes(_private_pool(src.read_bytes().decode("utf-8")).encode("utf-8"))
            else:
                shutil.copyfile(src, dst)
            paths.append(dst)
    return paths


def check() -> int:
    """Regenerate into a temporary directory and compare with the checked-in files.

    Prints a summary and returns 1 if any file is missing or differs, else 0.
    """
    stale = []
    with tempfile.TemporaryDirectory(prefix="attnserve-proto-check-") as tmp:
        for fresh in generate(Path(tmp)):
            current = PACKAGE_DIR / fresh.name
            rel = current.relative_to(REPO_ROOT)
            if not current.is_file():
                stale.append(f"{rel}: missing")
                continue
            new, old = fresh.read_bytes(), current.read_bytes()
            if new == old:
                continue
            diff = list(
                difflib.unified_diff(
                    old.decode("utf-8", "replace").splitlines(),
                    new.decode("utf-8", "replace").splitlines(),
                    lineterm="",
                    n=0,
                )
            )
            added = sum(1 for line in diff if line.startswith("+") and not line.startswith("+++"))
            removed = sum(1 for line in diff if line.startswith("-") and not line.startswith("---"))
            stale.append(f"{rel}: differs (+{added} -{removed} lines)")
    if stale:
        print("generated stubs are out of date with proto/inference.proto:", file=sys.stderr)
        for line in stale:
            print(f"  {line}", file=sys.stderr)
        print("run `python -m attnserve.proto.generate` (or `make proto`) to update them", file=sys.stderr)
        return 1
    print("proto stubs are up to date")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m attnserve.proto.generate", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--check",
        action="store_true",
        help="do not write; exit 1 if the checked-in stubs differ from a fresh generation",
    )
    ns = parser.parse_args(argv)
    if ns.check:
        return check()
    for path in generate(PACKAGE_DIR):
        print(f"wrote {path.relative_to(REPO_ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
