"""MkDocs hooks: the package tree for mkdocstrings, and the CLI's help in the pages.

- `<!-- attnserve-help: ARGS -->` in a page becomes `attnserve ARGS`'s output, run from the
  installed command when the site is built, so the page cannot drift from the code; a command
  that fails stops the build.
- The repository's folders are installed as `attnserve.<folder>` (pyproject.toml's package-dir),
  so `attnserve/client/` does not exist on disk: build/docs-packages/attnserve/ is made of links
  that lay the tree out as installed, for mkdocstrings to read statically.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path

from mkdocs.plugins import event_priority

_MARKER = re.compile(r"<!-- attnserve-help: (?P<args>[^>]*?) -->")


def _help(args: str) -> str:
    env = {**os.environ, "COLUMNS": "100"}
    done = subprocess.run([sys.executable, "-m", "attnserve", *shlex.split(args)], capture_output=True,
                          text=True, timeout=120, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"attnserve {args} exited {done.returncode}: {done.stderr.strip()}")
    return f"```text\n$ attnserve {args}\n{done.stdout.rstrip()}\n```"


@event_priority(100)  # before mkdocstrings reads its `paths`
def on_config(config, **kwargs):
    root = Path(config["config_file_path"]).parent
    package_dir = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    tree = root / "build" / "docs-packages"
    top = tree / "attnserve"
    if top.exists():  # only links inside: unlink them, never what they point to
        for link in top.iterdir():
            link.unlink()
    top.mkdir(parents=True, exist_ok=True)
    for entry in (root / package_dir["attnserve"]).iterdir():
        (top / entry.name).symlink_to(entry.resolve())
    for name, folder in package_dir.items():
        if name != "attnserve":
            (top / name.removeprefix("attnserve.")).symlink_to((root / folder).resolve())
    return config


def on_page_markdown(markdown: str, **kwargs) -> str:
    return _MARKER.sub(lambda m: _help(m.group("args")), markdown)
