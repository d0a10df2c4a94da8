"""The input: one .npz or .parquet, or a directory of them in sorted name order, items numbered
globally across them, each shard checked from its headers alone (no array is read here).

Per item: query (lq, query_dim), key and value (lk, kv_dim), optionally mask (lq, lk); a
Parquet shard's rows are items (client.batch.tables), with an optional `id` column.
`take_share` cuts the items to one process's share of `--shard i/n`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from attnserve.client import npzio
from attnserve.client.batch import tables
from attnserve.client.batch.spec import BatchError
from attnserve.client.paths import check_input_file

SUFFIXES = (".npz", tables.SUFFIX)


@dataclass(frozen=True)
class Shard:
    path: Path
    offset: int  # global index of its first item
    count: int
    has_mask: bool
    first_row: int = 0  # its first item's row in the file (a share of `--shard` may start mid-file)

    @property
    def is_table(self) -> bool:
        return tables.is_table(self.path)


@dataclass(frozen=True)
class ItemShape:
    """Per-item sizes, the same in every shard: query (lq, query_dim), key/value (lk, kv_dim)."""

    lq: int
    lk: int
    query_dim: int
    kv_dim: int


def is_shard_name(path: Path) -> bool:
    """A name an input directory's listing takes as a shard (hidden names are temporaries)."""
    return path.suffix in SUFFIXES and not path.name.startswith(".")


def _shard_paths(input_path: Path) -> list[Path]:
    if input_path.is_dir():
        paths = sorted(p for p in input_path.iterdir() if is_shard_name(p))
        if not paths:
            raise BatchError(f"input directory {input_path} holds no .npz or .parquet shards")
    else:
        paths = [input_path]
    for path in paths:  # a shard skipped would drop its items silently; a FIFO would block the read
        try:
            check_input_file(path, "input")
        except ValueError as err:
            raise BatchError(str(err)) from None
    return paths


def _describe_table(path: Path) -> tuple[int, ItemShape, bool]:
    """A Parquet shard's item count and item shape, from its schema (and first row)."""
    n, shapes, names = tables.describe_parquet(path)
    missing = [name for name in ("query", "key", "value") if name not in names]
    if missing:
        raise BatchError(f"{path}: missing columns {missing}; expected query, key, value and optionally mask "
                         f"and id, got {names}")
    for name in ("query", "key", "value"):
        if len(shapes[name]) != 2:
            raise BatchError(f"{path}: each item's {name} must be (length, width), got shape {shapes[name]}")
    if shapes["key"] != shapes["value"]:
        raise BatchError(f"{path}: expected key and value of one shape (lk, kv_dim), got {shapes['key']} "
                         f"and {shapes['value']}")
    (lq, query_dim), (lk, kv_dim) = shapes["query"], shapes["key"]
    shape = ItemShape(lq=lq, lk=lk, query_dim=query_dim, kv_dim=kv_dim)
    if "mask" in shapes and shapes["mask"] != (lq, lk):
        raise BatchError(f"{path}: each item's mask must be (lq, lk)={(lq, lk)}, got {shapes['mask']}")
    return n, shape, "mask" in shapes


def _describe(path: Path) -> tuple[int, ItemShape, bool]:
    """A shard's item count and item shape, checked from its headers alone."""
    if tables.is_table(path):
        return _describe_table(path)
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
        except ImportError as err:  # a .parquet without pyarrow
            raise BatchError(f"{path}: {err}") from None
        except Exception as err:  # zipfile.BadZipFile, a truncated .npy header, ...: name the file
            raise BatchError(f"{path}: not a readable {path.suffix} ({type(err).__name__}: {err})") from None
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


def take_share(shards: list[Shard], index: int, count: int) -> tuple[list[Shard], int]:
    """Share `index` of `count` (`--shard index/count`): the contiguous items
    [total*index//count, total*(index+1)//count), renumbered from 0, and the global number of the
    first. n processes given 0/n .. n-1/n cover the input once, in order."""
    total = total_items(shards)
    lo, hi = total * index // count, total * (index + 1) // count
    share: list[Shard] = []
    for shard in shards:
        start, stop = max(lo, shard.offset), min(hi, shard.offset + shard.count)
        if start < stop:
            share.append(Shard(shard.path, start - lo, stop - start, shard.has_mask,
                               shard.first_row + start - shard.offset))
    if not share:
        raise BatchError(f"--shard {index}/{count}: the input's {total} items leave this share empty; "
                         f"use at most {total} shards")
    return share, lo
