"""The native data plane (native/, CMake) built into the wheel beside the pure-Python package.

    pip install .                              # with the extension where its dependencies exist
    ATTNSERVE_NATIVE_BUILD=on pip install .    # fail, saying what is missing, instead of going without
    ATTNSERVE_NATIVE_BUILD=off pip install .   # the Python data plane alone, no CMake run

Everything else about the distribution is in pyproject.toml. Where a dependency is missing the
package installs without attnserve.server._native and carries the reason (NATIVE_MISSING_NAME)
for `attnserve --version`, `attnserve serve`'s fallback to the Python plane and `--data-plane
native` to say. docs/native-build.md, "Build".
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent
MODE_VARIABLE = "ATTNSERVE_NATIVE_BUILD"  # auto (the default), on, off
BUILD_DIR_VARIABLE = "ATTNSERVE_NATIVE_BUILD_DIR"  # CMake's build folder; build/native, as `make native`'s
BUILD_VARIABLES = (MODE_VARIABLE, BUILD_DIR_VARIABLE)  # read at build time only: not server settings
MODES = ("auto", "on", "off")
NATIVE_MISSING_NAME = "_native_missing.txt"  # beside the extension's place in an install without it


class NativeBuildError(RuntimeError):
    pass


def build_mode(environ=os.environ) -> str:
    mode = environ.get(MODE_VARIABLE, "auto").strip().lower() or "auto"
    if mode not in MODES:
        raise NativeBuildError(f"{MODE_VARIABLE} must be one of {', '.join(MODES)}, got {mode!r}")
    return mode


def not_built_message(why: str) -> str:
    """What pip's log says where the extension is not built (and why_unavailable() later)."""
    return (f"attnserve: {why}. Installing without the native data plane (attnserve.server._native): "
            f"`attnserve serve` will serve on the Python data plane and log this (`--data-plane native` will "
            f"refuse to start with it). "
            f"Install what is missing and reinstall, or set {MODE_VARIABLE}=on to make this an error.")


class BuildNative(build_ext):
    """The extension by native/CMakeLists.txt, written where setuptools expects it."""

    def run(self) -> None:
        (ext,) = self.extensions
        target = Path(self.get_ext_fullpath(ext.name)).resolve()
        missing_note = target.parent / NATIVE_MISSING_NAME
        if not self.inplace:
            # build/lib persists between builds: an old extension or note must not reach this wheel.
            for stale in [*target.parent.glob("_native*.so"), missing_note]:
                stale.unlink(missing_ok=True)
        mode = build_mode()
        if mode == "off":
            print(f"attnserve: not building the native data plane ({MODE_VARIABLE}=off)", file=sys.stderr)
            note = f"it was built with {MODE_VARIABLE}=off; reinstall attnserve without that to build the plane"
        else:
            why = self._cmake(target, mode)
            if why is None:
                return
            print(f"\n{'*' * 80}\n{not_built_message(why)}\n{'*' * 80}\n", file=sys.stderr, flush=True)
            note = f"{why}; install what is missing, then reinstall attnserve (pip install .)"
        if not self.inplace:  # an editable install keeps `make native`'s extension, if any
            missing_note.parent.mkdir(parents=True, exist_ok=True)
            missing_note.write_text(note + "\n")

    def _cmake(self, target: Path, mode: str) -> str | None:
        """Builds the extension into target's folder; None when built, else why not."""
        cmake = shutil.which("cmake")
        if cmake is None or not (ROOT / "native" / "CMakeLists.txt").exists():
            what = "cmake (Debian: cmake)" if cmake is None else "its sources (native/ is not in this source tree)"
            why = f"the native data plane cannot be built here: missing {what}"
            if mode == "on":
                raise NativeBuildError(why)
            return why
        build_dir = Path(os.environ.get(BUILD_DIR_VARIABLE) or ROOT / "build" / "native").resolve()
        build_dir.mkdir(parents=True, exist_ok=True)
        missing_file = build_dir / "missing.txt"
        missing_file.unlink(missing_ok=True)
        define = {
            "CMAKE_BUILD_TYPE": "Release",
            "Python_EXECUTABLE": sys.executable,
            "ATTNSERVE_MODULE_DIR": str(target.parent),
            "ATTNSERVE_NATIVE_OPTIONAL": "ON",  # CMake lists what is missing; this decides what that means
            "ATTNSERVE_MISSING_FILE": str(missing_file),
        }
        try:
            import pybind11  # pyproject.toml's build requirement; CMake says so where it is absent

            define["pybind11_DIR"] = pybind11.get_cmake_dir()
        except ImportError:
            pass
        configure = [cmake, "-S", str(ROOT / "native"), "-B", str(build_dir)]
        configure += [f"-D{name}={value}" for name, value in define.items()]
        subprocess.run(configure, check=True)
        if missing_file.exists():
            why = missing_file.read_text().strip()
            if mode == "on":
                raise NativeBuildError(f"{why} ({MODE_VARIABLE}=on)")
            return why
        jobs = os.environ.get("CMAKE_BUILD_PARALLEL_LEVEL") or str(len(os.sched_getaffinity(0)))
        subprocess.run([cmake, "--build", str(build_dir), "--target", "_native", "--parallel", jobs], check=True)
        if not target.exists():
            raise NativeBuildError(f"CMake built, but {target} is not there: see native/CMakeLists.txt")
        return None


if __name__ == "__main__":
    # No sources: CMake compiles; the Extension makes the wheel platform-specific and names the file.
    setup(ext_modules=[Extension("attnserve.server._native", sources=[])], cmdclass={"build_ext": BuildNative})
