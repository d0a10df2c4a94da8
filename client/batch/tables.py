"""Parquet and Arrow tables of items: one row per item, tensors as fixed-shape tensor columns.

    columns = read_parquet(Path("in.parquet"))        # {"id": (n,), "query": (n, lq, d), ...}
    write_parquet(Path("out.parquet"), {"id": ids, "output": output}, job_key="...")

Input columns: `query` (lq, query_dim), `key` and `value` (lk, kv_dim), optionally `mask`
(lq, lk) bool or 0/1 (written as uint8), and `id` (int64 or string): the item's id, carried to the output (the
row number when absent). Tensor columns are read as Arrow's canonical fixed-shape tensor
(`arrow.fixed_shape_tensor`, what `write_parquet` writes), nested fixed-size lists, nested lists
of one shape, or Ray Data's tensor extension; they are written as fixed-shape tensors. pyarrow
is the optional extra `attnserve[parquet]`: .npz jobs never import it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from attnserve.contract import ITEM_ID
from attnserve.files import write_atomic

SUFFIX = ".parquet"
TENSOR_COLUMNS = ("query", "key", "value", "mask")
# The schema metadata key holding the job's key (a finished output, as .npz's zip comment).
JOB_KEY = b"attnserve.batch.key"


def is_table(path: Path) -> bool:
    return path.suffix == SUFFIX


def pyarrow() -> Any:
    """pyarrow, or an ImportError that says how to install it."""
    try:
        import pyarrow as pa
        import pyarrow.parquet  # noqa: F401  (pa.parquet below)
    except ImportError:
        raise ImportError("Parquet input and output need pyarrow: pip install 'attnserve[parquet]'") from None
    return pa


def tensor_array(array: np.ndarray) -> Any:
    """(n, *shape) as Arrow's fixed-shape tensor column of n rows."""
    pa = pyarrow()
    array = np.ascontiguousarray(array)
    if array.dtype == np.bool_:  # Arrow's tensors take no bool: a mask is stored as 0/1 uint8
        array = array.view(np.uint8)
    if array.ndim == 1:
        return pa.array(array)
    return pa.FixedShapeTensorArray.from_numpy_ndarray(array)


def column_to_numpy(column: Any) -> np.ndarray:
    """An Arrow column (array or chunked) of tensors as one (n, *shape) array; a plain column as (n,)."""
    pa = pyarrow()
    if isinstance(column, pa.ChunkedArray):
        column = column.combine_chunks() if column.num_chunks != 1 else column.chunk(0)
    kind = column.type
    if isinstance(kind, pa.FixedShapeTensorType):
        return column.to_numpy_ndarray()
    if isinstance(kind, pa.ExtensionType):
        to_numpy = getattr(column, "to_numpy", None)  # Ray Data's ArrowTensorArray
        if to_numpy is not None:
            return np.asarray(to_numpy())
        column = column.storage
        kind = column.type
    if pa.types.is_fixed_size_list(kind) or pa.types.is_list(kind) or pa.types.is_large_list(kind):
        rows = column.to_pylist()
        try:
            return np.asarray(rows)
        except ValueError:
            raise ValueError("a tensor column's rows differ in shape; every item needs one lq, lk and width "
                             "(split the table by length)") from None
    return column.to_numpy(zero_copy_only=False)


def read_parquet(path: Path, columns: tuple[str, ...] | None = None) -> dict[str, np.ndarray]:
    """The named columns (default: every column) of a Parquet file, as numpy arrays."""
    pa = pyarrow()
    table = pa.parquet.read_table(path, columns=list(columns) if columns else None)
    for name in table.column_names:
        column = table.column(name)
        if column.null_count:  # numpy would make it an object array, or fail on a ragged one
            first = column.is_null().to_numpy(zero_copy_only=False).argmax()
            raise ValueError(f"column {name!r} has {column.null_count} null rows, the first row {first}; "
                             "every item needs a value in every column")
    return {name: column_to_numpy(table.column(name)) for name in table.column_names}


def describe_parquet(path: Path) -> tuple[int, dict[str, tuple[int, ...]], list[str]]:
    """Rows, each tensor column's per-item shape, and the column names, read from the file's
    schema and first row (no other row is read)."""
    pa = pyarrow()
    parquet = pa.parquet.ParquetFile(path)
    schema = parquet.schema_arrow
    rows = parquet.metadata.num_rows
    shapes: dict[str, tuple[int, ...]] = {}
    first = None
    for name in TENSOR_COLUMNS:
        if name not in schema.names:
            continue
        kind = schema.field(name).type
        if isinstance(kind, pa.FixedShapeTensorType):
            shapes[name] = tuple(kind.shape)
            continue
        if first is None and rows:
            first = next(parquet.iter_batches(batch_size=1))
        shapes[name] = column_to_numpy(first.column(name)).shape[1:] if first is not None else ()
    return rows, shapes, list(schema.names)


def write_parquet(path: Path, columns: dict[str, np.ndarray], job_key: str = "") -> None:
    """One Parquet file, atomically (attnserve.files.write_atomic); `job_key` goes into its
    schema metadata (`read_job_key`)."""
    pa = pyarrow()
    table = pa.table({name: tensor_array(array) for name, array in columns.items()})
    if job_key:
        table = table.replace_schema_metadata({**(table.schema.metadata or {}), JOB_KEY: job_key.encode()})
    write_atomic(path, lambda f: pa.parquet.write_table(table, f))


def read_job_key(path: Path) -> bytes | None:
    """The job key a finished Parquet output carries; None when absent or unreadable."""
    try:
        pa = pyarrow()
        metadata = pa.parquet.read_schema(path).metadata or {}
    except Exception:  # not there, not Parquet, pyarrow missing: not a finished output
        return None
    return metadata.get(JOB_KEY)


def read_ids(path: Path) -> np.ndarray | None:
    """A table's id column alone, or None when it has none."""
    pa = pyarrow()
    if ITEM_ID not in pa.parquet.read_schema(path).names:
        return None
    return read_parquet(path, columns=(ITEM_ID,))[ITEM_ID]
