"""Errors mapped once (server.errors): the table, the INTERNAL rule, and the error tables of docs/protocol.md."""

from __future__ import annotations

import logging
import re

import grpc
import pytest
from attnserve.server import errors
from attnserve.server.batcher import BatcherClosed, BatchFailed, DeadlineExpired, QueueFull
from attnserve.server.errors import (
    _STATUS,
    BodyTooLarge,
    MalformedMessage,
    NoSuchEndpoint,
    ShuttingDown,
    Status,
    Unauthenticated,
    status_for,
)
from attnserve.server.models import ModelNotFound, ModelUnavailable
from attnserve.server.ratelimit import RateLimitedLog
from attnserve.server.shm import SharedMemoryError, SharedMemoryUnavailable

from tests.server_process import REPO_ROOT

Code = grpc.StatusCode


@pytest.fixture(autouse=True)
def fresh_log_rate(monkeypatch):
    """INTERNAL lines are rate-limited process-wide: each test here starts with the whole burst."""
    monkeypatch.setattr(errors, "CLIENT_ERRORS", RateLimitedLog())


@pytest.mark.parametrize("err, code, http", [
    (ValueError("expected last dim 512, got 3"), Code.INVALID_ARGUMENT, 400),
    (MalformedMessage(ValueError("truncated")), Code.INVALID_ARGUMENT, 400),
    (ModelNotFound("unknown model 'x'"), Code.NOT_FOUND, 404),  # a LookupError: the table's own entry wins
    (NoSuchEndpoint("no such path"), Code.UNIMPLEMENTED, 404),  # a LookupError too
    (NoSuchEndpoint("use POST", http=405), Code.UNIMPLEMENTED, 405),
    (ModelUnavailable("model m is not ready: bad graph"), Code.UNAVAILABLE, 503),  # a RuntimeError
    (QueueFull("512 requests queued"), Code.RESOURCE_EXHAUSTED, 429),
    (BodyTooLarge("body over 64 MiB"), Code.RESOURCE_EXHAUSTED, 413),
    (DeadlineExpired("deadline passed"), Code.DEADLINE_EXCEEDED, 504),
    (BatcherClosed("shutting down"), Code.UNAVAILABLE, 503),
    (ShuttingDown("server is shutting down; retry on another replica"), Code.UNAVAILABLE, 503),
    (Unauthenticated("missing or invalid bearer token"), Code.UNAUTHENTICATED, 401),
    (errors.ClientGone("the client went away"), Code.CANCELLED, 499),
    (SharedMemoryUnavailable("CUDA shared memory is not served"), Code.UNAVAILABLE, 503),
    (SharedMemoryError("region 'r' runs past its end"), Code.INVALID_ARGUMENT, 400),  # a ValueError
])
def test_each_error_gets_its_status_with_its_own_message(err, code, http, caplog):
    with caplog.at_level(logging.ERROR, logger="attnserve.server.errors"):
        assert status_for(err) == Status(code, str(err), http)
    assert not caplog.records  # only INTERNAL errors are logged here


def test_a_failed_batch_is_internal_with_its_public_message_logged_once(caplog):
    cause = RuntimeError("onnxruntime: Reshape node failed at /some/path")
    logged = BatchFailed(f"the batch failed: {cause}", public="the batch this request was in failed", logged=True)
    unlogged = BatchFailed(f"the batch failed: {cause}", public="the batch this request was in failed", logged=False)
    with caplog.at_level(logging.ERROR, logger="attnserve.server.errors"):
        assert status_for(logged) == Status(Code.INTERNAL, "the batch this request was in failed", 500)
        assert not caplog.records  # the batcher logged it, once for the batch
        assert status_for(unlogged) == Status(Code.INTERNAL, "the batch this request was in failed", 500)
        assert len(caplog.records) == 1


def test_anything_else_is_internal_without_its_text_and_logged_with_a_traceback(caplog):
    try:
        raise KeyError("/secret/path/model.onnx")
    except KeyError as err:
        with caplog.at_level(logging.ERROR, logger="attnserve.server.errors"):
            status = status_for(err)
    assert status.code == Code.INTERNAL and status.http == 500
    assert "secret" not in status.details and "KeyError" in status.details and "server log" in status.details
    (record,) = caplog.records
    assert record.exc_info is not None


def test_stream_answers_carry_the_status_as_code_colon_details():
    assert Status(Code.NOT_FOUND, "unknown model 'x'").stream_message() == "NOT_FOUND: unknown model 'x'"


PROTOCOL_PAGE = REPO_ROOT / "docs" / "protocol.md"


def test_the_documented_error_table_names_the_codes_the_server_answers():
    page = PROTOCOL_PAGE.read_text()
    table = page[page.index("## Errors"):page.index("A bad request fails alone")]
    documented = {Code[name] for name in re.findall(r"^\| `([A-Z_]+)`", table, re.M)}
    assert documented == {code for code, _http in _STATUS.values()} - {Code.UNIMPLEMENTED}  # REST only


def test_the_documented_http_table_is_the_status_table():
    """Each row of the REST table (`| gRPC | HTTP | ...`) in docs/protocol.md is a row of _STATUS, and back."""
    page = PROTOCOL_PAGE.read_text()
    table = page[page.index("## REST errors"):]
    table = table[:table.index("\n\n", table.index("|"))]
    documented = {(Code[name], int(http)) for name, http in re.findall(r"^\| `([A-Z_]+)` \| (\d{3}) \|", table, re.M)}
    assert documented == set(_STATUS.values()) | {(Code.INTERNAL, 500)}
