"""Regenerate the checked-in gRPC stubs from ``proto/inference.proto``.

    python -m proto.generate           # rewrite proto/inference_pb2{.py,.pyi,_grpc.py}
    python -m proto.generate --check   # exit 1 if the checked-in stubs are stale

The .proto is compiled with the repository root as the include path (``-I .``),
so its descriptor name is ``proto/inference.proto`` and the service stub
imports ``from proto import inference_pb2``.

This is the only module that imports ``grpc_tools`` (grpcio-tools, a dev
dependency); the server and client only need the generated files.
"""

from __future__ import annotations

import argparse
import difflib
import re
import shutil
import sys
import tempfile
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent
REPO_ROOT = PACKAGE_DIR.parent
PROTO_FILE = PACKAGE_DIR / "inference.proto"
# The generated files, in the order generate() returns them.
GENERATED = ("inference_pb2.py", "inference_pb2.pyi", "inference_pb2_grpc.py")

# protoc's grpc plugin writes the import of the messages module from the path
# of the .proto relative to the include root. With `-I .` that is already
# `from proto import inference_pb2 as ...`; should a different include root
# ever yield the flat form, rewrite it so the package import still works.
_FLAT_IMPORT = re.compile(r"^import inference_pb2 as (\w+)$", re.MULTILINE)
_PACKAGE_IMPORT = "from proto import inference_pb2 as "


def _fix_grpc_import(text: str) -> str:
    text = _FLAT_IMPORT.sub(lambda m: _PACKAGE_IMPORT + m.group(1), text)
    if _PACKAGE_IMPORT not in text:
        raise RuntimeError(
            "inference_pb2_grpc.py does not import `from proto import inference_pb2`"
        )
    return text


def generate(out_dir: Path) -> list[Path]:
    """Compile inference.proto; write the three generated files into ``out_dir``.

    Returns their paths, in the order of ``GENERATED``.
    """
    from grpc_tools import protoc  # dev-only dependency; imported lazily

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="attnserve-proto-") as tmp:
        args = [
            "grpc_tools.protoc",
            f"-I{REPO_ROOT}",
            f"--python_out={tmp}",
            f"--pyi_out={tmp}",
            f"--grpc_python_out={tmp}",
            str(PROTO_FILE),
        ]
        rc = protoc.main(args)
        if rc != 0:
            raise RuntimeError(f"protoc failed with exit status {rc}: {' '.join(args)}")
        # protoc places the outputs under the .proto's directory relative to -I.
        produced = Path(tmp) / PROTO_FILE.parent.relative_to(REPO_ROOT)
        paths = []
        for name in GENERATED:
            src = produced / name
            if not src.is_file():
                raise RuntimeError(f"protoc did not produce {name}")
            dst = out_dir / name
            if name == "inference_pb2_grpc.py":
                text = _fix_grpc_import(src.read_text(encoding="utf-8"))
                dst.write_bytes(text.encode("utf-8"))
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
            added = sum(1 for l in diff if l.startswith("+") and not l.startswith("+++"))
            removed = sum(1 for l in diff if l.startswith("-") and not l.startswith("---"))
            stale.append(f"{rel}: differs (+{added} -{removed} lines)")
    if stale:
        print("generated stubs are out of date with proto/inference.proto:", file=sys.stderr)
        for line in stale:
            print(f"  {line}", file=sys.stderr)
        print("run `python -m proto.generate` (or `make proto`) to update them", file=sys.stderr)
        return 1
    print("proto stubs are up to date")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m proto.generate", description=__doc__.splitlines()[0])
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
