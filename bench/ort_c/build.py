"""Build bench/ort_c/ort_c_bench.cc with g++ against the onnxruntime wheel's own libonnxruntime.so.

The wheel ships the library but not its C headers, and pip cannot give them: $ORT_C_HEADERS names
where they are, either a folder holding onnxruntime_c_api.h (and the headers it includes) or a git
directory whose HEAD has them (a fetched copy of a repository: at its root, or where
microsoft/onnxruntime keeps them). They are copied into build/ort_c/include at build time (MIT
licensed: Microsoft's copyright line travels with them); build/ is git-ignored, so none is committed.
A later build finds them there without $ORT_C_HEADERS.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
from pathlib import Path

import onnxruntime

REPO_ROOT = Path(__file__).resolve().parents[2]
SOURCE = Path(__file__).with_name("ort_c_bench.cc")
BUILD = REPO_ROOT / "build" / "ort_c"
INCLUDE = BUILD / "include"
BINARY = BUILD / "ort_c_bench"
HEADERS_ENV = "ORT_C_HEADERS"
MAIN_HEADER = "onnxruntime_c_api.h"
# Where a git tree keeps the headers: a repository that vendors them at its root, or ONNX Runtime's own.
_TREE_FOLDERS = ("", "include/onnxruntime/core/session/")


class Unavailable(RuntimeError):
    """The program cannot be built here; the message says why (a test skips with it)."""


def library() -> Path:
    """The wheel's libonnxruntime.so.<version>: the ONNX Runtime the Python session runs."""
    capi = Path(onnxruntime.__file__).parent / "capi"
    found = sorted(capi.glob("libonnxruntime.so*"))
    if not found:
        raise Unavailable(f"onnxruntime {onnxruntime.__version__} has no libonnxruntime.so in {capi}")
    return found[-1]


def header_api_version(include: Path = INCLUDE) -> int:
    """ORT_API_VERSION of the headers in `include` (the C API revision they declare)."""
    match = re.search(r"^#define ORT_API_VERSION (\d+)", (include / MAIN_HEADER).read_text(), re.MULTILINE)
    if match is None:
        raise Unavailable(f"{include / MAIN_HEADER} defines no ORT_API_VERSION")
    return int(match.group(1))


def vendor_headers(source: str | None = None) -> Path:
    """Copy the C headers from $ORT_C_HEADERS (or `source`) into build/ort_c/include; that folder."""
    source = source if source is not None else os.environ.get(HEADERS_ENV)
    if not source:
        if (INCLUDE / MAIN_HEADER).exists():
            return INCLUDE
        raise Unavailable(f"ONNX Runtime's C headers are not available: set ${HEADERS_ENV} to a folder with "
                          f"{MAIN_HEADER} or a git directory that has it (the onnxruntime wheel ships none); "
                          "docs/performance.md, 'The C program and its headers'")
    path = Path(source)
    staged = BUILD / "include.new"
    shutil.rmtree(staged, ignore_errors=True)
    staged.mkdir(parents=True)
    if (path / MAIN_HEADER).is_file():
        _copy_included(lambda name: (path / name).read_bytes() if (path / name).is_file() else None, staged)
    elif (path / "HEAD").is_file() or (path / ".git").exists():
        _headers_from_git(path, staged)
    else:
        raise Unavailable(f"ONNX Runtime's C headers are not available: ${HEADERS_ENV}={source} holds no {MAIN_HEADER} "
                          "and is no git directory")
    shutil.rmtree(INCLUDE, ignore_errors=True)
    staged.rename(INCLUDE)
    return INCLUDE


def _copy_included(read, into: Path) -> None:
    """MAIN_HEADER and the headers it includes with quotes, transitively (`read(name)`: its bytes,
    or None where there is no such file): a folder may hold other projects' headers beside them."""
    wanted, seen = [MAIN_HEADER], set()
    while wanted:
        name = wanted.pop()
        if name in seen:
            continue
        seen.add(name)
        text = read(name)
        if text is None:
            raise Unavailable(f"ONNX Runtime's C headers are not available: {name} is missing beside {MAIN_HEADER}")
        (into / name).write_bytes(text)
        wanted += re.findall(r'^\s*#\s*include\s+"([^"/]+)"', text.decode(), re.MULTILINE)


def _headers_from_git(git_dir: Path, into: Path) -> None:
    def git(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(["git", f"--git-dir={git_dir / '.git' if (git_dir / '.git').exists() else git_dir}",
                               *args], capture_output=True)

    for folder in _TREE_FOLDERS:
        if git("cat-file", "-e", f"HEAD:{folder}{MAIN_HEADER}").returncode == 0:
            def read(name: str, folder: str = folder) -> bytes | None:
                shown = git("show", f"HEAD:{folder}{name}")
                return shown.stdout if shown.returncode == 0 else None

            _copy_included(read, into)
            return
    raise Unavailable(f"ONNX Runtime's C headers are not available: the git directory {git_dir} has no {MAIN_HEADER} "
                      f"in HEAD (looked in {', '.join(f or '/' for f in _TREE_FOLDERS)})")


def build(headers: str | None = None) -> Path:
    """The program, built unless it is up to date with its source, headers and library."""
    include = vendor_headers(headers)
    compiler = shutil.which("g++")
    if compiler is None:
        raise Unavailable("g++ is not installed (Debian: g++)")
    lib = library()
    # The loader looks for the library's soname (libonnxruntime.so.1), which the wheel does not ship
    # beside its file: a link of that name in build/ort_c/lib, the program's rpath.
    libdir = BUILD / "lib"
    libdir.mkdir(parents=True, exist_ok=True)
    soname = libdir / (lib.name.split(".so.")[0] + ".so." + onnxruntime.__version__.split(".")[0])
    soname.unlink(missing_ok=True)
    soname.symlink_to(lib)
    command = [compiler, "-std=c++17", "-O2", "-Wall", "-Wextra", f"-I{include}", str(SOURCE), "-o", str(BINARY),
               str(lib), f"-Wl,-rpath,{libdir}"]
    digest = hashlib.sha256(" ".join(command).encode() + SOURCE.read_bytes()
                            + b"".join(h.read_bytes() for h in sorted(include.glob("*.h")))).hexdigest()
    stamp = BUILD / "ort_c_bench.sha256"
    if BINARY.exists() and stamp.exists() and stamp.read_text() == digest:
        return BINARY
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"g++ failed ({done.returncode}): {done.stderr[-4000:]}")
    stamp.write_text(digest)
    return BINARY
