"""ServerConfig: every setting of a server process, in one typed place.

Each field has a flag (`--model-repository`) and an environment variable with the ATTNSERVE_
prefix (`ATTNSERVE_MODEL_REPOSITORY`); a flag beats the variable, the variable beats the default.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from attnserve.contract import parse_version
from attnserve.files import FileRefused, check_writable
from attnserve.ranges import BATCH_SIZE, INT32_MAX, INT64_MAX, MAX_WAIT_S, QUEUE_DELAY_MS, VERSION, Range, count

ENV_PREFIX = "ATTNSERVE_"
DEVICES = ("cpu", "cuda", "auto")
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")  # any case
LOG_FORMATS = ("text", "json")
MODEL_CONTROL_MODES = ("none", "explicit", "poll")  # as Triton's --model-control-mode
# Who serves ModelInfer: auto is native where the extension loads, else python (server.data_plane).
DATA_PLANES = ("auto", "native", "python")
WARMUP_MODES = ("graphs", "none")  # server.warmup.MODES (kept here: config imports no server module)
# gRPC's 4 MiB default is too small for real requests (4 x 200 x 512 float32 is 4.9 MB).
DEFAULT_MAX_MESSAGE_BYTES = 64 * 1024 * 1024


# -- ranges: every flag's bound (attnserve.ranges holds the ones config.json shares) ------------

# A wait that must be positive is at least 1 ms: less (a REST head timeout, a heartbeat) fails every
# call or kills every healthy worker, and gRPC, which takes its times as int milliseconds with
# INT_MAX meaning never, would round it to 0.
MIN_S = 0.001
MIN_GRPC_S = MIN_S
MAX_GRPC_S = (INT32_MAX - 1) / 1000
# Threads (per model: --batches-in-flight runners, ONNX Runtime's pool) or worker processes one
# setting starts, all at once: far beyond any machine's cores, short of the process limits.
MAX_THREADS = 1024


def _seconds(low: float = MIN_S, high: float = MAX_WAIT_S, never: str = "") -> Range:
    return Range(low, high, integer=False, unit="seconds", never=never)


_GRPC_TIME = _seconds(MIN_GRPC_S, MAX_GRPC_S)

# Each numeric ServerConfig field's range (None, where a field takes it, is its default: unset).
FLAG_RANGES: dict[str, Range] = {
    "port": count(0, 65535),
    "http_port": count(-1, 65535),
    "metrics_port": count(-1, 65535),
    "max_batch_size": BATCH_SIZE,
    "max_queue_delay_ms": QUEUE_DELAY_MS,
    "max_queue_size": count(unit="requests"),
    "max_padding_ratio": Range(0, 1, integer=False, high_open=True),
    "max_attention_bytes": count(unit="bytes"),
    "batches_in_flight": count(high=MAX_THREADS),
    "intra_op_threads": count(0, MAX_THREADS),
    "chunk_query_rows": count(0),
    "compute_nice": count(0, 19),
    "max_message_bytes": count(high=INT32_MAX, unit="bytes"),
    "max_queued_bytes": count(unit="bytes"),
    "priority_aging_batches": count(unit="batches"),
    "memory_limit_bytes": count(unit="bytes"),
    "max_concurrent_streams": count(high=INT32_MAX),
    "max_receiving_bytes": count(unit="bytes"),
    "max_typed_bytes": count(unit="bytes"),
    "max_json_bytes": count(unit="bytes"),
    "max_http_connections": count(high=INT32_MAX),
    "http_header_timeout_s": _seconds(),
    "drain_delay_s": _seconds(0),
    "grace_period_s": _seconds(0),
    "repository_poll_secs": _seconds(),
    "workers": count(high=MAX_THREADS, unit="processes"),
    "worker_heartbeat_s": _seconds(),
    "worker_heartbeat_timeout_s": _seconds(),
    "access_records_buffer": count(unit="records"),
    "shared_memory_max_regions": count(),
    "shared_memory_max_bytes": count(unit="bytes"),
    "shared_memory_idle_timeout_s": _seconds(0),  # 0: never
    "grpc_max_connection_age_s": dataclasses.replace(_GRPC_TIME, never="never"),
    "grpc_max_connection_age_grace_s": dataclasses.replace(_GRPC_TIME, never="no limit"),
    "grpc_keepalive_time_s": _GRPC_TIME,
    "grpc_keepalive_timeout_s": _GRPC_TIME,
    "grpc_keepalive_min_ping_interval_s": _GRPC_TIME,
}


@dataclass(frozen=True)
class ServerConfig:
    model_repository: Path = Path("models")
    host: str = "0.0.0.0"
    port: int = 8001  # gRPC: Open Inference Protocol, grpc.health.v1, reflection
    http_port: int = 8000  # HTTP/REST: the same protocol (server.rest); 0 = any free port, -1 = off
    metrics_port: int = 8002  # Prometheus text over HTTP; 0 = any free port, -1 = off
    device: str = "cpu"  # cpu | cuda (refuse to start without it) | auto (cuda if it works)
    # Per-model batching and limits come from config.json; these override every model's.
    max_batch_size: int | None = None  # sequences merged into one ONNX Runtime run
    max_queue_delay_ms: float | None = None  # wait for company while another batch runs
    max_queue_size: int = 512  # requests waiting per model; beyond it RESOURCE_EXHAUSTED
    max_padding_ratio: float = 0.5  # padded share of a batch's attention matrix allowed
    max_attention_bytes: int = 2 * 1024**3  # one request's B*H*Lq*Lk*4 bytes; over it refused
    batches_in_flight: int = 1  # ONNX Runtime runs at once per model
    intra_op_threads: int = 0  # ONNX Runtime threads per run; 0 = one per core
    # A lone request (no other call in flight, after a quiet spell) runs on sessions whose threads
    # spin between runs (server.engine, "Solo sessions"): lower latency at low load for CPU.
    spin_when_alone: bool = True
    # A fused run of more query rows than this is computed in chunks of at most this many, so a
    # cancel stops it between two chunks (server.engine, "Row chunks"); 0: never chunked.
    chunk_query_rows: int = 1024
    # Added to the nice value of the threads that compute (each batcher's run threads, ONNX
    # Runtime's pool threads): where they and the event loop want a core, the loop goes first
    # (server.priority). 0: the same priority as the loop.
    compute_nice: int = 5
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    max_queued_bytes: int = 1024**3  # input bytes waiting per model; beyond it RESOURCE_EXHAUSTED
    # A waiting request gains one priority level per this many batches formed without it, so a
    # low-priority request is never starved by a stream of higher ones (server.scheduling).
    priority_aging_batches: int = 4
    # RSS above idle for queued inputs, runs in flight and answers not yet sent (server.memory);
    # None: a share of the cgroup's (or machine's) memory, memory.default_memory_limit().
    memory_limit_bytes: int | None = None
    # HTTP/2 streams (calls) per connection at once; a client's further calls wait client-side.
    max_concurrent_streams: int = 100
    # Bytes of unary inference messages gRPC may be receiving at once, each counted at
    # max_message_bytes (server.gate: beyond them a call's message waits to be read); None: a
    # quarter of the memory budget. At least one message is always received.
    max_receiving_bytes: int | None = None
    # Tensor bytes a gRPC request's typed contents (fp32_contents, bool_contents) may hold, and
    # its answer's: they are built and parsed on the event loop (time grows with the bytes), so larger
    # tensors must travel as raw_input_contents / raw_output_contents. Over it: INVALID_ARGUMENT.
    max_typed_bytes: int = 4 * 1024**2
    # JSON text of a REST request, and of an answer's `data` (24 bytes a value, the most json
    # writes for a float32): parsed and written on the event loop (time grows with it), so larger
    # tensors must travel as binary data (binary_data_size, binary_data). Over it: 400.
    max_json_bytes: int = 8 * 1024**2
    # REST connections open at once; at the cap the one that has waited longest for a request
    # head is closed for a new one (server.rest; docs/rest-hardening.md).
    max_http_connections: int = 1024
    # The most a REST request head may take, from its connection's start or its first byte.
    http_header_timeout_s: float = 10.0
    # On SIGTERM/SIGINT/SIGHUP: readiness goes NOT_SERVING at once, calls are still admitted for
    # drain_delay_s (load balancers and Kubernetes endpoints take that long to stop sending),
    # then new streams are refused (GOAWAY) and what was admitted finishes within grace_period_s.
    drain_delay_s: float = 5.0
    grace_period_s: float = 30.0
    model_versions: tuple[tuple[str, int], ...] = ()  # pins, e.g. (("self_attention", 1),)
    # none: the models found at start, no changes; explicit: RepositoryModelLoad/Unload change
    # them; poll: the repository is rescanned every repository_poll_secs (server.models).
    model_control_mode: str = "none"
    repository_poll_secs: float = 15.0
    ready_file: Path | None = None  # written with the bound ports once serving (tests, scripts)
    log_level: str = "INFO"  # DEBUG | INFO | WARNING | ERROR, any case
    log_format: str = "text"  # text | json: one JSON object per line (level, logger, message or access fields)
    # Processes serving the same ports (server.workers); None: one per two CPUs this process may
    # use (affinity and cgroup quota; server.workers.default_workers), one in explicit mode.
    workers: int | None = None
    # The supervisor's liveness watchdog (server.workers): each worker's event loop must echo a
    # heartbeat sent every worker_heartbeat_s within worker_heartbeat_timeout_s, or it is killed
    # and replaced. Generous: a worker's loop is never meant to block that long.
    worker_heartbeat_s: float = 5.0
    worker_heartbeat_timeout_s: float = 20.0
    # One line per call (server.tracing: transport, peer, model, status, times, bytes, trace id).
    access_log: bool = False
    # Native calls' records (server.native_records) held for the event loop at most; beyond, dropped and counted.
    access_records_buffer: int = 16384
    # Triton's system shared memory extension (server.shm, docs/shared-memory.md): off by default,
    # since a registered region lets a caller on this host have the server read and write there.
    allow_shared_memory: bool = False
    shared_memory_max_regions: int = 64  # regions registered at once
    shared_memory_max_bytes: int = 4 * 1024**3  # bytes of all registered regions together
    # A region no request used for this long is unregistered (a caller killed before it unregistered
    # would hold the bounds for ever); 0: never.
    shared_memory_idle_timeout_s: float = 3600.0
    # Security (server/security.py). TLS when both cert and key are given; mutual TLS (client
    # certificates required) when a client CA is given too; bearer tokens when a token file is.
    tls_cert: Path | None = None  # PEM certificate chain of the server
    tls_key: Path | None = None  # PEM private key of the server
    tls_client_ca: Path | None = None  # PEM roots that client certificates must chain to
    auth_token_file: Path | None = None  # file holding the bearer token clients must send
    # native: the C++ data plane (server.native) listens on `port`, serves ModelInfer and
    # ModelStreamInfer itself and relays every other call to the Python gRPC server on a private socket.
    # auto: native where its extension loads, python (saying why) where it does not.
    data_plane: str = "auto"
    # graphs: each graph runs at a short and a crossover length, on every session kind, before its
    # model reports ready (server.warmup); none: ready as soon as its sessions load.
    warmup: str = "graphs"
    # gRPC connections closed (GOAWAY) after this age so that clients reconnect and spread over
    # replicas and workers again; None: never, as gRPC (docs/deployment.md, "Connections").
    grpc_max_connection_age_s: float | None = None
    grpc_max_connection_age_grace_s: float | None = None  # calls in flight then get this long; None: no limit
    # Server pings after this long without activity on a connection, and closes it when a ping
    # goes unanswered for keepalive_timeout_s: dead peers (a node gone, a NAT's dropped entry) are found.
    grpc_keepalive_time_s: float = 60.0
    grpc_keepalive_timeout_s: float = 20.0
    # Clients may ping this often without calls (gRPC's default, 300, answers a client whose own
    # keepalive is shorter with GOAWAY "too_many_pings").
    grpc_keepalive_min_ping_interval_s: float = 10.0

    def __post_init__(self) -> None:
        # Every number against its range (FLAG_RANGES); infinity, where it means never, becomes None.
        for name, allowed in FLAG_RANGES.items():
            if getattr(self, name) is not None:
                object.__setattr__(self, name, allowed.check(name, getattr(self, name)))
        for name, version in self.model_versions:
            VERSION.check(f"model_versions {name}", version)
        if self.device not in DEVICES:
            raise ValueError(f"device must be one of {', '.join(DEVICES)}, got {self.device!r}")
        if self.model_control_mode not in MODEL_CONTROL_MODES:
            raise ValueError(f"model_control_mode must be one of {', '.join(MODEL_CONTROL_MODES)}, "
                             f"got {self.model_control_mode!r}")
        if self.log_level.upper() not in LOG_LEVELS:
            raise ValueError(f"log_level must be one of {', '.join(LOG_LEVELS)} (any case), got {self.log_level!r}")
        if self.log_format not in LOG_FORMATS:
            raise ValueError(f"log_format must be one of {', '.join(LOG_FORMATS)}, got {self.log_format!r}")
        if (self.workers or 1) > 1 and self.allow_shared_memory:
            raise ValueError("--workers above 1 cannot be combined with --allow-shared-memory: a region registered "
                             "through one worker would be unknown to the others (use --workers 1)")
        if (self.workers or 1) > 1 and self.model_control_mode == "explicit":
            raise ValueError("--workers above 1 cannot be combined with --model-control-mode explicit: a model "
                             "loaded or unloaded through one worker would not change the others' (use --workers 1, "
                             "or --model-control-mode poll, where every worker rescans the repository)")
        if self.data_plane not in DATA_PLANES:
            raise ValueError(f"data_plane must be one of {', '.join(DATA_PLANES)}, got {self.data_plane!r}")
        if self.warmup not in WARMUP_MODES:
            raise ValueError(f"warmup must be one of {', '.join(WARMUP_MODES)}, got {self.warmup!r}")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("TLS needs both --tls-cert and --tls-key, got only "
                             + ("--tls-cert" if self.tls_key is None else "--tls-key"))
        if self.tls_client_ca is not None and self.tls_cert is None:
            raise ValueError("--tls-client-ca (mutual TLS) needs --tls-cert and --tls-key")

    @property
    def pinned_versions(self) -> dict[str, int]:
        return dict(self.model_versions)


# Flag help, one line each; docs/server.md's configuration table is this list.
_HELP: dict[str, str] = {
    "model_repository": "model repository written by `attnserve export`",
    "host": "address to bind",
    "port": "gRPC port (0 = any free port)",
    "http_port": "HTTP/REST port, the same protocol (0 = any free port, -1 = off)",
    "metrics_port": "Prometheus metrics HTTP port (0 = any free port, -1 = off)",
    "device": "cpu, cuda (refuse to start without it) or auto",
    "max_batch_size": "sequences per ONNX Runtime run, for every model (default: config.json)",
    "max_queue_delay_ms": "longest wait for company while another batch runs (default: config.json)",
    "max_queue_size": "requests queued per model before RESOURCE_EXHAUSTED",
    "max_padding_ratio": "largest padded share of a batch's attention matrix",
    "max_attention_bytes": "largest attention matrix (B*H*Lq*Lk*4 bytes) one request may need",
    "batches_in_flight": "ONNX Runtime runs at once per model",
    "intra_op_threads": "ONNX Runtime intra-op threads (0 = one per core)",
    "spin_when_alone": "a lone request runs on ONNX Runtime sessions whose threads spin 2 ms after it, "
                       "so the next finds the cores awake (CPU only; false: threads always sleep when idle)",
    "chunk_query_rows": "a long run without attn_probs (the fused graphs) computes this many query rows at a "
                        "time, so a cancel stops it between chunks (0 = never chunked)",
    "compute_nice": "added to the nice value of the threads that run models (batch runs, ONNX Runtime's pool), "
                    "so that the event loop goes first where they want the same core (0 = the loop's priority)",
    "max_message_bytes": "largest gRPC message received or sent; largest REST body received (inflated)",
    "max_queued_bytes": "input bytes queued per model before RESOURCE_EXHAUSTED",
    "priority_aging_batches": "a queued request gains one priority level per this many batches formed without "
                              "it (no level starves)",
    "memory_limit_bytes": "memory budget above idle RSS: queued inputs, runs in flight, unsent answers "
                          "(default: 60%% of the cgroup's or machine's memory, less idle)",
    "max_concurrent_streams": "HTTP/2 streams (calls) at once per client connection",
    "max_receiving_bytes": "bytes of ModelInfer messages received at once, each counted at --max-message-bytes "
                           "(default: a quarter of the memory budget)",
    "max_typed_bytes": "largest tensor bytes in a gRPC request's or answer's typed contents (larger: raw contents)",
    "max_json_bytes": "largest JSON text of a REST request or answer's data (larger: binary data)",
    "max_http_connections": "REST connections open at once; at the cap the one waiting longest for a request "
                            "head is closed for the new one",
    "http_header_timeout_s": "seconds a REST request head may take (from the connection's start, or its first "
                             "byte after an idle keep-alive spell); later: 408 and closed",
    "drain_delay_s": "seconds after SIGTERM that calls are still admitted (readiness already NOT_SERVING)",
    "grace_period_s": "seconds to finish admitted requests once the drain delay is over",
    "model_versions": "pin versions: NAME=VERSION[,NAME=VERSION...] (default: highest)",
    "model_control_mode": "none (the models found at start), explicit (load/unload API) or poll (rescan)",
    "repository_poll_secs": "seconds between rescans of the repository in --model-control-mode poll",
    "ready_file": "write {grpc_port, http_port, metrics_port} as JSON here once serving",
    "log_level": "DEBUG, INFO, WARNING or ERROR",
    "log_format": "text, or json: the whole log as one JSON object per line (with level and logger)",
    "workers": "processes serving the same ports, each its own event loop and ONNX Runtime sessions "
               "(default: one per two CPUs the process may use; 1 in explicit model control mode)",
    "worker_heartbeat_s": "seconds between the supervisor's heartbeats to each worker (--workers above 1)",
    "worker_heartbeat_timeout_s": "seconds a worker's event loop has to answer a heartbeat before it is killed "
                                  "and replaced",
    "access_log": "one access line per call: transport, peer, model, status, duration, queue and run time, "
                  "bytes, trace id (a switch; or true/false)",
    "access_records_buffer": "native data plane: call records (access lines, spans) waiting for the event loop at "
                             "most; beyond, dropped and counted (attnserve_access_records_dropped_total)",
    "allow_shared_memory": "serve Triton's system shared memory extension: tensors read from and written to "
                           "regions that callers on this host register (a switch; or true/false; implies one worker)",
    "shared_memory_max_regions": "shared memory regions registered at once",
    "shared_memory_max_bytes": "bytes of all registered shared memory regions together (also counted in the "
                               "memory budget)",
    "shared_memory_idle_timeout_s": "seconds after which a shared memory region that no request used is "
                                    "unregistered (0: never)",
    "tls_cert": "PEM certificate chain: serve TLS (with --tls-key)",
    "tls_key": "PEM private key of --tls-cert",
    "tls_client_ca": "PEM roots: require client certificates signed by them (mutual TLS)",
    "auth_token_file": "file holding a bearer token every call must send (health stays open)",
    "data_plane": "auto (native where its extension is built and loads, else python, the log says why), native: "
                  "the C++ data plane serves --port (ModelInfer and ModelStreamInfer in C++, every other call relayed "
                  "to the Python server; `make native` builds it; refuses to start without it), or python",
    "warmup": "graphs: before a model reports ready, run each of its graphs at a short and at the crossover "
              "length on every session kind (readiness false, index state WARMING meanwhile); none: ready at once",
    "grpc_max_connection_age_s": "close each gRPC connection (GOAWAY) after this many seconds, so that clients "
                                 "reconnect and spread over replicas and workers (default: never)",
    "grpc_max_connection_age_grace_s": "seconds calls in flight get to finish after the connection age "
                                       "(default: no limit)",
    "grpc_keepalive_time_s": "seconds without activity after which the server pings a gRPC connection",
    "grpc_keepalive_timeout_s": "seconds a keepalive ping may go unanswered before the connection is closed",
    "grpc_keepalive_min_ping_interval_s": "least seconds between a client's keepalive pings the server accepts "
                                          "(more often: GOAWAY too_many_pings)",
}


def env_name(field_name: str) -> str:
    return ENV_PREFIX + field_name.upper()


def flag_name(field_name: str) -> str:
    return "--" + field_name.replace("_", "-")


def _parse_bool(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"expected true or false, got {text!r}")


def _parse_pins(text: str) -> tuple[tuple[str, int], ...]:
    pins = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, sep, version = part.partition("=")
        number = parse_version(version)
        if not sep or not name or number is None:
            raise ValueError(f"expected NAME=VERSION (a version in 1..{INT64_MAX}), got {part!r}")
        pins.append((name, number))
    return tuple(pins)


# How a flag's or variable's text becomes a field's value, by the field's type (`X | None`: X's).
_PARSERS: dict[Any, Callable[[str], Any]] = {
    int: int,
    float: float,
    str: str,
    bool: _parse_bool,
    Path: Path,
    tuple[tuple[str, int], ...]: _parse_pins,
}


def _parser_for(name: str, hint: Any) -> Callable[[str], Any]:
    if isinstance(hint, types.UnionType):  # X | None
        args = [arg for arg in typing.get_args(hint) if arg is not type(None)]
        hint = args[0] if len(args) == 1 else hint
    try:
        return _PARSERS[hint]
    except KeyError:
        raise TypeError(f"ServerConfig.{name}: no parser for {hint!r}; add one to _PARSERS") from None


# Each field's parser, resolved once from its real type (not from the annotation's text).
_HINTS = typing.get_type_hints(ServerConfig)
_FIELD_PARSERS: dict[str, Callable[[str], Any]] = {name: _parser_for(name, hint) for name, hint in _HINTS.items()}


def _range_help(name: str) -> str:
    return f"{FLAG_RANGES[name].describe()}; ".replace("%", "%%") if name in FLAG_RANGES else ""


def build_parser(prog: str = "attnserve serve") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Serve attention models over the Open Inference Protocol (KServe V2) on gRPC and HTTP/REST. "
        f"Every flag can also be set by its environment variable ({ENV_PREFIX}<FLAG>).",
    )
    for f in dataclasses.fields(ServerConfig):
        default = f.default
        shown = ",".join(f"{n}={v}" for n, v in default) if f.name == "model_versions" else default
        # A bool is a switch (`--access-log`) that also takes a value (`--access-log false`).
        switch = {"nargs": "?", "const": True} if _HINTS[f.name] is bool else {}
        parser.add_argument(
            flag_name(f.name),
            dest=f.name,
            type=_FIELD_PARSERS[f.name],
            default=None,
            help=f"{_HELP[f.name]} [{_range_help(f.name)}env {env_name(f.name)}; default {shown}]",
            **switch,
        )
    return parser


def load_config(argv: list[str] | None = None, environ: Mapping[str, str] | None = None,
                prog: str = "attnserve serve") -> ServerConfig:
    """Flags, then ATTNSERVE_* variables, then defaults. Raises SystemExit(2) on bad values."""
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    environ = os.environ if environ is None else environ
    values: dict[str, Any] = {}
    for f in dataclasses.fields(ServerConfig):
        given, source = getattr(args, f.name), flag_name(f.name)
        if given is None and env_name(f.name) in environ:
            source = env_name(f.name)
            try:
                given = _FIELD_PARSERS[f.name](environ[env_name(f.name)])
            except ValueError as err:
                parser.error(f"{source}: {err}")
        if given is not None and f.name in FLAG_RANGES:
            try:  # named as given: the flag, or its variable
                FLAG_RANGES[f.name].check(source, given)
            except ValueError as err:
                parser.error(str(err))
        if given is not None:
            values[f.name] = given
    try:
        config = ServerConfig(**values)
        if config.ready_file is not None:
            try:  # refused before serving, not found once the ports are bound
                check_writable(config.ready_file, make_parents=True)
            except FileRefused as err:
                raise ValueError(f"--ready-file {config.ready_file}: {err}") from None
    except ValueError as err:
        parser.error(str(err))
        raise  # unreachable: parser.error exits
    return config


