"""The README and docs/ tell the truth about the code: settings, metric names, the two commands."""

from __future__ import annotations

import dataclasses
import re
from types import SimpleNamespace

from attnserve.server.config import ServerConfig, env_name

from tests.server_process import REPO_ROOT
from tests.setup_script import BUILD_VARIABLES

README_ONLY = (REPO_ROOT / "README.md").read_text()
# Settings and metrics may be documented in the README or in any page under docs/.
README = "\n".join([README_ONLY, *(p.read_text() for p in sorted((REPO_ROOT / "docs").rglob("*.md")))])


def test_every_setting_is_documented_and_every_documented_one_exists():
    documented = set(re.findall(r"`(ATTNSERVE_[A-Z_]+)`", README))
    real = {env_name(f.name) for f in dataclasses.fields(ServerConfig)}
    assert real <= documented, f"undocumented: {sorted(real - documented)}"
    documented -= BUILD_VARIABLES  # setup.py's, read when the package is built
    assert documented <= real, f"documented but not read by the server: {sorted(documented - real)}"


def test_every_build_variable_is_documented():
    documented = set(re.findall(r"`(ATTNSERVE_[A-Z_]+)`", README))
    assert BUILD_VARIABLES <= documented, f"undocumented: {sorted(BUILD_VARIABLES - documented)}"


def test_metric_names_match_the_code():
    from attnserve.server.gate import ReceiveSlots
    from attnserve.server.memory.budget import MemoryBudget
    from attnserve.server.metrics import Metrics
    from attnserve.server.native import IN_FLIGHT_METRIC
    from attnserve.server.native_records import DROPPED_METRIC
    from attnserve.server.shm import SystemSharedMemory
    from attnserve.server.workers import HUNG_METRIC, RESTARTS_METRIC

    metrics = Metrics()
    metrics.watch_budget(MemoryBudget(1))
    metrics.watch_receiving(ReceiveSlots(1))
    metrics.watch_http(SimpleNamespace(open_connections=0, head_timeouts=0, evictions=0))  # a RestPort's figures
    metrics.watch_shared_memory(SystemSharedMemory(1, 1))
    # prometheus_client names counters without their _total suffix
    families = {f"{m.name}_total" if m.type == "counter" else m.name for m in metrics.registry.collect()}
    documented = set(re.findall(r"`(attnserve_[a-z_]+)`", README))
    registered_while_serving = {f"{RESTARTS_METRIC}_total", f"{HUNG_METRIC}_total", IN_FLIGHT_METRIC, DROPPED_METRIC}
    assert families | registered_while_serving == documented


def test_ci_runs_the_readme_test_command():
    ci = (REPO_ROOT / ".ci" / "run").read_text()
    commands = [line.strip() for line in ci.splitlines() if line.strip() and not line.startswith("#")]
    assert "make test" in commands
    assert re.search(r"^make test\b", README_ONLY, re.M) and re.search(r"^make serve\b", README_ONLY, re.M)
