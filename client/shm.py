"""Client side of Triton's system shared memory extension (docs/shared-memory.md).

    async with AsyncInferenceClient("127.0.0.1:8001") as client:
        prefix = job_prefix(workdir)                     # the job's own names, the same on a rerun
        await release_leftovers(client, prefix)          # what a killed run of the job left
        slot = SharedMemorySlot(prefix + "0", out_dim, heads)  # one request in flight at a time
        result = await slot.infer(client, "self_attention", inputs, ("output",))
        await slot.close(client)                         # unregister, unlink

`SharedMemorySlot` owns two POSIX shm objects (inputs, outputs), registers them with the
server, writes a request's inputs there and reads its outputs back; the message carries only
names and shapes. A batch job's regions and objects are named from a random id kept in its
work directory, so that a rerun, or `attnserve batch --output OUT --cleanup-shared-memory`,
finds and releases what a killed run left (docs/shared-memory.md). `same_host(url)` says whether
a URL names this host (where regions can be shared). tritonclient.utils.shared_memory works as
well against the server, unmodified.
"""

from __future__ import annotations

import ipaddress
import logging
import math
import mmap
import os
import secrets
import socket
from collections.abc import Mapping, Sequence
from pathlib import Path

import grpc
import numpy as np
from attnserve.client import codec
from attnserve.client.errors import InferenceError
from attnserve.client.options import parse_addresses

from attnserve.files import write_atomic

logger = logging.getLogger(__name__)

REGION, OFFSET, BYTE_SIZE = "shared_memory_region", "shared_memory_offset", "shared_memory_byte_size"
EXTENSION = "system_shared_memory"  # in ServerMetadata's extensions when the server allows it
SHM_DIR = Path("/dev/shm")  # where Linux keeps POSIX shm objects (the server opens keys there)
JOB_ID_FILE = "shared-memory-id"  # in a batch job's work directory: the id its names carry
JOB_PREFIX = "attnserve-batch-"


def same_host(url: str) -> bool:
    """Whether `url` (HOST:PORT, one server) is this host: loopback, or one of its addresses."""
    try:
        addresses = parse_addresses(url)
    except ValueError:
        return False  # a gRPC target (dns:///...): not known to be this host
    if len(addresses) != 1:
        return False  # several servers: a region registered on one is unknown to the others
    host = addresses[0][0]
    try:
        addresses = {info[4][0] for info in socket.getaddrinfo(host, None)}
    except OSError:
        return False
    local = set()
    for name in (socket.gethostname(), socket.getfqdn()):
        try:
            local |= {info[4][0] for info in socket.getaddrinfo(name, None)}
        except OSError:
            pass
    return bool(addresses) and all(ipaddress.ip_address(a.split("%")[0]).is_loopback or a in local for a in addresses)


def slot_dims(metadata: codec.ModelMetadata) -> tuple[int, int] | None:
    """(out_dim, heads) that size a SharedMemorySlot's outputs, from the model's metadata; None
    if its `output` or `attn_probs` shape does not say them (then tensors go in messages)."""
    output, probs = metadata.output("output"), metadata.output("attn_probs")
    if output is None or probs is None or len(output.shape) != 3 or len(probs.shape) != 4:
        return None
    if output.shape[-1] < 1 or probs.shape[1] < 1:
        return None
    return output.shape[-1], probs.shape[1]


def uses_shared_memory(mode: str, url: str, extensions, metadata: codec.ModelMetadata) -> bool:
    """Whether a batch job with --shared-memory `mode` sends its tensors through regions: "auto",
    a server on this host that lists the extension, and a model whose metadata sizes the slots."""
    return (mode == "auto" and same_host(url) and EXTENSION in extensions and slot_dims(metadata) is not None
            and SHM_DIR.is_dir())


def job_prefix(workdir: Path) -> str:
    """"attnserve-batch-<id>-": what the names of a batch job's regions and shm objects start
    with. The id is random, made once and kept in the job's work directory (`workdir`, which
    the caller holds locked), so that a rerun knows the names a killed run used and no other
    job shares them."""
    path = workdir / JOB_ID_FILE
    try:
        job_id = path.read_text(encoding="ascii").strip()
    except (FileNotFoundError, UnicodeDecodeError):
        job_id = ""
    if len(job_id) != 16 or not all(c in "0123456789abcdef" for c in job_id):  # absent, or not ours
        job_id = secrets.token_hex(8)
        write_atomic(path, job_id.encode("ascii"))
    return f"{JOB_PREFIX}{job_id}-"


def stored_job_prefix(workdir: Path) -> str | None:
    """The prefix job_prefix() made for `workdir` before, or None when it made none."""
    return job_prefix(workdir) if (workdir / JOB_ID_FILE).is_file() else None


def unlink_objects(prefix: str) -> list[str]:
    """Unlink the shm objects whose names start with `prefix` (a killed run's); their names."""
    gone = []
    try:
        names = sorted(entry.name for entry in os.scandir(SHM_DIR) if entry.name.startswith(prefix))
    except FileNotFoundError:
        return gone
    for name in names:
        try:
            (SHM_DIR / name).unlink()
            gone.append(name)
        except FileNotFoundError:
            pass
    return gone


async def release_leftovers(client, prefix: str, timeout_s: float | None = None) -> tuple[list[str], list[str]]:
    """Unregister the server's regions whose names start with `prefix` and unlink this host's
    shm objects that do: what a run of the same job left when it was killed. Returns (regions
    unregistered, objects unlinked); a server without the extension has no regions to release."""
    objects = unlink_objects(prefix)  # first: this host's memory comes back even if the server is gone
    regions = []
    try:
        names = await client.system_shared_memory_status(timeout_s=timeout_s)
    except InferenceError as err:
        off = err.code == grpc.StatusCode.UNAVAILABLE and "--allow-shared-memory" in err.details
        if not off and err.code != grpc.StatusCode.UNIMPLEMENTED:
            raise
        names = []  # the extension is off there (or unknown): nothing registered
    for name in names:
        if name.startswith(prefix):
            try:
                await client.unregister_system_shared_memory(name, timeout_s=timeout_s)
                regions.append(name)
            except InferenceError as err:
                if "not registered" not in err.details:  # expired or unregistered meanwhile: gone either way
                    raise
    if regions or objects:
        logger.info("released %d region(s) and %d shm object(s) that an earlier run of this job left (%s*)",
                    len(regions), len(objects), prefix)
    return regions, objects


class Region:
    """One POSIX shm object this process created under a name it chose (a batch job's, so that
    a rerun can find it); `close()` unmaps and unlinks it."""

    def __init__(self, name: str, byte_size: int) -> None:
        self.name = name
        self.byte_size = byte_size
        path = SHM_DIR / name
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        try:
            fd = os.open(path, flags, 0o600)
        except FileExistsError:
            # A killed run's object of this job (the caller holds the job's lock): ours to replace.
            path.unlink(missing_ok=True)
            fd = os.open(path, flags, 0o600)
        try:
            os.ftruncate(fd, max(byte_size, 1))
            self._mmap = mmap.mmap(fd, max(byte_size, 1))
        except BaseException:
            path.unlink(missing_ok=True)
            raise
        finally:
            os.close(fd)

    @property
    def key(self) -> str:
        return "/" + self.name

    def write(self, offset: int, array: np.ndarray) -> None:
        target = np.frombuffer(self._mmap, dtype=array.dtype, count=array.size, offset=offset)
        target[...] = np.ascontiguousarray(array).ravel()

    def read(self, offset: int, dtype: np.dtype, shape: tuple[int, ...]) -> np.ndarray:
        """A copy: the region is reused by the next request."""
        return np.frombuffer(self._mmap, dtype=dtype, count=math.prod(shape), offset=offset).reshape(shape).copy()

    def close(self) -> None:
        self._mmap.close()
        (SHM_DIR / self.name).unlink(missing_ok=True)


def _place(parameters, region: str, offset: int, nbytes: int) -> None:
    parameters[REGION].string_param = region
    parameters[BYTE_SIZE].int64_param = nbytes
    if offset:
        parameters[OFFSET].int64_param = offset


class SharedMemorySlot:
    """An input and an output region for one request at a time, registered as `<name>-in` and
    `<name>-out` (the shm objects' names too); they grow (re-registered) when a request needs
    more. out_dim and heads: the model's (its metadata's `output` and `attn_probs` shapes), which
    size the outputs."""

    def __init__(self, name: str, out_dim: int, heads: int) -> None:
        self.name = name
        self._out_dim = out_dim
        self._heads = heads
        self._in: Region | None = None
        self._out: Region | None = None

    async def _ensure(self, client, which: str, nbytes: int) -> Region:
        region = self._in if which == "in" else self._out
        if region is not None and region.byte_size >= nbytes:
            return region
        name = f"{self.name}-{which}"
        if region is not None:
            await client.unregister_system_shared_memory(name)
            region.close()
        region = Region(name, nbytes)
        if which == "in":
            self._in = region
        else:
            self._out = region
        await client.register_system_shared_memory(name, region.key, region.byte_size)
        return region

    async def infer(self, client, model: str, inputs: Mapping[str, np.ndarray], outputs: Sequence[str], *,
                    model_version: str = "", timeout_s: float | None = None,
                    metadata: tuple[tuple[str, str], ...] = (), priority: int = 0,
                    timeout_us: int = 0) -> codec.InferResult:
        """`inputs` from codec.validate_inputs; every requested output comes back through the region.
        metadata: sent with the call (a `traceparent`: client.tracecontext)."""
        b, lq, _ = inputs["query"].shape
        lk = inputs["key"].shape[1]
        request = codec.build_infer_request(model, {}, outputs, model_version=model_version, priority=priority,
                                            timeout_us=timeout_us)
        in_region = await self._ensure(client, "in", sum(a.nbytes for a in inputs.values()))
        offset = 0
        for name, array in inputs.items():
            tensor = request.inputs.add(name=name, datatype=codec._datatype_of(array.dtype), shape=array.shape)
            in_region.write(offset, array)
            _place(tensor.parameters, f"{self.name}-in", offset, array.nbytes)
            offset += array.nbytes
        sizes = {"output": b * lq * self._out_dim * 4, "attn_probs": b * self._heads * lq * lk * 4}
        placed, end = {}, 0
        for name in outputs:
            placed[name] = end
            end += sizes[name]
        out_region = await self._ensure(client, "out", end)
        for output in request.outputs:
            _place(output.parameters, f"{self.name}-out", placed[output.name], sizes[output.name])
        response = await client.model_infer(request, timeout_s=timeout_s, metadata=metadata)
        arrays = {tensor.name: out_region.read(placed[tensor.name], np.dtype("<f4"), tuple(tensor.shape))
                  for tensor in response.outputs if tensor.name in placed}
        missing = [name for name in outputs if name not in arrays]
        if missing:
            raise ValueError(f"the answer lacks the requested outputs {missing}; got {sorted(arrays)}")
        return codec.InferResult({name: arrays[name] for name in outputs}, response.model_name,
                                 response.model_version, response.id)

    async def close(self, client) -> None:
        for which, region in (("in", self._in), ("out", self._out)):
            if region is None:
                continue
            try:
                await client.unregister_system_shared_memory(f"{self.name}-{which}")
            finally:
                region.close()
        self._in = self._out = None
