"""The distribution as pip installs it: one import root, one command, nothing else at the top.

The wheel is built from this checkout and installed into a folder of its own (no dependencies),
then read back through its RECORD, as `pip uninstall` would read it.
"""

from __future__ import annotations

import csv
import os
import subprocess
import sys
from pathlib import Path

import pytest

from attnserve.cli import COMMANDS
from tests.server_process import REPO_ROOT

pytestmark = pytest.mark.e2e  # pip-installs the project into a scratch directory

SUBPACKAGES = ("attnserve.server", "attnserve.client", "attnserve.export", "attnserve.proto")


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    target = tmp_path_factory.mktemp("site-packages")
    # The layout alone: tests/test_native_build.py builds the wheel with the native data plane.
    done = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-compile",
                           "--target", str(target), str(REPO_ROOT)],
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "ATTNSERVE_NATIVE_BUILD": "off"})
    assert done.returncode == 0, done.stderr
    return target


def _record(site: Path) -> list[str]:
    (dist_info,) = site.glob("attnserve-*.dist-info")
    with open(dist_info / "RECORD", newline="") as f:
        return [row[0] for row in csv.reader(f)]


def test_nothing_but_attnserve_lands_at_the_top_level(installed):
    files = _record(installed)
    top = {Path(f).parts[0] for f in files}
    # RECORD lists the console script as ../../bin/attnserve (relative to site-packages).
    top = {name for name in top if not name.endswith(".dist-info") and name not in ("..", "bin")}
    assert top == {"attnserve"}, f"top-level names installed: {sorted(top)}"
    # The folders the repository keeps at its top level arrive under attnserve/.
    for sub in SUBPACKAGES:
        assert f"{sub.replace('.', '/')}/__init__.py" in files, sub
    assert "attnserve/contract.py" in files and "attnserve/proto/inference.proto" in files
    assert not any(f.startswith(("tests/", "bench/", "deploy/")) for f in files)


def test_the_console_script_is_declared(installed):
    (dist_info,) = installed.glob("attnserve-*.dist-info")
    entry_points = (dist_info / "entry_points.txt").read_text()
    assert "[console_scripts]" in entry_points and "attnserve = attnserve.cli:main" in entry_points


def test_the_installed_package_imports_outside_the_checkout(installed, tmp_path):
    """From another folder, with only the installed copy on the path: every subpackage imports
    from it, the server without torch, and the proto stubs from their new home."""
    code = (
        "import sys, importlib, importlib.util; sys.modules['torch'] = None\n"  # the server must not need torch
        f"for name in {SUBPACKAGES + ('attnserve.server.app', 'attnserve.client.batch', 'attnserve.contract')!r}:\n"
        "    module = importlib.import_module(name)\n"
        f"    assert module.__file__.startswith({str(installed)!r}), (name, module.__file__)\n"
        "from attnserve.proto import inference_pb2 as pb\n"
        "assert pb.DESCRIPTOR.name == 'attnserve/proto/inference.proto'\n"
        "for name in ('server', 'client', 'export', 'proto'):\n"
        "    assert importlib.util.find_spec(name) is None or not importlib.util.find_spec(name).origin"
        f".startswith({str(installed)!r}), name\n"
    )
    # -S: no site processing, so this checkout's editable install (a .pth finder) is not loaded;
    # the dependencies come from the environment's site-packages, after the installed copy.
    dependencies = [p for p in sys.path if p.endswith("site-packages")]
    done = subprocess.run([sys.executable, "-S", "-c", code], cwd=tmp_path, capture_output=True, text=True,
                          timeout=120, env={"PYTHONPATH": ":".join([str(installed), *dependencies]),
                                            "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stderr


def test_attnserve_help_lists_every_subcommand():
    done = subprocess.run([sys.executable, "-m", "attnserve", "--help"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    for command in ("serve", "export", "infer", "batch", "health", "models"):
        assert command in COMMANDS
        assert f"    {command} " in done.stdout, f"`attnserve --help` does not list {command}"


@pytest.mark.parametrize("argv, fragment", [
    ([], "the following arguments are required: COMMAND"),
    (["nonsense"], "invalid choice: 'nonsense'"),
    (["serve", "--port", "nope"], "argument --port: invalid int value"),
])
def test_bad_arguments_exit_2_with_one_usage_error(argv, fragment):
    done = subprocess.run([sys.executable, "-m", "attnserve", *argv], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert fragment in done.stderr and "Traceback" not in done.stderr
    assert done.stderr.startswith("usage: attnserve")


def test_each_command_keeps_its_own_help():
    for command in COMMANDS:
        done = subprocess.run([sys.executable, "-m", "attnserve", command, "--help"], capture_output=True,
                              text=True, timeout=60)
        assert done.returncode == 0, (command, done.stderr)
        assert done.stdout.startswith(f"usage: attnserve {command}"), (command, done.stdout[:200])
