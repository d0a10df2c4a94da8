"""Helpers for the export tests: running `attnserve export`, running the written graphs, masks."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch

from attnserve import contract

REPO_ROOT = Path(__file__).resolve().parent.parent
# One export traces two graphs and runs 32 parity cases: seconds, but a loaded machine is slow.
EXPORT_TIMEOUT_S = 180


def export_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "attnserve", "export", *args]


def run_export(*args: str, timeout: float = EXPORT_TIMEOUT_S) -> subprocess.CompletedProcess:
    """`attnserve export ARGS` from the repository root, as a user would run it."""
    return subprocess.run(export_command(*args), cwd=REPO_ROOT, capture_output=True, text=True, timeout=timeout)


def start_export(*args: str) -> subprocess.Popen:
    """Like run_export but not waiting, so independent exports share the machine's cores."""
    return subprocess.Popen(export_command(*args), cwd=REPO_ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def finish_export(proc: subprocess.Popen, timeout: float = EXPORT_TIMEOUT_S) -> subprocess.CompletedProcess:
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        stdout, stderr = proc.communicate()
        raise AssertionError(f"attnserve export ran past {timeout}s; stderr:\n{stderr}") from None
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)


def assert_one_error_line(result: subprocess.CompletedProcess, *fragments: str) -> str:
    """Exit status 2 and exactly one line on stderr, `export: error: ...`, holding each fragment."""
    assert result.returncode == 2, f"exit {result.returncode}, stderr:\n{result.stderr}"
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, f"expected one line on stderr, got:\n{result.stderr}"
    line = lines[0]
    assert line.startswith("export: error: "), line
    for fragment in fragments:
        assert fragment in line, f"{fragment!r} not in {line!r}"
    return line


def random_qkv(b: int, lq: int, lk: int, query_dim: int, kv_dim: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(b, lq, query_dim, generator=g), torch.randn(b, lk, kv_dim, generator=g),
            torch.randn(b, lk, kv_dim, generator=g))


def random_mask(b: int, lq: int, lk: int, seed: int) -> torch.Tensor:
    """(b, lq, lk) bool, True = attend: about half masked, the last query row of the last item
    fully masked (lq > 1), and the first item padded to fewer keys (lk > 1)."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(b, lq, lk, generator=g) > 0.5
    mask[:, :, 0] = True  # no row fully masked by chance: only the one below
    if lq > 1:
        mask[-1, -1, :] = False
    if lk > 1:
        mask[0, :, lk // 2:] = False
    return mask


def key_mask(b: int, lk: int, seed: int) -> torch.Tensor:
    """(b, lk) True = attend: random keys masked; item 0 padded (its last third masked) and,
    with b > 1, the last item fully masked (each of its query rows is then uniform)."""
    g = torch.Generator().manual_seed(seed)
    keep = torch.rand(b, lk, generator=g) > 0.3
    keep[0, 0] = True
    keep[0, lk - lk // 3:] = False
    if b > 1:
        keep[-1] = False
    return keep


def eager_output(module, query, key, value, keep=None) -> torch.Tensor:
    """The module itself, the key mask given as the contract's (b, lq, lk) mask."""
    mask = None if keep is None else keep[:, None, :].expand(query.shape[0], query.shape[1], key.shape[1])
    with torch.no_grad():
        return module(query, key, value, mask=mask)[0]


def ort_session(path: Path):
    import onnxruntime as ort

    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])


def ort_run(session, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
            mask: torch.Tensor | None = None) -> list[np.ndarray]:
    """Feed the served signature; the graph always takes a mask, all True when there is none."""
    if mask is None:
        mask = torch.ones(query.shape[0], query.shape[1], key.shape[1], dtype=torch.bool)
    feeds = {"query": query.numpy(), "key": key.numpy(), "value": value.numpy(), "mask": mask.numpy()}
    return session.run(None, feeds)


def max_abs(got: np.ndarray, want: torch.Tensor) -> float:
    assert got.shape == tuple(want.shape), f"shape {got.shape} != {tuple(want.shape)}"
    return float(np.max(np.abs(got - want.detach().numpy())))


def snapshot(directory: Path) -> dict[str, bytes | None]:
    """Every path under `directory` (directories as None), to prove nothing changed."""
    return {str(p.relative_to(directory)): (p.read_bytes() if p.is_file() else None)
            for p in sorted(directory.rglob("*"))}


def copy_model(repository: Path, name: str, destination: Path) -> Path:
    """A private copy of one model of a shared repository, for tests that write to it."""
    shutil.copytree(repository / name, destination / name)
    return destination


def old_layout(model_repository, name, destination):
    """A copy of one model as an export before the fused graphs wrote it: no fused or head-mask
    (nor row-chunk) files, no crossover, config.json's graphs the two unfused ones. Returns the copy's repository."""
    shutil.copytree(model_repository / name, destination / name)
    for kind in (*contract.FUSED_KINDS, *contract.HEAD_MASK_KINDS):
        (destination / name / "1" / contract.GRAPH_FILES[kind]).unlink()
    for file in contract.ROW_GRAPH_FILES.values():
        (destination / name / "1" / file).unlink(missing_ok=True)
    path = destination / name / "config.json"
    config = json.loads(path.read_text())
    del config["crossover"]
    config["graphs"] = {k: v for k, v in config["graphs"].items()
                        if k not in (*contract.FUSED_KINDS, *contract.HEAD_MASK_KINDS)}
    path.write_text(json.dumps(config))
    return destination
