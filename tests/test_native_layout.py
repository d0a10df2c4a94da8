"""The native data plane's layout (docs/design.md, "Module map"): the core under native/core knows
no transport, and no source file grows past 1,000 lines."""

from __future__ import annotations

import re

from tests.server_process import REPO_ROOT

NATIVE = REPO_ROOT / "native"
SOURCES = sorted(p for p in NATIVE.rglob("*") if p.suffix in {".cc", ".h"})
CORE = [p for p in SOURCES if p.parent == NATIVE / "core"]


def _code(path) -> str:
    return re.sub(r"//[^\n]*", "", path.read_text())  # prose may name the protocol; code may not use a stack


def test_the_core_uses_no_transport():
    transport = re.compile(r"grpc|nghttp2|#include\s*<(?:sys/socket|netinet/|arpa/|openssl/)", re.IGNORECASE)
    used = {str(p.relative_to(REPO_ROOT)): m.group(0) for p in CORE if (m := transport.search(_code(p)))}
    assert CORE and not used


def test_cmake_links_the_core_with_protobuf_alone():
    cmake = (NATIVE / "CMakeLists.txt").read_text()
    links = re.findall(r"target_link_libraries\(attnserve_core\s+PUBLIC\s+([^)]*)\)", cmake)
    assert links == ["PkgConfig::PROTOBUF"]
    core_sources = re.search(r"add_library\(attnserve_core STATIC([^)]*)\)", cmake).group(1).split()
    assert sorted(s for s in core_sources if s.startswith("core/")) == sorted(
        str(p.relative_to(NATIVE)) for p in CORE if p.suffix == ".cc")


def test_no_source_file_passes_1000_lines():
    long = {str(p.relative_to(REPO_ROOT)): n for p in SOURCES if (n := len(p.read_text().splitlines())) > 1000}
    assert SOURCES and not long
