"""Triton's system shared memory extension: regions a caller on this host registers, which
requests then name for their inputs' and outputs' bytes. Every region check is here, so that
a future native data plane calls the same code (docs/shared-memory.md).

    regions = SystemSharedMemory(max_regions, max_bytes, budget)
    regions.register(name, key, offset, byte_size)   # opens /dev/shm/<key>; SharedMemoryError if refused
    lease = regions.lease()                           # one request's use of regions
    data = lease.input(placement, nbytes, what)       # the input's bytes, read into a staging buffer
    writer = lease.output(placement, nbytes, what)    # the batch fills writer.buffer, then writes it
    lease.release(answered)                           # over; answered: its buffers are kept for reuse
    regions.unregister(name)                          # closed once no request uses it

Why each rule (Triton fixed each in its own server; docs/shared-memory.md has the longer account):
- a key is a plain POSIX shm name, opened under /dev/shm without following links;
- offsets and sizes are checked as Python integers against the region and the object: nothing wraps;
- each registration opens its own descriptor (no cache a reused fd would make stale);
- regions are read and written through it (preadv, pwritev), never mapped: the caller may shrink
  its object (ftruncate) at any moment, and a mapping touched past the end faults (SIGBUS, the
  whole server). Each use checks the object still holds the region (fstat); a cut racing a read
  is a short read, refused alike; one racing a write is grown back by it (the caller's doing);
- a region unregistered while a request uses it stays open until the last such request ends;
- regions and their bytes are bounded, and reserved in the server's memory budget while open;
- a region no call has used for idle_timeout_s (none using it now) is unregistered by `expire_idle()`.
A refusal of the request's own making is a SharedMemoryError (INVALID_ARGUMENT / 400) naming the
region and the bound; SharedMemoryExhausted (RESOURCE_EXHAUSTED / 429) a bound or resource of the
server's spent now; SharedMemoryUnavailable (UNAVAILABLE / 503) says why an extension is off.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import stat
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np
from attnserve.server.memory.budget import MemoryBudget, MemoryExhausted, Reservation
from attnserve.server.tensors import INTO_ALIGNMENT

logger = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"  # where Linux's shm_open keeps its objects
# Triton's parameter names on inputs and requested outputs.
REGION = "shared_memory_region"
OFFSET = "shared_memory_offset"
BYTE_SIZE = "shared_memory_byte_size"
MAX_NAME_BYTES = 255  # NAME_MAX: the longest key shm_open takes, and our bound on region names
_U64 = 1 << 64
# A placement's offset and byte_size: Triton's int64 parameters (REST takes JSON integers in this range too).
MAX_PLACEMENT = (1 << 63) - 1

_INSTEAD = "use system shared memory (--allow-shared-memory) or send tensors in the request"


def why_no_cuda(on_cuda: bool, why_not_cuda: str | None = None) -> str:
    """Why the CUDA shared memory calls answer UNAVAILABLE on this server: it runs on the CPU
    (why_not_cuda: the device choice's reason, None: --device cpu), or, on CUDA, this build opens
    no cudaIPC handles (docs/shared-memory.md, "CUDA shared memory")."""
    if not on_cuda:
        return (f"CUDA shared memory needs a GPU server: this one runs on the CPU "
                f"({why_not_cuda or '--device cpu'}); {_INSTEAD}")
    return f"CUDA shared memory is not served by this build (it opens no cudaIPC handles); {_INSTEAD}"


class SharedMemoryError(ValueError):
    """A region or a tensor placement refused; the message names the region and the bound."""


class SharedMemoryExhausted(Exception):
    """A region refused for want of what the server has now (the region bound, its bytes, file
    descriptors, address space): retry once regions are unregistered."""


# Out of descriptors or memory when opening or mapping: the server's state, not the caller's key.
_EXHAUSTED_ERRNOS = (errno.EMFILE, errno.ENFILE, errno.ENOMEM)


class SharedMemoryUnavailable(Exception):
    """A shared memory extension that this server does not serve now, and why."""


WHY_OFF = ("system shared memory is off on this server: start it with --allow-shared-memory "
           "(ATTNSERVE_ALLOW_SHARED_MEMORY=true) to register regions")


@dataclass(frozen=True, slots=True)
class RegionStatus:
    name: str
    key: str
    offset: int
    byte_size: int


@dataclass(frozen=True, slots=True)
class Placement:
    """Where a tensor's bytes are: `byte_size` bytes at `offset` in region `region`."""

    region: str
    offset: int
    byte_size: int


def check_key(key: str) -> str:
    """The object's name under SHM_DIR for a POSIX shm key ("/name" or "name"), or
    SharedMemoryError: one path component, no NUL, not "." or "..", at most NAME_MAX bytes."""
    name = key[1:] if key.startswith("/") else key
    if (not name or "/" in name or "\0" in name or name in (".", "..")
            or len(name.encode("utf-8", "surrogateescape")) > MAX_NAME_BYTES - 1):
        raise SharedMemoryError(f"shared memory key {key[:80]!r} is not a POSIX shm key: expected '/name' with a name "
                                f"of 1 to {MAX_NAME_BYTES - 1} bytes, without '/', NUL, '.' or '..'")
    return name


def _check_region_name(name: str) -> None:
    if not name or "\0" in name or len(name.encode("utf-8", "surrogateescape")) > MAX_NAME_BYTES:
        raise SharedMemoryError(f"shared memory region name {name[:80]!r}: expected 1 to {MAX_NAME_BYTES} bytes "
                                "without NUL")


class _Region:
    """One registered region: [offset, offset + byte_size) of the object, read and written through
    its own descriptor (never mapped: see the module's docstring). `users`: requests holding it;
    closed at unregister, or when the last ends. An output's writer (RegionWriter) holds the
    descriptor open while the batch's thread writes, should the request end meanwhile."""

    __slots__ = ("status", "_fd", "users", "retired", "_reservation", "last_used", "_lock", "_writers", "_closing")

    def __init__(self, status: RegionStatus, fd: int, reservation: Reservation | None) -> None:
        self.status = status
        self._fd = fd
        self.users = 0
        self.retired = False
        self._reservation = reservation
        self.last_used = 0.0  # monotonic: registered, or a request's use began or ended
        self._lock = threading.Lock()  # _writers and _closing: the batch's thread ends writes
        self._writers = 0  # RegionWriters not yet written or closed
        self._closing = False

    def close(self) -> None:
        """On the event loop: the region is done with; its descriptor is closed now, or by the
        last writer still writing (a run that outlived its cancelled call)."""
        with self._lock:
            self._closing = True
            close_now = self._writers == 0
        if close_now:
            os.close(self._fd)
        if self._reservation is not None:
            self._reservation.release()
            self._reservation = None

    def _pin(self) -> None:
        with self._lock:
            self._writers += 1

    def _unpin(self) -> None:
        with self._lock:
            self._writers -= 1
            close_now = self._closing and self._writers == 0
        if close_now:
            os.close(self._fd)

    def _check_size(self, what: str) -> None:
        """SharedMemoryError unless the object still holds the whole region (a caller may shrink it)."""
        size = os.fstat(self._fd).st_size
        s = self.status
        if size < s.offset + s.byte_size:
            raise self._smaller(what, size)

    def _smaller(self, what: str, size: int | None = None) -> SharedMemoryError:
        s = self.status
        if size is None:
            try:
                size = os.fstat(self._fd).st_size
            except OSError:
                size = 0
        return SharedMemoryError(f"{what}: shared memory region {s.name!r} is smaller than registered: its key "
                                 f"{s.key!r} now has {size:,} bytes, the region is offset {s.offset:,} + byte_size "
                                 f"{s.byte_size:,}; restore the object's size, or unregister the region and "
                                 "register it again")

    def read(self, into: memoryview, offset: int, what: str) -> None:
        """Fill `into` with the region's bytes from `offset` (checked within it by the caller)."""
        self._check_size(what)
        at, done, total = self.status.offset + offset, 0, len(into)
        while done < total:
            try:
                got = os.preadv(self._fd, [into[done:]], at + done)
            except OSError as err:
                raise SharedMemoryError(f"{what}: cannot read shared memory region {self.status.name!r}: "
                                        f"{err.strerror or err}") from None
            if got == 0:  # the object was cut while we read it
                raise self._smaller(what)
            done += got

    def write(self, data: memoryview, offset: int, what: str) -> None:
        """Write `data` at `offset` of the region (checked within it by the caller). A cut after the
        size check is grown back by the write (pwritev past the end extends the object): the
        caller's own doing, and nothing can fault."""
        self._check_size(what)
        at, done, total = self.status.offset + offset, 0, len(data)
        while done < total:
            try:
                put = os.pwritev(self._fd, [data[done:]], at + done)
            except OSError as err:
                raise SharedMemoryError(f"{what}: cannot write shared memory region {self.status.name!r}: "
                                        f"{err.strerror or err}") from None
            if put == 0:
                raise SharedMemoryError(f"{what}: cannot write shared memory region {self.status.name!r}: "
                                        "nothing was written")
            done += put


class RegionWriter:
    """Where one output of one request goes: `buffer` (nbytes, aligned for ONNX Runtime) is where
    the batch puts it, and `write` writes it into the region once, on the batch's thread. A
    refusal (the object shrunk) is kept in `error`, never raised: the batch's other requests
    must not fail for it; the request path raises it for this request alone. `close()` (the
    request is over) cancels a write not begun."""

    __slots__ = ("_region", "_offset", "nbytes", "what", "buffer", "_state", "error")

    _PENDING, _WRITING, _DONE = 0, 1, 2

    def __init__(self, region: _Region, offset: int, nbytes: int, what: str, buffer: np.ndarray) -> None:
        self._region = region
        self._offset = offset
        self.nbytes = nbytes
        self.what = what
        self.buffer = buffer
        self._state = self._PENDING
        self.error: SharedMemoryError | None = None
        region._pin()

    def write(self, data: memoryview) -> None:
        """On the batch's thread: the output's bytes (exactly nbytes) into the region."""
        region = self._region
        with region._lock:
            if self._state != self._PENDING:
                return  # the request is over: nobody reads the answer
            self._state = self._WRITING
        try:
            if len(data) != self.nbytes:
                raise RuntimeError(f"{self.what}: {len(data):,} bytes to write, {self.nbytes:,} placed")
            region.write(data, self._offset, self.what)
        except SharedMemoryError as err:
            self.error = err
        finally:
            with region._lock:
                self._state = self._DONE
            region._unpin()

    def close(self) -> None:
        with self._region._lock:
            pending = self._state == self._PENDING
            if pending:
                self._state = self._DONE
        if pending:
            self._region._unpin()


class _Staging:
    """The buffers inputs are read into and outputs are put in before they are written: kept
    once their request is answered, for the next request of the same sizes. Fresh memory costs a
    page fault every 4 KiB (blocks of 8 MiB and more are mapped anew each time: server.memory.heap),
    more than the copy itself. The free ones are at most the bytes of the regions held, which
    the memory budget reserves for them (the regions themselves are never mapped). Event loop only."""

    __slots__ = ("_free", "free_bytes")

    def __init__(self) -> None:
        self._free: dict[int, list[np.ndarray]] = {}
        self.free_bytes = 0

    def take(self, nbytes: int) -> np.ndarray:
        """nbytes of uint8, not zeroed, starting at an INTO_ALIGNMENT boundary."""
        kept = self._free.get(nbytes)
        if kept:
            self.free_bytes -= nbytes
            return kept.pop()
        raw = np.empty(nbytes + INTO_ALIGNMENT, dtype=np.uint8)
        start = -raw.ctypes.data % INTO_ALIGNMENT
        return raw[start:start + nbytes]

    def give(self, buffers: list[np.ndarray], bound: int) -> None:
        for buffer in buffers:
            if self.free_bytes + buffer.nbytes <= bound:
                self._free.setdefault(buffer.nbytes, []).append(buffer)
                self.free_bytes += buffer.nbytes

    def trim(self, bound: int) -> None:
        while self.free_bytes > bound:
            nbytes = max(self._free)
            kept = self._free[nbytes]
            kept.pop()
            self.free_bytes -= nbytes
            if not kept:
                del self._free[nbytes]


class SystemSharedMemory:
    """The registered system shared memory regions of one server process (on its event loop).

    idle_timeout_s: a region that no request has used for this long, and that none uses now, is
    unregistered at the next `expire_idle()` (0: never). Regions belong to no connection (as in
    Triton): any caller may use or unregister any name."""

    def __init__(self, max_regions: int, max_bytes: int, budget: MemoryBudget | None = None,
                 idle_timeout_s: float = 0.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.max_regions = max_regions
        self.max_bytes = max_bytes
        self.idle_timeout_s = idle_timeout_s
        self._clock = clock
        self._budget = budget
        self._regions: dict[str, _Region] = {}
        self._mapped: list[_Region] = []  # registered, or unregistered and still in use
        self._mapped_bytes = 0
        self._staging = _Staging()  # its free buffers within _mapped_bytes
        self._registered_bytes = 0  # kept, not summed: the metrics port's thread reads it at a scrape
        self.expired_total = 0  # regions unregistered by expire_idle()
        # Names expired lately (bounded), so that a request naming one is told why it is gone.
        self._expired: OrderedDict[str, None] = OrderedDict()

    # -- the extension's three calls ----------------------------------------------------------

    def register(self, name: str, key: str, offset: int, byte_size: int) -> None:
        _check_region_name(name)
        object_name = check_key(key)
        self.expire_idle()  # a region left by a dead caller must not hold the bounds below
        if name in self._regions:
            raise SharedMemoryError(f"shared memory region {name!r} is already registered (key "
                                    f"{self._regions[name].status.key!r}); unregister it first")
        if not 0 <= offset < _U64 or not 0 < byte_size < _U64:
            raise SharedMemoryError(f"shared memory region {name!r}: offset {offset} and byte_size {byte_size} must be "
                                    "unsigned 64-bit integers, byte_size at least 1")
        if byte_size > self.max_bytes:
            raise SharedMemoryError(f"shared memory region {name!r}: {byte_size:,} bytes exceed the bound of "
                                    f"{self.max_bytes:,} bytes (--shared-memory-max-bytes)")
        if len(self._mapped) >= self.max_regions:
            raise SharedMemoryExhausted(f"shared memory region {name!r}: {len(self._mapped)} regions are mapped, the "
                                        f"bound is {self.max_regions} (--shared-memory-max-regions); unregister one "
                                        "first")
        if byte_size > self.max_bytes - self._mapped_bytes:
            raise SharedMemoryExhausted(f"shared memory region {name!r}: {byte_size:,} bytes more than the "
                                        f"{self._mapped_bytes:,} mapped would exceed the bound of {self.max_bytes:,} "
                                        "bytes (--shared-memory-max-bytes); unregister one first")
        reservation = None
        if self._budget is not None:
            reservation = self._budget.try_reserve(byte_size)
            if reservation is None:
                raise MemoryExhausted(f"shared memory region {name!r}: its {byte_size:,} bytes do not fit the memory "
                                      f"budget now ({self._budget.used_bytes:,} of {self._budget.limit_bytes:,} bytes "
                                      "in use, --memory-limit-bytes); retry later")
        try:
            region = self._map(name, key, object_name, offset, byte_size, reservation)
        except BaseException:
            if reservation is not None:
                reservation.release()
            raise
        region.last_used = self._clock()
        self._expired.pop(name, None)
        self._regions[name] = region
        self._mapped.append(region)
        self._mapped_bytes += byte_size
        self._registered_bytes += byte_size

    def _map(self, name: str, key: str, object_name: str, offset: int, byte_size: int,
             reservation: Reservation | None) -> _Region:
        """The region, its object opened (never mapped: see the module's docstring)."""
        path = os.path.join(SHM_DIR, object_name)
        try:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
        except OSError as err:
            if err.errno in _EXHAUSTED_ERRNOS:
                raise SharedMemoryExhausted(f"shared memory region {name!r}: cannot open key {key!r}: the server "
                                            f"is out of a resource ({err.strerror}) with {len(self._mapped)} "
                                            "regions mapped; unregister some and retry") from None
            raise SharedMemoryError(f"shared memory region {name!r}: cannot open key {key!r}: "
                                    f"{err.strerror or err}") from None
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode):
                raise SharedMemoryError(f"shared memory region {name!r}: key {key!r} is not a shared memory object")
            # Written so that nothing can wrap: offset + byte_size <= size.
            if byte_size > info.st_size or offset > info.st_size - byte_size:
                raise SharedMemoryError(f"shared memory region {name!r}: offset {offset} + byte_size {byte_size} runs "
                                        f"past the end of key {key!r} ({info.st_size} bytes)")
        except BaseException:
            os.close(fd)
            raise
        return _Region(RegionStatus(name, key, offset, byte_size), fd, reservation)

    def unregister(self, name: str = "") -> None:
        """Unregister `name`, or every region (""); one in use stays mapped until its requests end."""
        if name and name not in self._regions:
            raise self._unknown(name)
        for region_name in [name] if name else list(self._regions):
            self._retire(region_name)

    def _retire(self, name: str) -> _Region:
        region = self._regions.pop(name)
        self._registered_bytes -= region.status.byte_size
        region.retired = True
        if region.users == 0:
            self._unmap(region)
        return region

    def status(self, name: str = "") -> list[RegionStatus]:
        self.expire_idle()  # what the caller sees is what a request would find
        if name and name not in self._regions:
            raise self._unknown(name)
        return [self._regions[name].status] if name else [r.status for r in self._regions.values()]

    def expire_idle(self) -> int:
        """Unregister every region unused for idle_timeout_s: no request began or ended with it
        since, and none holds it now. Returns how many (each logged, and counted in expired_total)."""
        if not self.idle_timeout_s or not self._regions:
            return 0
        now = self._clock()
        idle = [name for name, r in self._regions.items()
                if r.users == 0 and now - r.last_used >= self.idle_timeout_s]
        for name in idle:
            region = self._retire(name)
            self.expired_total += 1
            self._expired[name] = None
            while len(self._expired) > self.max_regions:
                self._expired.popitem(last=False)
            logger.info("shared memory region %r (key %r, %d bytes) expired: unused for %.1fs "
                        "(--shared-memory-idle-timeout-s %g)", name, region.status.key, region.status.byte_size,
                        now - region.last_used, self.idle_timeout_s)
        return len(idle)

    def _unknown(self, name: str) -> SharedMemoryError:
        if name in self._expired:
            return SharedMemoryError(f"shared memory region {name!r} is not registered: it expired after "
                                     f"{self.idle_timeout_s:g}s unused (--shared-memory-idle-timeout-s); "
                                     "register it again")
        return SharedMemoryError(f"shared memory region {name!r} is not registered")

    def close(self) -> None:
        """Unmap everything (the server stops)."""
        self.unregister()

    @property
    def mapped(self) -> int:
        """Regions mapped now: registered, or unregistered and still in use."""
        return len(self._mapped)

    @property
    def mapped_bytes(self) -> int:
        """Bytes of the regions mapped now (what --shared-memory-max-bytes bounds)."""
        return self._mapped_bytes

    @property
    def registered(self) -> int:
        return len(self._regions)

    @property
    def registered_bytes(self) -> int:
        return self._registered_bytes

    # -- requests --------------------------------------------------------------------------------

    def lease(self) -> Lease:
        return Lease(self)

    def _take(self, name: str) -> _Region:
        region = self._regions.get(name)
        if region is None:
            raise self._unknown(name)
        region.users += 1
        region.last_used = self._clock()
        return region

    def _give_back(self, region: _Region) -> None:
        region.users -= 1
        region.last_used = self._clock()
        if region.users == 0 and region.retired:
            self._unmap(region)

    def _unmap(self, region: _Region) -> None:
        self._mapped.remove(region)
        self._mapped_bytes -= region.status.byte_size
        self._staging.trim(self._mapped_bytes)
        region.close()


async def expire_forever(regions: SystemSharedMemory) -> None:
    """regions.expire_idle() a few times per idle timeout, until cancelled (the server stops), so
    that idle regions go even when no shared memory call comes."""
    period_s = min(max(regions.idle_timeout_s / 4, 0.05), 60.0)  # expiry at most a quarter late
    while True:
        await asyncio.sleep(period_s)
        regions.expire_idle()


class Lease:
    """The regions one request uses, held from its decode until `release()` (when it is over)."""

    __slots__ = ("_owner", "_held", "_writers", "_staged")

    def __init__(self, owner: SystemSharedMemory) -> None:
        self._owner = owner
        self._held: dict[str, _Region] = {}
        self._writers: list[RegionWriter] = []
        self._staged: list[np.ndarray] = []  # the inputs' buffers (the outputs': their writers')

    def _region(self, placement: Placement, nbytes: int, what: str, exact: bool) -> _Region:
        region = self._held.get(placement.region)
        if region is None:
            region = self._held[placement.region] = self._owner._take(placement.region)
        size = region.status.byte_size
        if placement.byte_size != nbytes if exact else placement.byte_size < nbytes:
            raise SharedMemoryError(f"{what}: {BYTE_SIZE} is {placement.byte_size:,}, its tensor needs "
                                    f"{'' if exact else 'at least '}{nbytes:,} bytes (region {placement.region!r})")
        if placement.byte_size > size or placement.offset > size - placement.byte_size:
            raise SharedMemoryError(f"{what}: {OFFSET} {placement.offset:,} + {BYTE_SIZE} {placement.byte_size:,} runs "
                                    f"past the end of region {placement.region!r} ({size:,} bytes)")
        return region

    def input(self, placement: Placement, nbytes: int, what: str) -> memoryview:
        """The `nbytes` bytes of an input (`what`: "input 'query'"), read-only: read from the region
        into a staging buffer of the request's own (one copy, which no later change of the object
        can reach); SharedMemoryError if the object no longer holds the region."""
        region = self._region(placement, nbytes, what, exact=True)
        buffer = self._owner._staging.take(nbytes)  # not zeroed: the read fills all of it
        self._staged.append(buffer)
        data = memoryview(buffer)
        region.read(data, placement.offset, what)
        return data.toreadonly()

    def output(self, placement: Placement, nbytes: int, what: str) -> RegionWriter:
        """Where an output of `nbytes` bytes goes (its region's byte_size may be larger): the
        batch puts it in writer.buffer and its thread writes it (RegionWriter.write)."""
        region = self._region(placement, nbytes, what, exact=False)
        writer = RegionWriter(region, placement.offset, nbytes, what, self._owner._staging.take(nbytes))
        self._writers.append(writer)
        return writer

    def release(self, answered: bool = False) -> None:
        """The request is over. answered: its batch computed it (its Result came back), so nothing
        reads its buffers any more: they are kept for the next request. Otherwise (refused, or
        cancelled: its run may go on) they are left to whatever still holds them."""
        writers, self._writers = self._writers, []
        for writer in writers:
            writer.close()  # a write not begun never will be; one under way closes the descriptor after it
        staged, self._staged = self._staged, []
        if answered:
            self._owner._staging.give(staged + [w.buffer for w in writers], self._owner._mapped_bytes)
        held, self._held = self._held, {}
        for region in held.values():
            self._owner._give_back(region)


def placement(parameters: Mapping, what: str) -> Placement | None:
    """A tensor's shared memory placement from its protocol parameters (InferParameter map), or
    None if it names no region; SharedMemoryError if the parameters are malformed."""
    if REGION not in parameters:
        if OFFSET in parameters or BYTE_SIZE in parameters:
            raise SharedMemoryError(f"{what}: {OFFSET} or {BYTE_SIZE} without {REGION}")
        return None
    region = parameters[REGION]
    if region.WhichOneof("parameter_choice") != "string_param":
        raise SharedMemoryError(f"{what}: {REGION} must be a string")
    if BYTE_SIZE not in parameters:
        raise SharedMemoryError(f"{what}: {REGION} {region.string_param!r} without {BYTE_SIZE}")
    return Placement(region.string_param, _unsigned(parameters, OFFSET, what), _unsigned(parameters, BYTE_SIZE, what))


def _unsigned(parameters: Mapping, key: str, what: str) -> int:
    if key not in parameters:
        return 0
    parameter = parameters[key]
    kind = parameter.WhichOneof("parameter_choice")
    if kind not in ("int64_param", "uint64_param"):
        raise SharedMemoryError(f"{what}: {key} must be an integer, got {kind}")
    value = getattr(parameter, kind)
    if value < 0:
        raise SharedMemoryError(f"{what}: {key} must be >= 0, got {value}")
    if value > MAX_PLACEMENT:  # Triton's int64; nothing this large is inside a region anyway
        raise SharedMemoryError(f"{what}: {key} must be at most {MAX_PLACEMENT} (an int64), got {value}")
    return value
