"""Version names: a request's version and a repository's version directories mean Triton's int64
versions, in ASCII digits; nothing else names one (before: "²" passed str.isdigit and failed
int(), "01" and "1" both claimed version 1, and a version past int64 was written and read)."""

from __future__ import annotations

import pytest
from attnserve.export.onnx_export import next_version

from attnserve.contract import GRAPH_ALL_OUTPUTS, MAX_VERSION, parse_version, versions


@pytest.mark.parametrize(("text", "expected"), [
    ("1", 1), ("01", 1), ("42", 42), (str(MAX_VERSION), MAX_VERSION), ("0" * 30 + "7", 7),
    ("0", None), ("", None), ("-1", None), (" 1", None), ("1 ", None), ("+1", None), ("1e3", None),
    ("²", None), ("١", None), ("１", None), (str(MAX_VERSION + 1), None), ("9" * 400, None),
])
def test_parse_version(text, expected):
    assert parse_version(text) == expected


def test_only_canonical_version_directories_are_versions(tmp_path):
    for name in ("1", "3", "01", "0", "١", "²", str(MAX_VERSION + 1), "x2"):
        (tmp_path / name).mkdir()
        (tmp_path / name / GRAPH_ALL_OUTPUTS).write_bytes(b"")
    (tmp_path / "5").write_bytes(b"a file, not a version")
    (tmp_path / "7").mkdir()  # incomplete: no graph
    assert versions(tmp_path) == [1, 3]
    assert next_version(tmp_path) == 8  # an incomplete version's number is never reused
