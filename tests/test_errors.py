"""Errors mapped once (server.errors): the table, the INTERNAL rule, and the README's error table."""

from __future__ import annotations

import logging
import re

import grpc
import pytest

from attnserve.server.batcher import BatcherClosed, BatchFailed, DeadlineExpired, QueueFull
from attnserve.server.errors import _STATUS, MalformedMessage, ShuttingDown, Status, Unauthenticated, status_for
from attnserve.server.models import ModelNotFound, ModelUnavailable
from tests.server_process import REPO_ROOT

Code = grpc.StatusCode


@pytest.mark.parametrize("err, code", [
    (ValueError("expected last dim 512, got 3"), Code.INVALID_ARGUMENT),
    (MalformedMessage(ValueError("truncated")), Code.INVALID_ARGUMENT),
    (ModelNotFound("unknown model 'x'"), Code.NOT_FOUND),  # a LookupError: the table's own entry wins
    (ModelUnavailable("model m is not ready: bad graph"), Code.UNAVAILABLE),  # a RuntimeError
    (QueueFull("512 requests queued"), Code.RESOURCE_EXHAUSTED),
    (DeadlineExpired("deadline passed"), Code.DEADLINE_EXCEEDED),
    (BatcherClosed("shutting down"), Code.UNAVAILABLE),
    (ShuttingDown("server is shutting down; retry on another replica"), Code.UNAVAILABLE),
    (Unauthenticated("missing or invalid bearer token"), Code.UNAUTHENTICATED),
])
def test_each_error_gets_its_status_with_its_own_message(err, code, caplog):
    with caplog.at_level(logging.ERROR, logger="attnserve.server.errors"):
        assert status_for(err) == Status(code, str(err))
    assert not caplog.records  # only INTERNAL errors are logged here


def test_a_failed_batch_is_internal_with_its_public_message_logged_once(caplog):
    cause = RuntimeError("onnxruntime: Reshape node failed at /some/path")
    logged = BatchFailed(f"the batch failed: {cause}", public="the batch this request was in failed", logged=True)
    unlogged = BatchFailed(f"the batch failed: {cause}", public="the batch this request was in failed", logged=False)
    with caplog.at_level(logging.ERROR, logger="attnserve.server.errors"):
        assert status_for(logged) == Status(Code.INTERNAL, "the batch this request was in failed")
        assert not caplog.records  # the batcher logged it, once for the batch
        assert status_for(unlogged) == Status(Code.INTERNAL, "the batch this request was in failed")
        assert len(caplog.records) == 1


def test_anything_else_is_internal_without_its_text_and_logged_with_a_traceback(caplog):
    try:
        raise KeyError("/secret/path/model.onnx")
    except KeyError as err:
        with caplog.at_level(logging.ERROR, logger="attnserve.server.errors"):
            status = status_for(err)
    assert status.code == Code.INTERNAL
    assert "secret" not in status.details and "KeyError" in status.details and "server log" in status.details
    (record,) = caplog.records
    assert record.exc_info is not None


def test_stream_answers_carry_the_status_as_code_colon_details():
    assert Status(Code.NOT_FOUND, "unknown model 'x'").stream_message() == "NOT_FOUND: unknown model 'x'"


def test_the_readme_error_table_names_the_codes_the_server_answers():
    readme = (REPO_ROOT / "README.md").read_text()
    table = readme[readme.index("### Errors"):readme.index("A bad request fails alone")]
    documented = {Code[name] for name in re.findall(r"^\| `([A-Z_]+)`", table, re.M)}
    assert documented == set(_STATUS.values())
