"""attnserve installed beside tritonclient, KServe's SDK and proto-plus, checked against a real server.

    python tests/compat/ecosystem_check.py --model-repository MODELS

Run by `make test-ecosystem` with the python of a fresh virtualenv into which
`pip install <repo> 'tritonclient[grpc]' kserve proto-plus` resolved (no torch). It serves
MODELS with that virtualenv's `attnserve serve`, then checks, each in a process of its own:

* the distribution: `pip check` is clean, no torch, and `attnserve` is the only top-level name
  our distribution installed (importlib.metadata's file list);
* our client and NVIDIA's tritonclient in one process: both infer cross_attention, same numbers;
* our client and KServe's SDK in one process: kserve.InferenceGRPCClient (asyncio) calls
  ServerLive/ServerReady/ModelReady and infers (same numbers); ModelMetadata through KServe's
  own generated stub, as its client has no call for it;
* KServe's InferenceRESTClient against the REST port: health, readiness, inference with JSON
  and with binary tensors (same numbers as our gRPC client), an error's status and message
  (kserve cannot be installed into the main .venv: it needs a newer grpcio-tools than the dev
  extra's pin, so this is where it is tested);
* `import proto; proto.Message` (proto-plus) beside attnserve, and again after
  `pip uninstall -y attnserve`, when `import attnserve` must fail.

tritonclient and KServe never share a process: their stubs define the same `inference.*`
protobuf names in protobuf's default descriptor pool and refuse each other (ours live in a pool
of their own). The children run in a temporary directory, so that the repository's own folders
(proto/ above all) cannot shadow an installed module.

One PASS or FAIL line per check; a closing "ecosystem: N passed, M failed"; exit status 1 on any
failure. This script leaves attnserve uninstalled from the virtualenv that ran it.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path

MODEL = "cross_attention"
PRESETS = ("self_attention", "cross_attention")
STARTUP_TIMEOUT_S = 60.0
CHILD_TIMEOUT_S = 120.0

Check = Callable[[], str | None]  # returns an optional detail for its PASS line; raises to FAIL


def _run_checks(checks: list[tuple[str, Check]]) -> tuple[int, int]:
    passed = failed = 0
    for name, check in checks:
        try:
            detail = check()
        except Exception as err:  # a failed check is reported, and the others still run
            failed += 1
            print(f"FAIL {name}: {type(err).__name__}: {err}", flush=True)
            if os.environ.get("ECOSYSTEM_TRACEBACK"):
                traceback.print_exc()
        else:
            passed += 1
            print(f"PASS {name}" + (f" ({detail})" if detail else ""), flush=True)
    return passed, failed


# Each preset's shapes here: the seeds' own (self_attention: a sentence of 10 tokens).
_SHAPES = {"cross_attention": (3, 256, 77, 32), "self_attention": (2, 10, 10, 512)}


def _inputs(masked: bool, model: str = MODEL):
    import numpy as np

    rng = np.random.default_rng(2)
    b, lq, lk, width = _SHAPES[model]
    inputs = {
        "query": rng.standard_normal((b, lq, width), dtype=np.float32),
        "key": rng.standard_normal((b, lk, width), dtype=np.float32),
        "value": rng.standard_normal((b, lk, width), dtype=np.float32),
    }
    if masked:
        inputs["mask"] = rng.random((b, lq, lk)) > 0.3
    return inputs


def _ours(address: str, inputs, model: str = MODEL) -> dict:
    from attnserve.client import InferenceClient

    with InferenceClient(address) as client:
        return client.infer(model, inputs["query"], inputs["key"], inputs["value"], mask=inputs.get("mask"),
                            outputs=("output", "attn_probs"))


def _same(ours: dict, theirs: dict, who: str) -> str:
    import numpy as np

    for name, want in ours.items():
        got = np.asarray(theirs[name])
        if got.shape != want.shape or not np.array_equal(got, want):
            err = float(np.max(np.abs(got - want))) if got.shape == want.shape else float("nan")
            raise AssertionError(f"{who} {name}: shape {got.shape} vs ours {want.shape}, max abs diff {err}")
    return ", ".join(f"{name} {tuple(a.shape)}" for name, a in ours.items())


def _default_pool_file(symbol: str) -> str:
    from google.protobuf import descriptor_pool

    return descriptor_pool.Default().FindMessageTypeByName(symbol).file.name


# -- children: each runs in its own process ---------------------------------------------------

def child_triton(address: str) -> list[tuple[str, Check]]:
    import attnserve.client  # noqa: F401  (both in this process from here on)
    import tritonclient.grpc as grpcclient

    def one_process() -> str:
        from attnserve.proto import inference_pb2

        theirs = _default_pool_file("inference.ModelInferRequest")
        assert theirs != inference_pb2.DESCRIPTOR.name, theirs
        return f"default pool's inference.ModelInferRequest from {theirs}, ours from a private pool"

    def infer(masked: bool) -> Check:
        def check() -> str:
            inputs = _inputs(masked)
            client = grpcclient.InferenceServerClient(url=address)
            try:
                assert client.is_server_ready() and client.is_model_ready(MODEL)
                tensors = []
                for name, array in inputs.items():
                    tensor = grpcclient.InferInput(name, list(array.shape), "BOOL" if name == "mask" else "FP32")
                    tensor.set_data_from_numpy(array)
                    tensors.append(tensor)
                requested = [grpcclient.InferRequestedOutput(n) for n in ("output", "attn_probs")]
                result = client.infer(MODEL, tensors, outputs=requested)
                theirs = {n: result.as_numpy(n) for n in ("output", "attn_probs")}
                index = client.get_model_repository_index(as_json=True)
            finally:
                client.close()
            states = {m["name"]: m.get("state") for m in index.get("models", [])}
            assert all(states.get(p) == "READY" for p in PRESETS), f"repository index: {index}"
            return _same(_ours(address, inputs), theirs, "tritonclient")
        return check

    return [
        ("tritonclient.grpc and attnserve.client import in one process", one_process),
        (f"tritonclient infers {MODEL}: same numbers as attnserve.client", infer(masked=False)),
        (f"tritonclient infers {MODEL} with a mask: same numbers as attnserve.client", infer(masked=True)),
    ]


def child_kserve(address: str) -> list[tuple[str, Check]]:
    import asyncio

    import attnserve.client  # noqa: F401
    import grpc
    import kserve
    from kserve.protocol.grpc import grpc_predict_v2_pb2 as kserve_pb
    from kserve.protocol.grpc import grpc_predict_v2_pb2_grpc as kserve_pb_grpc

    def one_process() -> str:
        from attnserve.proto import inference_pb2

        theirs = _default_pool_file("inference.ModelInferRequest")
        assert theirs != inference_pb2.DESCRIPTOR.name, theirs
        return f"default pool's inference.ModelInferRequest from {theirs}, ours from a private pool"

    def readiness() -> str:
        async def calls():
            client = kserve.InferenceGRPCClient(address, timeout=30)
            try:
                return (await client.is_server_live(), await client.is_server_ready(),
                        await client.is_model_ready(MODEL))
            finally:
                await client.close()
        live, ready, model_ready = asyncio.run(calls())
        assert live and ready and model_ready, (live, ready, model_ready)
        return "ServerLive, ServerReady, ModelReady"

    def metadata() -> str:
        async def call():
            async with grpc.aio.insecure_channel(address) as channel:
                stub = kserve_pb_grpc.GRPCInferenceServiceStub(channel)
                return await stub.ModelMetadata(kserve_pb.ModelMetadataRequest(name=MODEL), timeout=30)
        response = asyncio.run(call())
        names = [t.name for t in response.inputs]
        assert response.name == MODEL and names == ["query", "key", "value", "mask"], response
        return f"inputs {names}, outputs {[t.name for t in response.outputs]}"

    def infer() -> str:
        inputs = _inputs(masked=True)

        async def call():
            client = kserve.InferenceGRPCClient(address, timeout=30)
            try:
                tensors = []
                for name, array in inputs.items():
                    tensor = kserve.InferInput(name, list(array.shape), "BOOL" if name == "mask" else "FP32")
                    tensor.set_data_from_numpy(array)
                    tensors.append(tensor)
                response = await client.infer(kserve.InferRequest(MODEL, tensors, request_id="ecosystem"))
            finally:
                await client.close()
            return {n: response.get_output_by_name(n).as_numpy() for n in ("output", "attn_probs")}
        return _same(_ours(address, inputs), asyncio.run(call()), "kserve")

    return [
        ("kserve and attnserve.client import in one process", one_process),
        ("kserve.InferenceGRPCClient: server and model readiness", readiness),
        ("kserve's GRPCInferenceServiceStub: ModelMetadata", metadata),
        (f"kserve.InferenceGRPCClient infers {MODEL} with a mask: same numbers as attnserve.client", infer),
    ]


def child_kserve_rest(addresses: str) -> list[tuple[str, Check]]:
    """KServe's InferenceRESTClient (httpx) against the REST port; addresses: "GRPC,HTTP"."""
    import asyncio

    import httpx
    import kserve
    from kserve.inference_client import InferenceRESTClient, RESTConfig

    grpc_address, http_address = addresses.split(",")
    base_url = f"http://{http_address}"

    async def with_client(call):
        client = InferenceRESTClient(RESTConfig(protocol="v2", timeout=30, retries=0))
        try:
            return await call(client)
        finally:
            await client.close()

    def readiness() -> str:
        async def calls(client):
            return (await client.is_server_live(base_url), await client.is_server_ready(base_url),
                    await client.is_model_ready(base_url, MODEL))
        live, ready, model_ready = asyncio.run(with_client(calls))
        assert live is True and ready is True and model_ready is True, (live, ready, model_ready)
        return "GET /v2/health/live, /v2/health/ready, /v2/models/{m}/ready"

    def infer(model: str, binary: bool) -> Check:
        def check() -> str:
            inputs = _inputs(masked=True, model=model)

            async def call(client):
                tensors = []
                for name, array in inputs.items():
                    tensor = kserve.InferInput(name, list(array.shape), "BOOL" if name == "mask" else "FP32")
                    tensor.set_data_from_numpy(array, binary_data=binary)
                    tensors.append(tensor)
                response = await client.infer(base_url, kserve.InferRequest(model, tensors, request_id="rest"),
                                              model_name=model)
                return {n: response.get_output_by_name(n).as_numpy() for n in ("output", "attn_probs")}
            return _same(_ours(grpc_address, inputs, model), asyncio.run(with_client(call)), "kserve REST")
        return check

    def error() -> str:
        async def call(client):
            tensor = kserve.InferInput("query", [1, 1, 3], "FP32")
            tensor.set_data_from_numpy(__import__("numpy").zeros((1, 1, 3), dtype="float32"))
            await client.infer(base_url, kserve.InferRequest("nope", [tensor]), model_name="nope")
        try:
            asyncio.run(with_client(call))
        except httpx.HTTPStatusError as err:
            assert err.response.status_code == 404 and "unknown model 'nope'" in str(err), err
            return str(err).split(",")[0]
        raise AssertionError("no error for an unknown model")

    return [
        ("kserve.InferenceRESTClient: server liveness, readiness, model readiness", readiness),
        *((f"kserve.InferenceRESTClient infers {model} with a mask, {'binary' if binary else 'JSON'} tensors: "
           "same numbers as attnserve.client", infer(model, binary))
          for model in PRESETS for binary in (False, True)),
        ("kserve.InferenceRESTClient: an unknown model is HTTPStatusError 404 with our message", error),
    ]


def child_proto_plus(installed: str) -> list[tuple[str, Check]]:
    import importlib.metadata

    def proto_message() -> str:
        import proto

        assert isinstance(proto.Message, type), proto.Message
        theirs = importlib.metadata.distribution("proto-plus").locate_file("proto/__init__.py")
        assert Path(proto.__file__).resolve() == Path(theirs).resolve(), (
            f"`proto` is {proto.__file__}, not proto-plus's")
        return f"proto-plus {importlib.metadata.version('proto-plus')}, {proto.__file__}"

    def attnserve_import() -> str:
        try:
            import attnserve
        except ModuleNotFoundError:
            if installed == "yes":
                raise
            return "ModuleNotFoundError, as it should be"
        if installed == "no":
            raise AssertionError(f"`import attnserve` still works after the uninstall: {attnserve.__file__}")
        import attnserve.client  # noqa: F401
        return attnserve.__file__

    after = "" if installed == "yes" else " after `pip uninstall attnserve`"
    return [
        (f"import proto; proto.Message (proto-plus){after}", proto_message),
        (f"import attnserve {'works' if installed == 'yes' else 'fails'}{after}", attnserve_import),
    ]


CHILDREN = {"triton": child_triton, "kserve": child_kserve, "kserve-rest": child_kserve_rest,
            "proto-plus": child_proto_plus}


# -- the driver -------------------------------------------------------------------------------

def _distribution_checks() -> list[tuple[str, Check]]:
    import importlib.metadata
    import importlib.util

    def pip_check() -> str:
        done = subprocess.run([sys.executable, "-m", "pip", "check"], capture_output=True, text=True)
        assert done.returncode == 0, done.stdout + done.stderr
        return done.stdout.strip()

    def no_torch() -> None:
        assert importlib.util.find_spec("torch") is None, "torch is installed in this virtualenv"

    def versions() -> str:
        names = ("attnserve", "protobuf", "grpcio", "grpcio-health-checking", "grpcio-reflection",
                 "tritonclient", "kserve", "proto-plus", "numpy", "onnxruntime")
        return ", ".join(f"{n} {importlib.metadata.version(n)}" for n in names)

    def top_level() -> str:
        files = importlib.metadata.distribution("attnserve").files or []
        assert files, "attnserve's distribution lists no files"
        # Entry-point scripts are recorded outside site-packages (../../../bin/attnserve).
        names = {f.parts[0] for f in files if not f.parts[0].startswith("..") and not f.parts[0].endswith(".dist-info")}
        names = {n.removesuffix(".py") for n in names} - {"__pycache__"}
        assert names == {"attnserve"}, f"top-level names installed by attnserve: {sorted(names)}"
        return f"{len(files)} files, all under attnserve/"

    return [
        ("pip check: every installed requirement is satisfied", pip_check),
        ("the resolved versions", versions),
        ("no torch in this virtualenv", no_torch),
        ("our distribution installs only the top-level name attnserve", top_level),
    ]


class _Server:
    """This virtualenv's `attnserve serve` on a free loopback port."""

    def __init__(self, model_repository: Path, workdir: Path) -> None:
        self.ready_file = workdir / "ready.json"
        self.log_path = workdir / "server.log"
        command = Path(sys.executable).with_name("attnserve")
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(
            [str(command), "serve", "--model-repository", str(model_repository), "--host", "127.0.0.1",
             "--port", "0", "--http-port", "0", "--metrics-port", "-1", "--ready-file", str(self.ready_file)],
            cwd=workdir, stdout=self._log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while not self.ready_file.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the server did not become ready:\n{self.log_path.read_text(errors='replace')}")
            time.sleep(0.05)  # the ready file appears only once the port is bound and serving
        ports = json.loads(self.ready_file.read_text())
        self.address = f"127.0.0.1:{ports['grpc_port']}"
        self.http_address = f"127.0.0.1:{ports['http_port']}"

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


def _child(workdir: Path, mode: str, argument: str) -> tuple[int, int]:
    """Run one child; relay its lines; its counts (a child that dies counts as one failure)."""
    done = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--child", mode, argument],
                          cwd=workdir, capture_output=True, text=True, timeout=CHILD_TIMEOUT_S)
    lines = done.stdout.splitlines()
    for line in lines:
        print(line, flush=True)
    passed = sum(line.startswith("PASS ") for line in lines)
    failed = sum(line.startswith("FAIL ") for line in lines)
    if done.returncode != 0 and failed == 0:
        print(f"FAIL {mode}: the child process exited with {done.returncode}:\n{done.stderr[-4000:]}", flush=True)
        failed += 1
    return passed, failed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-repository", type=Path, help="both presets, exported (`make export`)")
    parser.add_argument("--child", nargs=2, metavar=("MODE", "ARGUMENT"), help=argparse.SUPPRESS)
    ns = parser.parse_args(argv)
    if ns.child:
        mode, argument = ns.child
        _, failed = _run_checks(CHILDREN[mode](argument))
        return 1 if failed else 0
    if ns.model_repository is None:
        parser.error("--model-repository is required")

    print(f"ecosystem check with {sys.executable}", flush=True)
    passed, failed = _run_checks(_distribution_checks())
    with tempfile.TemporaryDirectory(prefix="attnserve-ecosystem-") as tmp:
        workdir = Path(tmp)
        server = _Server(ns.model_repository.resolve(), workdir)
        try:
            print(f"serving {ns.model_repository} on {server.address}", flush=True)
            for mode, argument in (("triton", server.address), ("kserve", server.address),
                                   ("kserve-rest", f"{server.address},{server.http_address}"), ("proto-plus", "yes")):
                p, f = _child(workdir, mode, argument)
                passed, failed = passed + p, failed + f
        finally:
            server.stop()
        uninstall = subprocess.run([sys.executable, "-m", "pip", "uninstall", "-y", "attnserve"],
                                   capture_output=True, text=True)
        if uninstall.returncode != 0:
            print(f"FAIL pip uninstall -y attnserve: {uninstall.stdout}{uninstall.stderr}", flush=True)
            failed += 1
        else:
            print("PASS pip uninstall -y attnserve", flush=True)
            passed += 1
            p, f = _child(workdir, "proto-plus", "no")
            passed, failed = passed + p, failed + f
    print(f"ecosystem: {passed} passed, {failed} failed", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
