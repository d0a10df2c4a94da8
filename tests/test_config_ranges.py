"""Every numeric flag and its ATTNSERVE_* variable is checked once, against the range the server
really takes (server.config.FLAG_RANGES: gRPC's int32 options, the native plane's int64 and its
longest timer, socket backlogs, threads): NaN, infinity (except where it means never), 1e30, a
negative value and an integer beyond int64 each exit 2 naming the flag (or the variable) and its
range, before anything starts. A --ready-file that cannot be written is refused the same way."""

from __future__ import annotations

import dataclasses
import math
import re
import typing
from pathlib import Path

import pytest
from attnserve.server.config import (
    FLAG_RANGES,
    ServerConfig,
    env_name,
    flag_name,
    load_config,
)

from attnserve.ranges import INT32_MAX, MAX_WAIT_S

DOCS = Path(__file__).resolve().parent.parent / "docs" / "server.md"
BAD = ("nan", "NaN", "inf", "-inf", "1e30", "-5", str(10**30), str(2**63))
NEVER = sorted(name for name, allowed in FLAG_RANGES.items() if allowed.never)


def _refused(argv, env, capsys) -> str:
    with pytest.raises(SystemExit) as exc:
        load_config(argv, env)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err.strip().splitlines()[-1]


def test_every_numeric_setting_has_a_range():
    hints = typing.get_type_hints(ServerConfig)
    numeric = {f.name for f in dataclasses.fields(ServerConfig)
               if {int, float} & set(typing.get_args(hints[f.name]) or (hints[f.name],))}
    assert numeric == set(FLAG_RANGES)


@pytest.mark.parametrize("name", sorted(FLAG_RANGES))
def test_each_flag_refuses_what_the_server_cannot_take_naming_itself_and_its_range(name, capsys):
    allowed = FLAG_RANGES[name]
    for text in BAD:
        if allowed.never and text == "inf":
            continue
        line = _refused([f"{flag_name(name)}={text}"], {}, capsys)  # "=": argparse reads "-5" alone as a flag
        if allowed.integer and not re.fullmatch(r"-?\d+", text):
            assert f"argument {flag_name(name)}: invalid int value" in line, (text, line)  # argparse's own words
        else:
            assert f"{flag_name(name)} must be {allowed.describe()}, got" in line, (text, line)
        line = _refused([], {env_name(name): text}, capsys)
        assert env_name(name) in line, (text, line)


@pytest.mark.parametrize("name", sorted(FLAG_RANGES))
def test_each_flag_takes_its_bounds_and_refuses_just_past_them(name, capsys):
    allowed = FLAG_RANGES[name]
    for bound, is_open in ((allowed.low, allowed.low_open), (allowed.high, allowed.high_open)):
        if not is_open:
            assert getattr(load_config([f"{flag_name(name)}={bound}"], {}), name) == bound
    if allowed.integer:
        for past in (allowed.low - 1, allowed.high + 1):
            _refused([f"{flag_name(name)}={past}"], {}, capsys)
    else:
        for past in (math.nextafter(allowed.high, math.inf), allowed.high * 2):
            _refused([flag_name(name), repr(past)], {}, capsys)


@pytest.mark.parametrize("name", NEVER)
def test_infinity_means_never_only_where_the_flag_says_so(name):
    assert getattr(load_config([flag_name(name), "inf"], {}), name) is None
    assert getattr(load_config([], {env_name(name): "inf"}), name) is None


def test_the_two_drain_flags_agree_about_infinity_and_nan(capsys):
    for name in ("--drain-delay-s", "--grace-period-s"):
        for text in ("inf", "nan", str(MAX_WAIT_S * 2)):
            assert name in _refused([name, text], {}, capsys)


def test_grpc_sizes_stop_at_int32(capsys):
    """gRPC's channel arguments and the native plane's Start take a C int."""
    for name in ("--max-message-bytes", "--max-concurrent-streams", "--max-http-connections"):
        assert load_config([name, str(INT32_MAX)], {})
        assert f"{name} must be an integer in 1..{INT32_MAX}" in _refused([name, str(INT32_MAX + 1)], {}, capsys)


def test_grpc_times_of_under_a_millisecond_are_refused_not_rounded_to_zero(capsys):
    assert "--grpc-keepalive-time-s must be a number in [0.001, " in _refused(
        ["--grpc-keepalive-time-s", "0.0001"], {}, capsys)


def test_a_config_built_directly_is_checked_too():
    with pytest.raises(ValueError, match=r"max_queue_delay_ms must be a number in \[0, "):
        ServerConfig(max_queue_delay_ms=math.nan)
    with pytest.raises(ValueError, match="workers must be an integer in 1..1024"):
        ServerConfig(workers=True)
    assert ServerConfig(grpc_max_connection_age_s=math.inf).grpc_max_connection_age_s is None


@pytest.mark.parametrize("where, says", [
    ("directory", "not a regular file (a directory)"),
    ("proc", "cannot write a file in /proc"),
    ("under_a_file", "Not a directory"),
])
def test_a_ready_file_that_cannot_be_written_is_refused_naming_the_flag(tmp_path, where, says, capsys):
    (tmp_path / "file").write_text("x")
    path = {"directory": tmp_path, "proc": Path("/proc/attnserve-ready.json"),
            "under_a_file": tmp_path / "file" / "ready.json"}[where]
    line = _refused(["--ready-file", str(path)], {}, capsys)
    assert f"--ready-file {path}: {says}" in line, line
    assert not list(tmp_path.glob(".*.tmp"))


def test_a_ready_file_in_directories_still_to_be_made_is_taken(tmp_path):
    path = tmp_path / "a" / "b" / "ready.json"
    assert load_config(["--ready-file", str(path)], {}).ready_file == path
    assert not (tmp_path / "a").exists() and not list(tmp_path.iterdir())


def test_the_docs_give_every_flags_range():
    text = DOCS.read_text()
    for name, allowed in FLAG_RANGES.items():
        assert f"| `{flag_name(name)}` | {allowed.describe()} |" in text, name
