"""Triton's system shared memory extension: regions a caller on this host registers, which
requests then name for their inputs' and outputs' bytes. Every region check is here, so that
a future native data plane calls the same code (docs/shared-memory.md).

    regions = SystemSharedMemory(max_regions, max_bytes, budget)
    regions.register(name, key, offset, byte_size)   # maps /dev/shm/<key>; SharedMemoryError if refused
    lease = regions.lease()                           # one request's use of regions
    view = lease.input(placement, nbytes, what)       # a read-only view of the mapping, no copy
    view = lease.output(placement, nbytes, what)      # where an output's bytes go: the batch writes
                                                      # there (server.tensors.compute_batch)
    lease.release()                                   # the request is over
    regions.unregister(name)                          # unmapped once no request uses it

Why each rule (Triton fixed each in its own server; docs/shared-memory.md has the longer account):
- a key is a plain POSIX shm name, opened under /dev/shm without following links;
- offsets and sizes are checked as Python integers against the region and the object: nothing wraps;
- each registration opens its own descriptor and mapping (no cache a reused fd would make stale);
- a region unregistered while a request uses it stays mapped until the last such request ends;
- regions and their bytes are bounded, and reserved in the server's memory budget while mapped;
- a region no call has used for idle_timeout_s (none using it now) is unregistered by `expire_idle()`.
A refusal of the request's own making is a SharedMemoryError (INVALID_ARGUMENT / 400) naming the
region and the bound; SharedMemoryExhausted (RESOURCE_EXHAUSTED / 429) a bound or resource of the
server's spent now; SharedMemoryUnavailable (UNAVAILABLE / 503) says why an extension is off.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import mmap
import os
import stat
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from attnserve.server.memory.budget import MemoryBudget, MemoryExhausted, Reservation

logger = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"  # where Linux's shm_open keeps its objects
# Triton's parameter names on inputs and requested outputs.
REGION = "shared_memory_region"
OFFSET = "shared_memory_offset"
BYTE_SIZE = "shared_memory_byte_size"
MAX_NAME_BYTES = 255  # NAME_MAX: the longest key shm_open takes, and our bound on region names
_U64 = 1 << 64

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
    """One registered mapping: [offset, offset + byte_size) of the object, mapped from the page
    below offset. `users`: requests holding it; unmapped at unregister, or when the last ends."""

    __slots__ = ("status", "view", "_mmap", "users", "retired", "_reservation", "last_used")

    def __init__(self, status: RegionStatus, mapping: mmap.mmap, start: int, reservation: Reservation | None) -> None:
        self.status = status
        self._mmap = mapping
        self.view = memoryview(mapping)[start:start + status.byte_size]
        self.users = 0
        self.retired = False
        self._reservation = reservation
        self.last_used = 0.0  # monotonic: registered, or a request's use began or ended

    def close(self) -> None:
        try:
            self.view.release()
            self._mmap.close()
        except BufferError:
            # Something still holds a numpy view of it (a run that outlived its cancelled call):
            # the mapping goes when the last view does; mmap never unmaps under one.
            logger.debug("region %r: unmapped once its last view is gone", self.status.name)
        self.view = None
        self._mmap = None
        if self._reservation is not None:
            self._reservation.release()
            self._reservation = None


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
            start = offset % mmap.ALLOCATIONGRANULARITY
            try:
                mapping = mmap.mmap(fd, start + byte_size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE,
                                    offset=offset - start)
            except OSError as err:
                # mmap dups the descriptor, so it runs out of them too; ENOMEM: out of address space
                if err.errno in _EXHAUSTED_ERRNOS:
                    raise SharedMemoryExhausted(f"shared memory region {name!r}: cannot map key {key!r}: "
                                                f"{err.strerror} ({len(self._mapped)} regions mapped); unregister "
                                                "some and retry") from None
                raise SharedMemoryError(f"shared memory region {name!r}: cannot map key {key!r}: {err}") from None
            except ValueError as err:
                raise SharedMemoryError(f"shared memory region {name!r}: cannot map key {key!r}: {err}") from None
        finally:
            os.close(fd)  # mmap holds its own descriptor until it is closed
        return _Region(RegionStatus(name, key, offset, byte_size), mapping, start, reservation)

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

    __slots__ = ("_owner", "_held")

    def __init__(self, owner: SystemSharedMemory) -> None:
        self._owner = owner
        self._held: dict[str, _Region] = {}

    def _view(self, placement: Placement, nbytes: int, what: str, exact: bool) -> memoryview:
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
        return region.view[placement.offset:placement.offset + nbytes]

    def input(self, placement: Placement, nbytes: int, what: str) -> memoryview:
        """The `nbytes` bytes of an input (`what`: "input 'query'"), read-only, without a copy."""
        return self._view(placement, nbytes, what, exact=True).toreadonly()

    def output(self, placement: Placement, nbytes: int, what: str) -> memoryview:
        """Where an output of `nbytes` bytes goes (its region's byte_size may be larger)."""
        return self._view(placement, nbytes, what, exact=False)

    def release(self) -> None:
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
    return value
