"""A local Ray cluster for tests/ray/, started and stopped by the session (`make test-ray`).

`ray start --head --block` in a process group of its own (so the teardown ends exactly the
processes it started, never another Ray on the machine), bound to loopback, with 2 logical CPUs
that the jobs' actors and read tasks take in fractions (client.batch.ray_job).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

# Ray resolves 127.0.0.1 to the machine's address unless told it is not a cluster: with this set,
# every Ray server binds loopback (its macOS/Windows default). Read when ray is imported: set first.
LOOPBACK_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
os.environ.update(LOOPBACK_ENV)

ray = pytest.importorskip("ray", reason="the Ray engine's tests need attnserve[ray]: make test-ray")

READY_LINE = "Ray runtime started."
START_TIMEOUT_S = 180


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RayCluster:
    def __init__(self) -> None:
        # A short path: Ray's Unix sockets live under it (108 bytes at most).
        self.temp_dir = Path(tempfile.mkdtemp(prefix="attnserve-ray-", dir="/tmp"))
        self.port = _free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.env = {**os.environ, **LOOPBACK_ENV}
        self.log = self.temp_dir / "ray-start.log"
        ray_cli = Path(sys.executable).with_name("ray")
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen(
                [str(ray_cli), "start", "--head", "--block", "--node-ip-address", "127.0.0.1",
                 "--port", str(self.port), "--ray-client-server-port", str(_free_port()), "--num-cpus", "2",
                 "--include-dashboard", "false", "--disable-usage-stats", "--temp-dir", str(self.temp_dir)],
                stdout=log, stderr=subprocess.STDOUT, env=self.env, start_new_session=True)
        deadline = time.monotonic() + START_TIMEOUT_S
        while READY_LINE not in self.log.read_text():  # a state the log reports, not a guess of how long
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"ray start did not come up: {self.log.read_text()[-3000:]}")
            time.sleep(0.1)

    def stop(self) -> None:
        """End the process group `ray start` leads (its GCS, raylet and agents); the workers the
        raylet started exit when it is gone."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(timeout=30)
        shutil.rmtree(self.temp_dir, ignore_errors=True)


@pytest.fixture(scope="session")
def ray_cluster():
    """The cluster, with this process connected to it as a driver (loopback)."""
    cluster = RayCluster()
    try:
        ray.init(address=cluster.address, log_to_driver=False)
        yield cluster
    finally:
        ray.shutdown()
        cluster.stop()
