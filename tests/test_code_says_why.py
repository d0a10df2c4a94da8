"""The code states the why in a line; evidence lives in docs/ and bench/results/.

Figures measured on one machine (a speed-up, a number of rounds, a CPU model, a load average, a
time or size said to be measured) go stale with the next machine: none in server/, client/,
export/ or attnserve/, comments and docstrings included. Module docstrings stay short, and
nothing that only history explains stays behind.
"""

from __future__ import annotations

import ast
import re

import pytest

from tests.server_process import REPO_ROOT

CODE_FOLDERS = ("server", "client", "export", "attnserve")
MAX_MODULE_DOCSTRING_LINES = 27  # about 25: role, a usage block, one line of why per mechanism

MACHINE_FIGURES = re.compile(
    r"(?<![\w.])(?:[1-9]\d*|0)(?:\.\d+)?x(?![\w{])"  # a ratio: 1.17x, 0.87x (not the hex 0x1F)
    r"|\b\d+ (?:alternating )?rounds\b"  # how often it was run
    r"|\b(?:EPYC|Xeon|Ryzen|Threadripper)\b"  # which machine
    r"|\bload average\b|\bload \d"  # how busy it was
    r"|\bmeasured\b[^\n]*\d+(?:\.\d+)? ?(?:ms\b|µs\b|us\b|s\b|MB\b|MiB\b|%)"  # said to be measured
    r"|\d+(?:\.\d+)? ?(?:ms\b|µs\b|us\b|MB\b|%)[^\n]*\bmeasured\b"
    r"|\d+(?:\.\d+)? ?(?:ms|µs|us) (?:per|a) (?:MiB|MB)\b",  # a rate on this machine
    re.I,
)


def _sources():
    for folder in CODE_FOLDERS:
        for path in sorted((REPO_ROOT / folder).rglob("*.py")):
            if not path.name.endswith(("_pb2.py", "_pb2_grpc.py")):
                yield path


def test_the_pattern_catches_what_it_is_for():
    for line in ("# 1.17x the throughput", "paired 0.98x", "(4 rounds, p50 2.30 ms)", "a 2-core AMD EPYC VM",
                 "load average 2.7", "measured here: 0.4-0.7 ms runs", "about 3 ms per MiB",
                 "+9 % measured at concurrency 32"):
        assert MACHINE_FIGURES.search(line), line
    for line in ("raise ValueError(f'byte 0x{b:02X}')", "MAX_BYTES = 64 << 20  # 64 MiB, gRPC's default x 16",
                 "# a (b, h, lq, lk) mask", "timeout_s: float = 5.0  # seconds"):
        assert not MACHINE_FIGURES.search(line), line


@pytest.mark.parametrize("path", list(_sources()), ids=lambda p: str(p.relative_to(REPO_ROOT)))
def test_no_machine_figures_in_code(path):
    found = [f"{path.relative_to(REPO_ROOT)}:{n}: {line.strip()}"
             for n, line in enumerate(path.read_text().splitlines(), 1) if MACHINE_FIGURES.search(line)]
    assert not found, "figures measured on a machine belong in docs/record/ (the record of runs):\n" + \
        "\n".join(found)


@pytest.mark.parametrize("path", list(_sources()), ids=lambda p: str(p.relative_to(REPO_ROOT)))
def test_module_docstrings_are_short(path):
    docstring = ast.get_docstring(ast.parse(path.read_text()), clean=False) or ""
    lines = len(docstring.strip("\n").splitlines())
    assert lines <= MAX_MODULE_DOCSTRING_LINES, f"{lines} lines: the rest belongs in docs/design.md"


def test_nothing_only_history_explains():
    for path in _sources():
        text = path.read_text()
        assert "LoadedModel" not in text and not re.search(r"kept for callers", text, re.I), path
        assert not re.search(r"https?://", "".join(ast.get_docstring(n) or "" for n in ast.walk(ast.parse(text))
                                                   if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef,
                                                                     ast.AsyncFunctionDef)))), \
            f"{path}: a docstring points outside the repository"
