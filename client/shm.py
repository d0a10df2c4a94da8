"""Client side of Triton's system shared memory extension (docs/shared-memory.md).

    async with AsyncInferenceClient("127.0.0.1:8001") as client:
        slot = SharedMemorySlot("job-0")                 # one request in flight at a time
        result = await slot.infer(client, "self_attention", inputs, ("output",))
        await slot.close(client)                         # unregister, unlink

`SharedMemorySlot` owns two POSIX shm objects (inputs, outputs), registers them with the
server, writes a request's inputs there and reads its outputs back; the message carries only
names and shapes. `same_host(url)` says whether a URL names this host (where regions can be
shared). tritonclient.utils.shared_memory works as well against the server, unmodified.
"""

from __future__ import annotations

import ipaddress
import math
import os
import socket
from collections.abc import Mapping, Sequence
from multiprocessing import shared_memory

import numpy as np
from attnserve.client import codec
from attnserve.client.options import parse_addresses

REGION, OFFSET, BYTE_SIZE = "shared_memory_region", "shared_memory_offset", "shared_memory_byte_size"
EXTENSION = "system_shared_memory"  # in ServerMetadata's extensions when the server allows it


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
    return mode == "auto" and same_host(url) and EXTENSION in extensions and slot_dims(metadata) is not None


class Region:
    """One POSIX shm object this process created; `close()` unmaps and unlinks it."""

    def __init__(self, byte_size: int) -> None:
        self._shm = shared_memory.SharedMemory(create=True, size=max(byte_size, 1))
        self.byte_size = byte_size

    @property
    def key(self) -> str:
        return "/" + self._shm.name.lstrip("/")

    def write(self, offset: int, array: np.ndarray) -> None:
        target = np.frombuffer(self._shm.buf, dtype=array.dtype, count=array.size, offset=offset)
        target[...] = np.ascontiguousarray(array).ravel()

    def read(self, offset: int, dtype: np.dtype, shape: tuple[int, ...]) -> np.ndarray:
        """A copy: the region is reused by the next request."""
        return np.frombuffer(self._shm.buf, dtype=dtype, count=math.prod(shape), offset=offset).reshape(shape).copy()

    def close(self) -> None:
        self._shm.close()
        self._shm.unlink()


def _place(parameters, region: str, offset: int, nbytes: int) -> None:
    parameters[REGION].string_param = region
    parameters[BYTE_SIZE].int64_param = nbytes
    if offset:
        parameters[OFFSET].int64_param = offset


class SharedMemorySlot:
    """An input and an output region for one request at a time, registered as `<name>-in` and
    `<name>-out`; they grow (re-registered) when a request needs more. out_dim and heads: the
    model's (its metadata's `output` and `attn_probs` shapes), which size the outputs."""

    def __init__(self, name: str, out_dim: int, heads: int) -> None:
        self.name = f"{name}-{os.getpid()}"
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
        region = Region(nbytes)
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
