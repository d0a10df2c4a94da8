"""`pip wheel .` and the native data plane (setup.py, native/CMakeLists.txt; docs/native-build.md,
"Build").

Where the build dependencies exist, the wheel holds attnserve/server/_native*.so, and installed
on its own, outside this checkout, it loads: `attnserve --version` says the plane is available.
Where one is missing the wheel is the pure-Python package plus the reason, which `attnserve
--version` then says; ATTNSERVE_NATIVE_BUILD=on makes it an error instead. The missing dependency
is real, not simulated inside the build: PKG_CONFIG_LIBDIR points pkg-config at an empty folder,
so its own search finds no grpc++.pc, as on a machine without libgrpc++-dev.

The wheel with the extension reuses build/native (`make native`'s folder, which `make test`
builds first), so only what the build's own pybind11 changes is compiled again.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest
from attnserve.server import native

from tests.server_process import REPO_ROOT
from tests.setup_script import setup_script

pytestmark = pytest.mark.e2e  # pip builds wheels in subprocesses, CMake configures and compiles
BUILD_TIMEOUT_S = 1500  # a bound on a cold build of the generated gRPC code on a loaded machine
EXTENSION = f"attnserve/server/_native{sysconfig.get_config_var('EXT_SUFFIX')}"
NOTE = f"attnserve/server/{setup_script.NATIVE_MISSING_NAME}"


def _missing_build_dependencies() -> list[str]:
    missing = [tool for tool in ("cmake", "g++", "pkg-config", "protoc", "grpc_cpp_plugin") if not shutil.which(tool)]
    if shutil.which("pkg-config") and subprocess.run(["pkg-config", "--exists", "grpc++", "protobuf"]).returncode:
        missing.append("grpc++.pc/protobuf.pc (libgrpc++-dev, libprotobuf-dev)")
    if not Path(sysconfig.get_paths()["include"], "Python.h").exists():
        missing.append("Python.h (python3-dev)")
    return missing


MISSING = _missing_build_dependencies()
needs_build_deps = pytest.mark.skipif(
    bool(MISSING), reason=f"the native data plane's build dependencies are missing here: {', '.join(MISSING)} "
    "(`make native-deps` installs them as root); this machine can only check the pure-Python wheel")
needs_cmake = pytest.mark.skipif(shutil.which("cmake") is None,
                                 reason="no cmake here: CMake is what reports the missing dependencies")


def _pip_wheel(out: Path, **env: str) -> subprocess.CompletedProcess:
    """`pip wheel` of this checkout into out, with its build isolation (setuptools and pybind11
    from the package index, as any user's build)."""
    out.mkdir(parents=True, exist_ok=True)
    return subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-v", "-w", str(out), str(REPO_ROOT)],
                          capture_output=True, text=True, timeout=BUILD_TIMEOUT_S, env={**os.environ, **env})


def _names(wheel_dir: Path) -> tuple[Path, list[str]]:
    (wheel,) = wheel_dir.glob("attnserve-*.whl")
    with zipfile.ZipFile(wheel) as z:
        return wheel, z.namelist()


def _version_installed(wheel: Path, target: Path) -> str:
    """`attnserve --version` from the wheel installed alone into target, outside this checkout."""
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-compile", "--target",
                    str(target), str(wheel)], check=True, timeout=300)
    dependencies = [p for p in sys.path if p.endswith("site-packages")]
    # -S: no site processing, so this checkout's editable install is not on the path.
    code = "import sys; sys.argv = ['attnserve', '--version']; from attnserve.cli import main; main()"
    env = {"PYTHONPATH": ":".join([str(target), *dependencies]), "PATH": "/usr/bin:/bin"}
    done = subprocess.run([sys.executable, "-S", "-c", code], cwd=target.parent, capture_output=True, text=True,
                          timeout=120, env=env)
    assert done.returncode == 0, done.stderr
    return done.stdout


def _plant_stale_extension() -> None:
    """An extension left in setuptools' build/lib by an earlier build, as the wheel test leaves one."""
    build_lib = REPO_ROOT / "build" / f"lib.{sysconfig.get_platform()}-{sys.implementation.cache_tag}"
    (build_lib / EXTENSION).parent.mkdir(parents=True, exist_ok=True)
    (build_lib / EXTENSION).write_bytes(b"stale: from an earlier build")


def test_build_mode_is_auto_on_or_off_and_nothing_else():
    variable = setup_script.MODE_VARIABLE
    assert setup_script.build_mode({}) == "auto"
    assert setup_script.build_mode({variable: " ON "}) == "on"
    assert setup_script.build_mode({variable: "off"}) == "off"
    with pytest.raises(setup_script.NativeBuildError, match=r"ATTNSERVE_NATIVE_BUILD must be one of auto, on, off, "
                                                            r"got 'yes'"):
        setup_script.build_mode({variable: "yes"})


def test_setup_and_the_server_name_the_same_note():
    assert native.NATIVE_MISSING_NOTE.name == setup_script.NATIVE_MISSING_NAME


@needs_build_deps
@pytest.mark.timeout(BUILD_TIMEOUT_S + 300)
def test_wheel_holds_the_extension_and_it_loads_outside_the_checkout(tmp_path):
    done = _pip_wheel(tmp_path / "wheels", ATTNSERVE_NATIVE_BUILD="on")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    wheel, names = _names(tmp_path / "wheels")
    assert EXTENSION in names and NOTE not in names, names
    python_tag = f"cp{sys.version_info.major}{sys.version_info.minor}"
    assert f"-{python_tag}-{python_tag}-linux_" in wheel.name, wheel.name  # a platform wheel: it holds compiled code
    version = _version_installed(wheel, tmp_path / "site")
    assert "native data plane: available (--data-plane native)" in version, version


@needs_cmake
@pytest.mark.timeout(BUILD_TIMEOUT_S)
def test_without_grpc_the_wheel_is_the_python_package_and_says_what_is_missing(tmp_path):
    (tmp_path / "no-pc-files").mkdir()
    _plant_stale_extension()
    done = _pip_wheel(tmp_path / "wheels", PKG_CONFIG_LIBDIR=str(tmp_path / "no-pc-files"), PKG_CONFIG_PATH="",
                      ATTNSERVE_NATIVE_BUILD_DIR=str(tmp_path / "cmake"))  # the shared build/native stays as it is
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    log = done.stdout + done.stderr
    assert "the native data plane cannot be built here: missing gRPC C++" in log and "libgrpc++-dev" in log, log[-3000:]
    wheel, names = _names(tmp_path / "wheels")
    assert NOTE in names and not any("_native" in n and n.endswith(".so") for n in names), names
    version = _version_installed(wheel, tmp_path / "site")
    assert "native data plane: unavailable: this installation was built without it: the native data plane cannot " \
        "be built here: missing gRPC C++" in version, version
    assert "Debian: libgrpc++-dev" in version and "Debian: libprotobuf-dev" in version, version
    assert "reinstall attnserve" in version, version


@needs_cmake
@pytest.mark.timeout(BUILD_TIMEOUT_S)
def test_native_build_on_fails_saying_what_is_missing(tmp_path):
    (tmp_path / "no-pc-files").mkdir()
    done = _pip_wheel(tmp_path / "wheels", PKG_CONFIG_LIBDIR=str(tmp_path / "no-pc-files"), PKG_CONFIG_PATH="",
                      ATTNSERVE_NATIVE_BUILD_DIR=str(tmp_path / "cmake"), ATTNSERVE_NATIVE_BUILD="on")
    assert done.returncode != 0
    log = done.stdout + done.stderr
    assert "the native data plane cannot be built here: missing gRPC C++" in log and "libgrpc++-dev" in log, log[-3000:]
    assert not list((tmp_path / "wheels").glob("*.whl"))
