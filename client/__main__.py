"""`attnserve`: health, model metadata, one inference, or a resumable batch job.

    attnserve health --url 127.0.0.1:8001
    attnserve models --model self_attention
    attnserve infer --model cross_attention --input in.npz --outputs output,attn_probs \\
        --output out.npz --plot heads.png
    attnserve batch --url 127.0.0.1:8001,127.0.0.1:8002 --model self_attention \\
        --input in.npz --output out.npz --concurrency 4 --batch-size 16
    attnserve batch ... --input in.parquet --output part1.parquet --shard 1/3   # then --merge
    attnserve batch --engine ray --address 127.0.0.1:6379 --model self_attention \\
        --input in.parquet --output out/ [--model-repository models]         # docs/ray.md

The connection flags (--url, --timeout, --channels, --compression, TLS, token) follow the command. --url
defaults to $ATTNSERVE_URL, else localhost:8001. Exit status: 0 done, 1 the server refused or
is not healthy, 2 bad arguments, 130 interrupted.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys
from pathlib import Path
from typing import Any

import grpc
import numpy as np
from attnserve.client.batch import DEFAULT_BATCH_SIZE, DEFAULT_CONCURRENCY, BatchError, BatchJob, run_batch
from attnserve.client.batch.progress import DEFAULT_EVERY_S
from attnserve.client.batch.spec import SHARED_MEMORY_MODES
from attnserve.client.client import InferenceClient
from attnserve.client.codec import ModelIndexEntry, check_values
from attnserve.client.errors import InferenceError
from attnserve.client.options import (
    COMPRESSION,
    DEFAULT_TIMEOUT_S,
    DEFAULT_URL,
    GRPC_SCHEMES,
    ClientOptions,
    RetryPolicy,
    TlsConfig,
    parse_addresses,
)
from attnserve.client.paths import check_input_file, check_output_file

from attnserve.contract import OUTPUT_NAMES
from attnserve.files import MAX_TOKEN_BYTES, FileRefused, read_bounded, write_atomic

logger = logging.getLogger("attnserve.client")

EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130
URL_ENV = "ATTNSERVE_URL"


class UsageError(Exception):
    """Arguments that parse but do not make sense together; exit status 2."""


# ---------------------------------------------------------------------------
# Arguments
# ---------------------------------------------------------------------------


def _connection_flags(parser: argparse.ArgumentParser, *, suppress: bool) -> None:
    # Defined on the main parser (with defaults) and on every command (with SUPPRESS), so a flag
    # given after the command wins and one given before it is not reset by the command's default.
    def default(value: Any) -> Any:
        return argparse.SUPPRESS if suppress else value

    group = parser.add_argument_group("connection")
    group.add_argument("--url", default=default(os.environ.get(URL_ENV, DEFAULT_URL)),
                       help=f"HOST:PORT[,HOST:PORT...], several = round robin (default: ${URL_ENV} or {DEFAULT_URL})")
    group.add_argument("--timeout", type=float, default=default(DEFAULT_TIMEOUT_S), metavar="SECONDS",
                       help=f"deadline of each call, retries included (default {DEFAULT_TIMEOUT_S:g})")
    group.add_argument("--retries", type=int, default=default(4), metavar="N",
                       help="retries of a call answered UNAVAILABLE, with exponential backoff (default 4)")
    group.add_argument("--channels", type=int, default=default(1), metavar="N",
                       help="connections to open, calls taken in turn (default 1): N > 1 reaches every "
                            "worker of a --workers server")
    group.add_argument("--compression", choices=sorted(COMPRESSION), default=default(None),
                       help="compress requests on the wire (default: none)")
    group.add_argument("--max-message-mb", type=int, default=default(64), metavar="MIB",
                       help="largest message sent or received (default 64, the server's default)")
    group.add_argument("--token-file", type=Path, default=default(None),
                       help="file holding a bearer token, sent as 'authorization: Bearer <token>'")
    group.add_argument("--tls-ca", type=Path, default=default(None),
                       help="PEM roots to verify the server (enables TLS)")
    group.add_argument("--tls-cert", type=Path, default=default(None), help="PEM client certificate (mTLS)")
    group.add_argument("--tls-key", type=Path, default=default(None), help="PEM client key (mTLS)")
    group.add_argument("--tls", action="store_true", default=default(False),
                       help="TLS with the system's roots (implied by any --tls-* file)")
    group.add_argument("--tls-server-name", default=default(None),
                       help="name to verify in the server's certificate (default: the host in --url)")
    group.add_argument("-v", "--verbose", action="store_true", default=default(False), help="log progress (INFO)")


def _parser(prog: str = "attnserve") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    _connection_flags(parser, suppress=False)
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(name: str, help_text: str) -> argparse.ArgumentParser:
        sub = commands.add_parser(name, help=help_text, description=help_text)
        _connection_flags(sub, suppress=True)
        return sub

    health = command("health", "server liveness, readiness, grpc.health.v1 status, and model readiness")
    health.add_argument("--model", action="append", metavar="NAME", help="model to check (repeatable; default: none)")

    models = command("models", "the models the server serves (its repository index), with their tensors")
    models.add_argument("--model", action="append", metavar="NAME",
                        help="only this model (repeatable; default: every model the server lists)")
    models.add_argument("--json", action="store_true", help="print JSON")

    infer = command("infer", "one inference from .npy/.npz files")
    infer.add_argument("--model", required=True, metavar="NAME")
    infer.add_argument("--model-version", default="", metavar="VERSION", help="default: the server's choice")
    infer.add_argument("--input", type=Path, metavar="IN.npz", help="arrays query, key, value and optionally mask")
    infer.add_argument("--query", type=Path, metavar="Q.npy")
    infer.add_argument("--key", type=Path, metavar="K.npy")
    infer.add_argument("--value", type=Path, metavar="V.npy")
    infer.add_argument("--mask", type=Path, metavar="M.npy", help="bool (batch, lq, lk), True = attend")
    infer.add_argument("--outputs", default="output", metavar="NAMES", help="comma-separated (default: output)")
    infer.add_argument("--output", type=Path, metavar="OUT.npz", help="write the outputs here (default: print)")
    infer.add_argument("--plot", type=Path, metavar="FILE.png",
                       help="draw attention heatmaps of one item, a panel per head (asks for attn_probs)")
    infer.add_argument("--plot-item", type=int, default=0, metavar="I", help="item to plot (default 0)")

    batch = command("batch", "a resumable job over many items: bounded concurrency, outputs in input order")
    batch.add_argument("--model", metavar="NAME", help="required, except with --merge")
    batch.add_argument("--model-version", default="", metavar="VERSION",
                       help="default: the version that answers first, pinned for the rest of the job")
    batch.add_argument("--input", type=Path, metavar="IN.npz|IN.parquet|DIR",
                       help="query (N, lq, q_dim), key/value (N, lk, kv_dim), optional mask (N, lq, lk); "
                            "or a Parquet table of such items (an optional id column); or a directory of "
                            "such shards, in sorted order. Required, except with --merge")
    batch.add_argument("--output", type=Path, required=True, metavar="OUT.npz|OUT.parquet|DIR",
                       help="an .npz or .parquet (with an id column); with --engine ray, a directory of parts")
    batch.add_argument("--shard", metavar="I/N",
                       help="compute only share I of N (0 <= I < N, contiguous items) into --output; "
                            "join the N outputs with --merge")
    batch.add_argument("--merge", type=Path, nargs="+", metavar="PART",
                       help="join these outputs of --shard 0/N .. N-1/N, in that order, into --output")
    batch.add_argument("--engine", choices=("client", "ray"), default="client",
                       help="client: this process calls --url (default); ray: Ray Data over a Parquet "
                            "input (pip install 'attnserve[ray]'; docs/ray.md)")
    batch.add_argument("--address", metavar="RAY_ADDRESS",
                       help="--engine ray: the Ray cluster (default: $RAY_ADDRESS, else a local one)")
    batch.add_argument("--model-repository", type=Path, metavar="DIR",
                       help="--engine ray: run the exported model in each actor (DIR/MODEL); without it the "
                            "actors call the servers of --url")
    batch.add_argument("--actors", type=int, default=2, metavar="N", help="--engine ray: actors (default 2)")
    batch.add_argument("--outputs", default="output", metavar="NAMES",
                       help="output[,attn_probs] (default: output)")
    batch.add_argument("--batch-size", type=int, default=DEFAULT_BATCH_SIZE, metavar="N",
                       help=f"items per request (default {DEFAULT_BATCH_SIZE})")
    batch.add_argument("--concurrency", type=int, default=DEFAULT_CONCURRENCY, metavar="N",
                       help=f"requests in flight (default {DEFAULT_CONCURRENCY})")
    batch.add_argument("--shared-memory", choices=SHARED_MEMORY_MODES, default="auto",
                       help="auto (default): tensors through system shared memory when the server is on this "
                            "host and allows it (docs/shared-memory.md); off: always in the messages")
    batch.add_argument("--cleanup-shared-memory", action="store_true",
                       help="compute nothing: release the shared memory a killed run of the job writing --output "
                            "left (its regions on --url, its objects in /dev/shm); a rerun does it by itself")
    batch.add_argument("--priority", type=int, default=0, metavar="N",
                       help="priority level of every request, 1 the highest (default 0: the model's default; "
                            "a batch job sends a lower one to yield to online callers)")
    batch.add_argument("--timeout-us", type=int, default=0, metavar="N",
                       help="the longest each request may wait in the server's queue, in microseconds; "
                            "past it the server refuses it unrun (DEADLINE_EXCEEDED) (default 0: the model's)")
    batch.add_argument("--progress-every-s", type=float, default=DEFAULT_EVERY_S, metavar="S",
                       help="when stderr is not a terminal (a file, a pipe): a progress line every S seconds "
                            f"(default {DEFAULT_EVERY_S:g}; a terminal gets a bar)")
    return parser


def _client_options(args: argparse.Namespace) -> ClientOptions:
    for flag, path in (("--token-file", args.token_file), ("--tls-ca", args.tls_ca), ("--tls-cert", args.tls_cert),
                       ("--tls-key", args.tls_key)):
        if path is not None:  # a FIFO here would block the read forever
            _check_input(path, flag)
    token = None
    if args.token_file is not None:
        try:  # a FIFO or /dev/zero is refused, never waited on or read without end
            token = read_bounded(args.token_file, MAX_TOKEN_BYTES).decode("utf-8").strip()
        except (FileRefused, UnicodeDecodeError) as err:
            raise UsageError(f"cannot read --token-file {args.token_file}: {err}") from None
        except OSError as err:
            raise UsageError(f"cannot read --token-file {args.token_file}: {err.strerror}") from None
    tls = None
    if args.tls or args.tls_ca or args.tls_cert or args.tls_key or args.tls_server_name:
        tls = TlsConfig(ca_file=args.tls_ca, cert_file=args.tls_cert, key_file=args.tls_key,
                        server_name=args.tls_server_name)
    if args.retries < 0:
        raise UsageError(f"--retries must be >= 0, got {args.retries}")
    return ClientOptions(url=args.url, timeout_s=args.timeout, max_message_bytes=args.max_message_mb << 20,
                         tls=tls, token=token, retry=RetryPolicy(max_attempts=args.retries + 1),
                         channels=args.channels, compression=args.compression)


def _names(text: str) -> tuple[str, ...]:
    names = tuple(name.strip() for name in text.split(",") if name.strip())
    if not names:
        raise UsageError(f"--outputs needs at least one name, e.g. {','.join(OUTPUT_NAMES)}")
    return names


# ---------------------------------------------------------------------------
# Commands
# ---------------------------------------------------------------------------


def _health(args: argparse.Namespace, options: ClientOptions) -> int:
    """Probe each server of --url on its own (round robin would answer for one of them at random)."""
    urls = [options.url]
    if not options.url.strip().startswith(GRPC_SCHEMES):
        urls = [_format_address(host, port) for host, port in parse_addresses(options.url)]
    healthy = True
    for url in urls:
        prefix = f"{url} " if len(urls) > 1 else ""
        try:
            with InferenceClient(dataclasses.replace(options, url=url)) as client:
                for label, probe in (("live", client.server_live), ("ready", client.server_ready)):
                    value = probe()
                    healthy &= value
                    print(f"{prefix}{label}: {str(value).lower()}")
                status = client.health_check()
                healthy &= status == "SERVING"
                print(f"{prefix}health: {status}")
                for model in args.model or ():
                    ready = client.model_ready(model)
                    healthy &= ready
                    print(f"{prefix}model {model} ready: {str(ready).lower()}")
        except InferenceError as err:
            if len(urls) == 1:
                raise
            healthy = False
            print(f"{prefix}error: {err}")
    return 0 if healthy else EXIT_FAILED


def _format_address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _model_index(client: InferenceClient, wanted: list[str] | None) -> list[ModelIndexEntry]:
    """The server's repository index, or, from a server without one (UNIMPLEMENTED: a plain
    KServe V2 server), the models named with --model as their ModelReady calls find them."""
    try:
        index = client.repository_index()
    except InferenceError as err:
        if err.code != grpc.StatusCode.UNIMPLEMENTED:
            raise
        if not wanted:
            raise UsageError("the server has no RepositoryIndex (it cannot list its models): "
                             "name them with --model") from None
        return [ModelIndexEntry(name, "", "READY" if client.model_ready(name) else "UNAVAILABLE") for name in wanted]
    if wanted:
        known = {entry.name for entry in index}
        unknown = [name for name in wanted if name not in known]
        if unknown:
            raise InferenceError(grpc.StatusCode.NOT_FOUND,
                                 f"the server serves no model {unknown[0]!r}; it lists {sorted(known)}")
        index = [entry for entry in index if entry.name in wanted]
    return index


def _models(args: argparse.Namespace, options: ClientOptions) -> int:
    with InferenceClient(options) as client:
        index = _model_index(client, args.model)
        metadata = {entry.name: client.model_metadata(entry.name) for entry in index if entry.ready}
        if args.json:
            print(json.dumps([entry.to_dict() | ({"metadata": metadata[entry.name].to_dict()}
                                                 if entry.name in metadata else {}) for entry in index], indent=2))
            return 0
    if not index:
        print("the server lists no models")
    by_model: dict[str, list[ModelIndexEntry]] = {}
    for entry in index:  # one entry per model version (Triton's index), grouped by model
        by_model.setdefault(entry.name, []).append(entry)
    for name, entries in by_model.items():
        meta = metadata.get(name)
        ready = [e.version for e in entries if e.ready]
        others = [e for e in entries if not e.ready]
        if meta is None:
            first, *rest = others
            print(f"{name}  {first.state}: " + _why(first))
            others = rest
        else:
            versions = [v for v in ready if v] or list(meta.versions)
            print(f"{meta.name}  READY  versions {', '.join(versions) or '-'}  platform {meta.platform}")
        for e in others:
            print(f"  {e.state}: {_why(e)}")
        if meta is not None:
            for kind, tensors in (("input", meta.inputs), ("output", meta.outputs)):
                for t in tensors:
                    print(f"  {kind:6} {t.name:10} {t.datatype:5} {list(t.shape)}")
    return 0


def _why(entry: ModelIndexEntry) -> str:
    return (f"version {entry.version}: " if entry.version else "") + (entry.reason or "no reason given")


def _check_input(path: Path, flag: str) -> None:
    try:
        check_input_file(path, flag)
    except ValueError as err:
        raise UsageError(str(err)) from None


def _check_output(path: Path, flag: str) -> None:
    try:
        check_output_file(path, flag)
    except ValueError as err:
        raise UsageError(str(err)) from None


def _load_npy(path: Path, what: str) -> np.ndarray:
    _check_input(path, f"--{what}")
    try:
        return np.load(path, allow_pickle=False)
    except (OSError, ValueError) as err:
        raise UsageError(f"cannot read {what} from {path}: {err}") from None


def _infer_inputs(args: argparse.Namespace) -> dict[str, np.ndarray | None]:
    separate = {name: getattr(args, name) for name in ("query", "key", "value", "mask")}
    if args.input is not None:
        if any(separate.values()):
            raise UsageError("give either --input IN.npz or --query/--key/--value[/--mask], not both")
        _check_input(args.input, "--input")
        try:
            with np.load(args.input, allow_pickle=False) as npz:
                arrays = {name: npz[name] for name in npz.files}
        except (OSError, ValueError) as err:
            raise UsageError(f"cannot read --input {args.input}: {err}") from None
        missing = [name for name in ("query", "key", "value") if name not in arrays]
        if missing:
            raise UsageError(f"--input {args.input} lacks {missing}; it has {sorted(arrays)}")
        return {name: arrays.get(name) for name in ("query", "key", "value", "mask")}
    missing = [f"--{name}" for name in ("query", "key", "value") if separate[name] is None]
    if missing:
        raise UsageError(f"give --input IN.npz, or all of --query, --key and --value (missing {', '.join(missing)})")
    return {name: None if path is None else _load_npy(path, name) for name, path in separate.items()}


def _infer(args: argparse.Namespace, options: ClientOptions) -> int:
    outputs = _names(args.outputs)
    if args.plot is not None and "attn_probs" not in outputs:
        outputs += ("attn_probs",)
    for flag, path in (("--output", args.output), ("--plot", args.plot)):
        if path is not None:  # before the inference, not after it
            _check_output(path, flag)
    inputs = _infer_inputs(args)
    try:
        rounded = check_values(inputs)
    except ValueError as err:
        raise UsageError(str(err)) from None
    if rounded:  # documented (docs/client.md), but numbers changed: say so once
        logger.warning("%d input values were rounded to float32 (float64's extra digits, or integers past "
                       "2**24); store the input as float32 to send it unchanged", rounded)
    if args.plot is not None:  # checked before the inference runs, not after
        query = np.asarray(inputs["query"])
        batch = query.shape[0] if query.ndim == 3 else None
        if batch is not None and not 0 <= args.plot_item < batch:
            raise UsageError(f"--plot-item {args.plot_item} is out of range for a batch of {batch} "
                             f"(0..{batch - 1})")
    with InferenceClient(options) as client:
        try:
            result = client.infer(args.model, inputs["query"], inputs["key"], inputs["value"], inputs["mask"],
                                  outputs, model_version=args.model_version)
        except ValueError as err:  # the client's input validation
            raise UsageError(str(err)) from None
    if args.output is not None:
        # To the path as given (np.savez would add .npz to a name without it), whole or not at all.
        write_atomic(args.output, lambda f: np.savez(f, **result))
        print(f"wrote {', '.join(f'{n} {list(a.shape)}' for n, a in result.items())} to {args.output}")
    else:
        for name, array in result.items():
            print(f"{name}: {array.dtype} {list(array.shape)}")
            print(np.array2string(array, precision=5, threshold=20, edgeitems=2))
    if args.plot is not None:
        from attnserve.client.plot import plot_attention

        try:
            plot_attention(result["attn_probs"], args.plot, item=args.plot_item,
                           title=f"{args.model}: attention of item {args.plot_item}")
        except ValueError as err:
            raise UsageError(str(err)) from None
        print(f"wrote attention heatmaps of item {args.plot_item} to {args.plot}")
    return 0


def _shard(text: str | None) -> tuple[int, int] | None:
    if text is None:
        return None
    index, _, count = text.partition("/")
    if not (index.isdigit() and count.isdigit()):
        raise UsageError(f"--shard must be I/N (0 <= I < N), got {text!r}")
    return int(index), int(count)


def _merge(args: argparse.Namespace) -> int:
    from attnserve.client.batch.assemble import merge_outputs

    if args.input is not None or args.shard is not None:
        raise UsageError("--merge joins finished outputs: give it no --input or --shard")
    try:
        items = merge_outputs(args.merge, args.output)
    except (BatchError, ImportError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_FAILED
    print(f"merged {len(args.merge)} outputs, {items} items, into {args.output}", flush=True)
    return 0


def _batch_on_ray(args: argparse.Namespace, options: ClientOptions) -> int:
    from attnserve.client.batch.ray_job import RayJob, run_ray_job

    if args.shard is not None:
        raise UsageError("--shard is for --engine client: Ray splits the input itself")
    try:
        job = RayJob(input_path=args.input, output_dir=args.output, model=args.model,
                     model_dir=None if args.model_repository is None else args.model_repository / args.model,
                     urls=() if args.model_repository is not None else tuple(options.url.split(",")),
                     outputs=_names(args.outputs), batch_size=args.batch_size, actors=args.actors,
                     concurrency=args.concurrency, model_version=args.model_version, timeout_s=options.timeout_s,
                     retries=options.retry.max_attempts - 1, priority=args.priority, timeout_us=args.timeout_us)
    except ValueError as err:
        raise UsageError(str(err)) from None
    try:
        summary = run_ray_job(job, address=args.address)
    except BatchError as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_FAILED
    print(summary.line(), flush=True)
    return 0


def _cleanup_shared_memory(args: argparse.Namespace, options: ClientOptions) -> int:
    from attnserve.client.batch.leftovers import release_job_shared_memory

    if args.merge or args.input is not None:
        raise UsageError("--cleanup-shared-memory takes the job's --output (and --url), not --input or --merge")
    try:
        regions, objects = release_job_shared_memory(args.output, options, timeout_s=args.timeout)
    except BatchError as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_FAILED
    print(f"released {len(regions)} region(s) on {options.url} and {len(objects)} shm object(s) of the job "
          f"writing {args.output}", flush=True)
    return 0


def _batch(args: argparse.Namespace, options: ClientOptions) -> int:
    if args.cleanup_shared_memory:
        return _cleanup_shared_memory(args, options)
    if args.merge:
        return _merge(args)
    missing = [flag for flag, value in (("--model", args.model), ("--input", args.input)) if value is None]
    if missing:
        raise UsageError(f"batch needs {' and '.join(missing)} (or --merge PART...)")
    if args.engine == "ray":
        return _batch_on_ray(args, options)
    try:
        job = BatchJob(model=args.model, input_path=args.input, output_path=args.output,
                       outputs=_names(args.outputs), batch_size=args.batch_size, concurrency=args.concurrency,
                       model_version=args.model_version, timeout_s=args.timeout, shard=_shard(args.shard),
                       shared_memory=args.shared_memory, priority=args.priority, timeout_us=args.timeout_us)
    except ValueError as err:
        raise UsageError(str(err)) from None
    if not args.progress_every_s >= 0:
        raise UsageError(f"--progress-every-s must be >= 0, got {args.progress_every_s}")
    try:
        summary = run_batch(job, options, progress_stream=sys.stderr, progress_every_s=args.progress_every_s)
    except BatchError as err:
        if err.summary is not None and err.summary.items:  # a job that found no items: the error alone
            print(err.summary.line(), flush=True)
        print(f"error: {err}", file=sys.stderr)
        return EXIT_FAILED
    print(summary.line(), flush=True)
    return 0


COMMANDS = {"health": _health, "models": _models, "infer": _infer, "batch": _batch}


def main(argv: list[str] | None = None, prog: str = "attnserve") -> int:
    args = _parser(prog).parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        options = _client_options(args)
        return COMMANDS[args.command](args, options)
    except (UsageError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_USAGE
    except InferenceError as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_FAILED
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
