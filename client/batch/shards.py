"""The input: one .npz, or a directory of .npz shards in sorted name order, items numbered
globally across them, each shard checked from its headers alone (no array is read here).

Per item: query (lq, query_dim), key and value (lk, kv_dim), optionally mask (lq, lk).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from attnserve.client import npzio
from attnserve.client.batch.spec import BatchError


@dataclass(frozen=True)
class Shard:
    path: Path
    offset: int  # global index of its first item
    count: int
    has_mask: bool


@dataclass(frozen=True)
class ItemShape:
    """Per-item sizes, the same in every shard: query (lq, query_dim), key/value (lk, kv_dim)."""

    lq: int
    lk: int
    query_dim: int
    kv_dim: int


def _shard_paths(input_path: Path) -> list[Path]:
    if input_path.is_dir():
        paths = sorted(p for p in input_path.iterdir()
                       if p.suffix == ".npz" and p.is_file() and not p.name.startswith("."))
        if not paths:
            raise BatchError(f"input directory {input_path} holds no .npz shards")
        return paths
    if not input_path.is_file():
        raise BatchError(f"input {input_path} does not exist")
    return [input_path]


def _describe(path: Path) -> tuple[int, ItemShape, bool]:
    """A shard's item count and item shape, checked from its headers alone."""
    headers = npzio.read_headers(path)
    missing = [name for name in ("query", "key", "value") if name not in headers]
    if missing:
        raise BatchError(f"{path}: missing arrays {missing}; expected query, key, value and optionally mask, "
                         f"got {sorted(headers)}")
    q, k, v = headers["query"], headers["key"], headers["value"]
    for name, info in (("query", q), ("key", k), ("value", v)):
        if len(info.shape) != 3:
            raise BatchError(f"{path}: {name} must be (items, length, width), got shape {info.shape}")
        if info.dtype.kind not in "fiu":
            raise BatchError(f"{path}: {name} must be real-valued (converted to float32), got dtype {info.dtype}")
    n = q.shape[0]
    if k.shape != v.shape or k.shape[0] != n:
        raise BatchError(f"{path}: expected key and value of shape ({n}, lk, kv_dim), got key {k.shape} "
                         f"and value {v.shape}")
    shape = ItemShape(lq=q.shape[1], lk=k.shape[1], query_dim=q.shape[2], kv_dim=k.shape[2])
    mask = headers.get("mask")
    if mask is not None:
        if mask.shape != (n, shape.lq, shape.lk):
            raise BatchError(f"{path}: mask must be (items, lq, lk)={(n, shape.lq, shape.lk)}, got {mask.shape}")
        if mask.dtype.kind not in "biu":
            raise BatchError(f"{path}: mask must be bool (True = attend) or integer 0/1, got dtype {mask.dtype}")
    return n, shape, mask is not None


def discover_shards(input_path: Path) -> tuple[list[Shard], ItemShape]:
    """The non-empty shards with their global offsets, and the item shape they all share."""
    shards: list[Shard] = []
    item_shape: ItemShape | None = None
    offset = 0
    for path in _shard_paths(input_path):
        try:
            count, shape, has_mask = _describe(path)
        except BatchError:
            raise
        except Exception as err:  # zipfile.BadZipFile, a truncated .npy header, ...: name the file
            raise BatchError(f"{path}: not a readable .npz ({type(err).__name__}: {err})") from None
        if item_shape is None:
            item_shape = shape
        elif shape != item_shape:
            raise BatchError(f"{path}: items of shape {shape} differ from the first shard's {item_shape}; "
                             "all shards need one lq, lk and width so the outputs stack")
        if count:
            shards.append(Shard(path, offset, count, has_mask))
        offset += count
    if not shards or item_shape is None:
        raise BatchError(f"input {input_path} holds no items")
    return shards, item_shape


def total_items(shards: list[Shard]) -> int:
    return shards[-1].offset + shards[-1].count
