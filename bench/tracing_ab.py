"""Tracing's cost: the same server with traces off and on at 100 % sampling, alternating, at
concurrency 1 and 32 (docs/record/tracing.md has the figures).

    python -m bench.tracing_ab [--repository models] [--seconds 5] [--rounds 1]

"On" exports every span over OTLP/gRPC to a receiver in this process that counts and drops
them (opentelemetry-proto's TraceService), so the export's own cost is in the server's figures.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from concurrent import futures
from pathlib import Path

import grpc

from bench import loadgen
from bench.__main__ import REPO_ROOT, _Server
from bench.inprocess import Shape

MODEL, DIMS, SHAPE = "self_attention", (512, 512), Shape(1, 10, 10)


def _sink():
    from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

    class Sink(trace_service_pb2_grpc.TraceServiceServicer):
        spans = 0

        def Export(self, request, context):
            Sink.spans += sum(len(s.spans) for r in request.resource_spans for s in r.scope_spans)
            return trace_service_pb2.ExportTraceServiceResponse()

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Sink(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, port, Sink


def per_call_us(calls: int = 20000) -> dict[str, float]:
    """What recording costs on the event loop per call, in this process: a request's Call through
    its life (and its batch's span), traces off (None: skipped) and on (a span exported to a
    receiver that drops it), in microseconds of this thread's CPU per call."""
    import time

    import numpy as np
    from attnserve.server.batcher import BatchStats
    from attnserve.server.errors import OK
    from attnserve.server.tensors import Work
    from attnserve.server.tracing import Calls, Tracing
    from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

    class Drop(SpanExporter):
        def export(self, spans):
            return SpanExportResult.SUCCESS

    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    provider = TracerProvider()
    provider.add_span_processor(BatchSpanProcessor(Drop()))
    tracing = Tracing(provider, "Drop")
    work = Work(np.zeros((1, 10, 512), np.float32), np.zeros((1, 10, 512), np.float32),
                np.zeros((1, 10, 512), np.float32), None, False)
    stats = BatchStats(requests=1, rows=1, padding_ratio=0.0, compute_s=0.0005, queue_s=(0.0,), failed=False)
    batch = tracing.batch_tracer("self_attention", 1, None)
    headers = {"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"}
    out = {}
    for name, calls_ in (("off", Calls(None, False)), ("on", Calls(tracing, False))):
        started = time.thread_time()  # this thread's CPU: the event loop's share, whatever else runs
        for _ in range(calls):
            call = calls_.begin("grpc", "ModelInfer", "ipv4:127.0.0.1:1", headers, 20000) if calls_.on else None
            if call is not None:
                call.request("self_attention", "", "r")
                call.decoded(work)
                batch.batch_done(stats, [(work, call.span)])
                call.computed(0.0001, 0.0005, 1, 1)
                call.encoded()
                call.finish(OK, 20000)
        out[name] = (time.thread_time() - started) / calls * 1e6
    provider.shutdown()
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.tracing_ab", description=__doc__.split("\n\n")[0])
    p.add_argument("--repository", type=Path, default=REPO_ROOT / "models")
    p.add_argument("--seconds", type=float, default=5.0)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--concurrency", default="1,32")
    p.add_argument("--per-call-only", action="store_true", help="only the in-process cost per call")
    args = p.parse_args(argv)
    if args.per_call_only:
        cost = per_call_us()
        print(f"recording per call, on the event loop: off {cost['off']:.2f} us, on {cost['on']:.1f} us")
        return 0
    sink, port, counter = _sink()
    on = {"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{port}",
          "OTEL_EXPORTER_OTLP_INSECURE": "true", "OTEL_TRACES_SAMPLER": "always_on"}
    rows = []
    with tempfile.TemporaryDirectory() as workdir:
        for round_ in range(args.rounds):
            for mode in ("off", "on"):
                saved = {k: os.environ.pop(k) for k in list(os.environ) if k.startswith("OTEL_")}
                if mode == "on":
                    os.environ.update(on)
                try:
                    serverdir = Path(workdir) / f"{round_}-{mode}"  # its own ready file
                    serverdir.mkdir()
                    server = _Server(args.repository, [], serverdir)
                finally:
                    for k in on:
                        os.environ.pop(k, None)
                    os.environ.update(saved)
                try:
                    for c in (int(x) for x in args.concurrency.split(",")):
                        got = loadgen.run(server.address, MODEL, DIMS, SHAPE, c, args.seconds)
                        rows.append((round_, mode, c, got))
                        print(f"round {round_} tracing {mode:3} c={c:<3} {got['requests_per_s']:8.0f} req/s  "
                              f"p50 {got['p50_ms']:.2f} ms  p99 {got['p99_ms']:.2f} ms  errors {got['errors']}  "
                              f"load {open('/proc/loadavg').read().split()[0]}", flush=True)
                finally:
                    server.stop()
    print(f"spans received: {counter.spans}")
    cost = per_call_us()
    print(f"recording per call, on the event loop: off {cost['off']:.2f} us, on {cost['on']:.1f} us "
          f"(request span with 4 events and its batch's span)")
    sink.stop(None)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
