"""Print pyproject.toml's run-time dependencies pinned to their lower bounds, one `name==floor` a line.

`make test-deps-oldest` installs with these as pip constraints, so the floors it tests are the
ones declared, not a second copy of them. A dependency without a `>=` floor is an error (exit 1):
it would go untested.
"""

from __future__ import annotations

import re
import sys
import tomllib
from pathlib import Path

PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"
_REQUIREMENT = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*(?:\[[^\]]*\])?\s*(.*?)\s*(?:;.*)?$")


def lower_bounds(dependencies: list[str]) -> list[str]:
    pins = []
    for requirement in dependencies:
        match = _REQUIREMENT.match(requirement)
        floors = re.findall(r">=\s*([0-9][A-Za-z0-9.]*)", match.group(2)) if match else []
        if len(floors) != 1:
            raise ValueError(f"{PYPROJECT.name}: {requirement!r} needs exactly one `>=` lower bound, got {floors}")
        pins.append(f"{match.group(1)}=={floors[0]}")
    return pins


def main() -> int:
    dependencies = tomllib.loads(PYPROJECT.read_text(encoding="utf-8"))["project"]["dependencies"]
    try:
        pins = lower_bounds(dependencies)
    except ValueError as err:
        print(err, file=sys.stderr)
        return 1
    print("\n".join(pins))
    return 0


if __name__ == "__main__":
    sys.exit(main())
