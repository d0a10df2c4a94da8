"""Triton's schedule policy: each request's priority and queue timeout, and the queue that orders by them.

    policy = QueuePolicy.from_config(config["dynamic_batching"])   # config.json; ValueError naming the key
    schedule = request_schedule(request.parameters, policy)        # `priority`, `timeout`; ValueError
    queue = PriorityQueue(aging_batches=4)                         # the batcher's waiting requests

Knows nothing of gRPC, protobuf or ONNX Runtime: request parameters are read by duck type
(InferParameter's `WhichOneof("parameter_choice")`), whichever transport built them.

Anti-starvation, by aging in batches: a request that a batch formed without (passed over) gains
one level for every `aging_batches` such batches, up to level 1, and within a level the oldest
goes first. Counted in batches, not in time, so that the bound holds on any machine: a request
of level L runs within (L - 1) x aging_batches batches plus those of the level-1 requests
queued before it, however fast high-priority requests keep arriving (docs/scheduling.md, "Priorities
and queue timeouts").
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from attnserve.contract import DYNAMIC_BATCHING
from attnserve.ranges import PRIORITY_LEVELS, QUEUE_TIMEOUT_US, Range

# Triton's request parameters (the schedule policy extension): names and what they hold.
PRIORITY, TIMEOUT = "priority", "timeout"
SCHEDULE_PARAMETERS = (PRIORITY, TIMEOUT)
DEFAULT_QUEUE_POLICY = "default_queue_policy"
TIMEOUT_ACTIONS = ("REJECT",)  # DELAY (run late, after the others) is refused: see QueuePolicy


@dataclass(frozen=True)
class QueuePolicy:
    """One model's priorities and queue timeout: config.json's `dynamic_batching`, as Triton's
    ModelDynamicBatching and ModelQueuePolicy. Without the section a model has two levels and
    callers that send no priority get the highest, so that a batch job sending `priority` 2
    yields to them; no timeout unless a request asks for one."""

    priority_levels: int = 2  # 1 is the highest
    default_priority_level: int = 1  # for requests that send none (or 0)
    default_timeout_us: int = 0  # a request's longest wait in the queue; 0: none
    allow_timeout_override: bool = True  # a request's own `timeout` may shorten it

    def __post_init__(self) -> None:
        if self.priority_levels < 1:
            raise ValueError(f"priority_levels must be >= 1, got {self.priority_levels}")
        if not 1 <= self.default_priority_level <= self.priority_levels:
            raise ValueError(f"default_priority_level must be in 1..priority_levels ({self.priority_levels}), "
                             f"got {self.default_priority_level}")

    @classmethod
    def from_config(cls, section: Any) -> QueuePolicy:
        """config.json's `dynamic_batching` (None: the defaults). Raises ValueError naming the key."""
        if section is None:
            return cls()
        where = DYNAMIC_BATCHING
        _check_keys(section, where, ("priority_levels", "default_priority_level", DEFAULT_QUEUE_POLICY))
        levels = _config_int(section, "priority_levels", where, cls.priority_levels, PRIORITY_LEVELS)
        default = _config_int(section, "default_priority_level", where, cls.default_priority_level, PRIORITY_LEVELS)
        if default > levels:
            raise ValueError(f"{where}.default_priority_level must be in 1..priority_levels ({levels}), "
                             f"got {default}")
        queue = section.get(DEFAULT_QUEUE_POLICY, {})
        where = f"{DYNAMIC_BATCHING}.{DEFAULT_QUEUE_POLICY}"
        _check_keys(queue, where, ("default_timeout_microseconds", "allow_timeout_override", "timeout_action"))
        action = queue.get("timeout_action", "REJECT")
        if action not in TIMEOUT_ACTIONS:
            raise ValueError(f"{where}.timeout_action must be REJECT, got {action!r} (DELAY is not supported: a "
                             "request past its timeout is refused, never run late)")
        override = queue.get("allow_timeout_override", cls.allow_timeout_override)
        if not isinstance(override, bool):
            raise ValueError(f"{where}.allow_timeout_override must be true or false, got {override!r}")
        timeout_us = _config_int(queue, "default_timeout_microseconds", where, 0, QUEUE_TIMEOUT_US)
        return cls(levels, default, timeout_us, override)

    def to_config(self) -> dict[str, Any]:
        """The section as config.json and the model configuration endpoint give it."""
        return {"priority_levels": self.priority_levels, "default_priority_level": self.default_priority_level,
                DEFAULT_QUEUE_POLICY: {"timeout_action": "REJECT",
                                       "default_timeout_microseconds": self.default_timeout_us,
                                       "allow_timeout_override": self.allow_timeout_override}}


@dataclass(frozen=True)
class Schedule:
    """One request's: its priority level (1..levels) and its queue timeout in seconds (None: none)."""

    priority: int
    timeout_s: float | None


def request_schedule(parameters: Mapping[str, Any], policy: QueuePolicy) -> Schedule:
    """The `priority` and `timeout` of a request's parameters (InferParameter-like values), under
    its model's policy; other parameters are not looked at (the protocol says to ignore unknown
    ones). Raises ValueError naming the parameter for a wrong type, a negative value, a
    priority above the model's levels or a timeout past QUEUE_TIMEOUT_US (the planes' longest
    timer: past it a timeout would silently be none)."""
    priority = _parameter_int(parameters, PRIORITY)
    if priority is None or priority == 0:
        priority = policy.default_priority_level
    elif priority > policy.priority_levels:
        raise ValueError(f"parameter {PRIORITY!r}: this model has priority levels 1..{policy.priority_levels} "
                         f"(1 the highest, 0 its default {policy.default_priority_level}), got {priority}")
    timeout_us = policy.default_timeout_us
    asked = _parameter_int(parameters, TIMEOUT)
    if asked and policy.allow_timeout_override:
        # As Triton: a request may shorten the model's timeout, never lengthen it.
        timeout_us = asked if timeout_us == 0 else min(asked, timeout_us)
    return Schedule(priority, timeout_us / 1e6 if timeout_us else None)


def earliest(*deadlines: float | None) -> float | None:
    """The first of the deadlines given (None: none)."""
    given = [d for d in deadlines if d is not None]
    return min(given) if given else None


def _parameter_int(parameters: Mapping[str, Any], name: str) -> int | None:
    if name not in parameters:
        return None
    value = parameters[name]
    which = value.WhichOneof("parameter_choice")
    if which not in ("int64_param", "uint64_param"):
        got = "nothing" if which is None else f"{which} {getattr(value, which)!r}"
        raise ValueError(f"parameter {name!r} must be an integer (int64_param or uint64_param; a JSON integer), "
                         f"got {got}")
    return check_parameter_int(name, getattr(value, which))


def check_parameter_int(name: str, number: int) -> int:
    """`number`, the integer given for `priority` or `timeout`, or ValueError naming the parameter:
    negative, or a timeout past QUEUE_TIMEOUT_US (REST's JSON integers beyond 64 bits come here too)."""
    if number < 0:
        raise ValueError(f"parameter {name!r} must be >= 0, got {number}")
    if name == TIMEOUT and number > QUEUE_TIMEOUT_US.high:
        raise ValueError(f"parameter {name!r} must be {QUEUE_TIMEOUT_US.describe()}, got {number}")
    return number


def _check_keys(section: Any, where: str, known: tuple[str, ...]) -> None:
    if not isinstance(section, dict):
        raise ValueError(f"{where} must be an object, got {section!r}")
    unknown = sorted(set(section) - set(known))
    if unknown:
        raise ValueError(f"{where}: {', '.join(map(repr, unknown))} not supported (supported: {', '.join(known)})")


def _config_int(section: dict, key: str, where: str, default: int, allowed: Range) -> int:
    return allowed.check(f"{where}.{key}", section.get(key, default))


# -- the queue ------------------------------------------------------------------------------------


class Queued(Protocol):
    """What the queue orders a waiting request by (the batcher's _Pending carries these)."""

    priority: int  # its level, 1 the highest
    since: int  # the queue's count of batches formed when it arrived (set by the queue)


class PriorityQueue:
    """The requests waiting for a batch: served by level (aged: see the module's docstring), then
    by arrival. Small (at most the model's max_queue_size), so ordering on each batch is cheap."""

    def __init__(self, aging_batches: int) -> None:
        if aging_batches < 1:
            raise ValueError(f"aging_batches must be >= 1, got {aging_batches}")
        self.aging_batches = aging_batches
        self._items: list[Queued] = []  # in arrival order
        # Batches formed that took requests: each passed over every request still queued, so a
        # request's count of batches that passed it over is this minus its `since`.
        self._formed = 0
        self._arrival_order = True  # the last in_service_order() was arrival order

    def __len__(self) -> int:
        return len(self._items)

    def __bool__(self) -> bool:
        return bool(self._items)

    def __iter__(self):
        return iter(self._items)  # arrival order

    def append(self, item: Queued) -> None:
        item.since = self._formed
        self._items.append(item)

    def oldest(self) -> Queued:
        return self._items[0]

    def level(self, item: Queued) -> int:
        """Its level now: one better for every aging_batches batches that passed it over."""
        return max(1, item.priority - (self._formed - item.since) // self.aging_batches)

    def in_service_order(self) -> list[Queued]:
        items = self._items
        first = items[0].priority if items else 0
        # One priority (the usual case): the older a request, the better its aged level, so
        # arrival order is service order.
        self._arrival_order = all(p.priority == first for p in items)
        if self._arrival_order:
            return list(items)
        levels = [self.level(p) for p in items]
        ranked = sorted(range(len(levels)), key=levels.__getitem__)  # stable: arrival order within a level
        return [items[i] for i in ranked]

    def remove(self, item: Queued) -> bool:
        """Take one request out (its deadline passed); False if it was not queued."""
        for i, p in enumerate(self._items):
            if p is item:  # by identity: a request's equality would compare its tensors
                del self._items[i]
                return True
        return False

    def batch_formed(self, kept: Iterable[Queued], batch_taken: bool) -> None:
        """A batch was formed from in_service_order()'s list: `kept`, in that list's order, wait
        on; if it took requests, each of them was passed over once more."""
        if self._arrival_order:
            self._items = list(kept)  # a subsequence of arrival order already
        else:
            staying = {id(p) for p in kept}
            self._items = [p for p in self._items if id(p) in staying]
        if batch_taken:
            self._formed += 1

    def clear(self) -> list[Queued]:
        items, self._items = self._items, []
        return items
