"""setup.py (the native data plane's build, docs/native-build.md "Build") loaded as a module,
for the tests that read its names; loading it builds nothing (setup() runs only as __main__)."""

from __future__ import annotations

import importlib.util

from tests.server_process import REPO_ROOT

_spec = importlib.util.spec_from_file_location("attnserve_setup_script", REPO_ROOT / "setup.py")
setup_script = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(setup_script)
BUILD_VARIABLES = frozenset(setup_script.BUILD_VARIABLES)
