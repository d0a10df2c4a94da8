"""Every size bound the server keeps, in one table: what it bounds, its default, the setting that
changes it (a ServerConfig field: `--flag` and `ATTNSERVE_*`) or the constant that holds it, and
where it is enforced.

    from attnserve.server.memory.limits import LIMITS
    for limit in LIMITS: print(limit.name, limit.default, limit.setting or limit.constant, limit.enforced_by)

tests/test_memory_limits.py checks the table against server/config.py's defaults and the named
constants, and that every `enforced_by` names a real object, so it cannot drift from the code.
docs/memory.md ("Memory") explains how the bounds work together.
"""

from __future__ import annotations

from dataclasses import dataclass

MiB = 1 << 20
GiB = 1 << 30


@dataclass(frozen=True)
class Limit:
    name: str
    bounds: str  # what is bounded, and what happens over it
    default: int | float | None  # None: derived at start (see `bounds`)
    enforced_by: tuple[str, ...]  # dotted paths under attnserve.server
    setting: str | None = None  # the ServerConfig field (flag --x-y, variable ATTNSERVE_X_Y)
    constant: str | None = None  # "module.NAME" under attnserve.server holding the default (or the bound itself)


LIMITS: tuple[Limit, ...] = (
    Limit("message", "one gRPC message either way, and a REST body (over it: RESOURCE_EXHAUSTED / 413)",
          64 * MiB, ("app.Server.start", "rest.RestPort._body"), setting="max_message_bytes",
          constant="config.DEFAULT_MAX_MESSAGE_BYTES"),
    Limit("typed", "tensor bytes in a gRPC message's typed contents, request or answer (INVALID_ARGUMENT)",
          4 * MiB, ("codec._check_typed_size", "native.NativePlane"), setting="max_typed_bytes"),
    Limit("json", "JSON text of a REST request, and of an answer's `data` (400)",
          8 * MiB, ("rest.RestPort._infer", "rest_codec.parse_infer"), setting="max_json_bytes"),
    Limit("receive slots", "unary inference messages received at once, each counted at max_message_bytes; "
          "default: a quarter of the memory budget (the native port: gRPC's memory quota of that size)", None,
          ("gate.ReceiveSlots", "native.NativePlane.start"), setting="max_receiving_bytes"),
    Limit("receive share", "the memory budget's share that max_receiving_bytes defaults to",
          0.25, ("app.Server.start",), constant="app.DEFAULT_RECEIVING_SHARE"),
    Limit("stream window", "requests of one ModelStreamInfer stream in the server at once",
          64, ("service.InferenceServicer.ModelStreamInfer",), constant="service.STREAM_WINDOW"),
    Limit("stream share", "the memory budget's share one stream's unsent answers may hold before it stops reading",
          0.25, ("service._StreamHold", "native.NativePlane"), constant="service.STREAM_BUDGET_SHARE"),
    Limit("queue size", "requests waiting per model (RESOURCE_EXHAUSTED)",
          512, ("batcher.Batcher.submit", "native.NativePlane"), setting="max_queue_size",
          constant="batcher.BatchPolicy.max_queue_size"),
    Limit("queue bytes", "input bytes waiting per model (RESOURCE_EXHAUSTED)",
          1 * GiB, ("batcher.Batcher.submit", "native.NativePlane"), setting="max_queued_bytes",
          constant="batcher.BatchPolicy.max_queued_bytes"),
    Limit("attention", "one request's attention matrix, B*H*Lq*Lk*4 bytes (INVALID_ARGUMENT)",
          2 * GiB, ("codec._check_attention_bytes",), setting="max_attention_bytes"),
    Limit("scores", "attention scores a merged batch's run holds, per head: max_attention_bytes / (4 * heads) "
          "(a request that would pass it waits for the next batch)",
          None, ("models.ModelRegistry", "batcher.BatchPolicy"), setting="max_attention_bytes"),
    Limit("memory budget", "RSS above idle for queued inputs, runs in flight, unsent answers; default: "
          "DEFAULT_SHARE of the cgroup's (or machine's) memory", None,
          ("memory.budget.MemoryBudget", "native.share_budget"), setting="memory_limit_bytes"),
    Limit("memory share", "the share of the cgroup's (or machine's) memory the budget defaults to",
          0.6, ("memory.costs.default_memory_limit",), constant="memory.costs.DEFAULT_SHARE"),
    Limit("concurrent streams", "HTTP/2 streams (calls) per gRPC connection at once",
          100, ("app.Server.start",), setting="max_concurrent_streams"),
    Limit("REST connections", "REST connections open at once (the longest idle one is closed for a new one)",
          1024, ("rest.RestPort._opened",), setting="max_http_connections", constant="rest.MAX_CONNECTIONS"),
    Limit("REST head time", "seconds a REST request head may take",
          10.0, ("rest._Connection.time_head",), setting="http_header_timeout_s", constant="rest.HEAD_TIMEOUT_S"),
    Limit("REST head field", "bytes of a request line or one header field (431)",
          8190, ("rest.RestPort",), constant="rest.MAX_FIELD_BYTES"),
    Limit("REST headers", "header fields of one REST request (431)",
          64, ("rest.RestPort",), constant="rest.MAX_HEADERS"),
    Limit("request parameters", "entries of one `parameters` map of a ModelInfer request, counted on the wire "
          "before a large message is parsed (INVALID_ARGUMENT)",
          64, ("parsing.bounded_infer_request",), constant="parsing.MAX_PARAMETERS"),
    Limit("request parameters bytes", "bytes of a ModelInfer request's `parameters` maps together (INVALID_ARGUMENT)",
          16 << 10, ("parsing.bounded_infer_request",), constant="parsing.MAX_PARAMETERS_BYTES"),
    Limit("request fields", "top-level fields of one ModelInfer message (INVALID_ARGUMENT)",
          4096, ("parsing.bounded_infer_request",), constant="parsing.MAX_REQUEST_FIELDS"),
    Limit("shared memory regions", "system shared memory regions registered at once (INVALID_ARGUMENT)",
          64, ("shm.SystemSharedMemory.register",), setting="shared_memory_max_regions"),
    Limit("shared memory bytes", "bytes of all registered regions together, also reserved in the memory budget "
          "(INVALID_ARGUMENT)", 4 * GiB, ("shm.SystemSharedMemory.register",), setting="shared_memory_max_bytes"),
    Limit("quoted text", "characters of client text an error message quotes",
          100, ("quoting.quoted",), constant="quoting.QUOTED_CHARS"),
    Limit("error details", "characters of an error's details (the grpc-message trailer)",
          1024, ("errors.status_for",), constant="quoting.MAX_DETAILS_CHARS"),
)
