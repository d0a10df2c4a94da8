"""An exported model version in process: loaded and run exactly as the server runs it, no gRPC.

    predictor = AttentionPredictor("models/self_attention")        # its highest version, on CPU
    output, attn_probs = predictor.predict(query, key, value, mask, want_probs=True)
    ds.map_batches(AttentionPredictor, fn_constructor_args=("models/self_attention",),
                   batch_format="numpy", concurrency=2)             # Ray Data (docs/ray.md)

One loader and one run for the server and the batch adapters. The server's registry opens each
version through `AttentionPredictor.from_spec` and gives its batcher `run_feeds`; `predict` and
`__call__` build the Work the server's codec builds and run it through the batcher's own
`compute_batch`: merge (pad, mask), the engine (choose the graph, run), split. So an answer here
is the server's answer to the same request, graph choice included.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import numpy as np

from attnserve.contract import ITEM_ID, OUTPUT_NAMES
from attnserve.server.engine import DeviceChoice, Engine, choose_device
from attnserve.server.repository import ModelSpec, read_model_specs
from attnserve.server.tensors import RunStop, Work, compute_batch


class AttentionPredictor:
    """Every graph of one exported version, and the server's run of a batch on them.

    model_dir: a model's folder (config.json and its integer version folders); version: the one
    to load (None: the highest its version policy serves). max_batch_size: rows per run (None:
    config.json's, as the server's batcher takes them). outputs: what `__call__` returns."""

    def __init__(self, model_dir: str | Path, version: int | None = None, *, device: str = "cpu",
                 intra_op_threads: int = 0, max_batch_size: int | None = None,
                 outputs: tuple[str, ...] = ("output",)) -> None:
        spec = read_model_specs(Path(model_dir), version)[-1]
        self._init(Engine(spec, choose_device(device), intra_op_threads), max_batch_size, outputs)

    @classmethod
    def from_spec(cls, spec: ModelSpec, device: DeviceChoice, intra_op_threads: int = 0, solo: bool = False,
                  max_batch_size: int | None = None, chunk_rows: int = 0) -> AttentionPredictor:
        """The server's way in: a spec it read and the device it chose (server.models)."""
        predictor = cls.__new__(cls)
        predictor._init(Engine(spec, device, intra_op_threads, solo=solo, chunk_rows=chunk_rows), max_batch_size,
                        ("output",))
        return predictor

    def _init(self, engine: Engine, max_batch_size: int | None, outputs: tuple[str, ...]) -> None:
        unknown = [name for name in outputs if name not in OUTPUT_NAMES]
        if not outputs or unknown:
            raise ValueError(f"outputs must be names from {list(OUTPUT_NAMES)}, got {list(outputs)}")
        if max_batch_size is not None and max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        self.engine = engine
        self.spec = engine.spec
        self.max_batch_size = max_batch_size or self.spec.max_batch_size
        self.outputs = tuple(outputs)

    # -- the server's run ----------------------------------------------------------------------

    def run_feeds(self, feeds: dict[str, np.ndarray], want_probs: bool,
                  into: dict[str, np.ndarray] | None = None, stop: RunStop | None = None
                  ) -> tuple[np.ndarray, np.ndarray | None]:
        """The batcher's RunBatch: merged feeds in, (output, attn_probs or None) out; blocking.
        into: arrays the run writes its outputs into (server.tensors.compute_batch's writes_into).
        stop: its off switch (a stoppable run: server.tensors.RunStop)."""
        return self.engine.run(feeds, want_probs, into=into, stop=stop)

    @property
    def run_solo(self):
        """The batcher's run on the solo sessions, or None where the engine has none."""
        return self.engine.run_solo if self.engine.has_solo_sessions else None

    def run_works(self, works: list[Work]) -> list[tuple[np.ndarray, np.ndarray | None]]:
        """One run of validated requests merged as the batcher merges them; each one's rows back."""
        results, _padding, _timings = compute_batch(self.run_feeds, works)
        return results

    # -- arrays in, arrays out -----------------------------------------------------------------

    def predict(self, query: np.ndarray, key: np.ndarray, value: np.ndarray, mask: np.ndarray | None = None,
                want_probs: bool = False) -> tuple[np.ndarray, np.ndarray | None]:
        """query (n, lq, query_dim), key and value (n, lk, kv_dim), mask any of contract.MASK_SHAPES
        (True = attend). Runs of at most max_batch_size rows. Returns output (n, lq, out_dim) and
        attn_probs (n, heads, lq, lk) when want_probs, else None. Bad shapes: ValueError."""
        query, key, value, mask = self._checked(query, key, value, mask)
        n = query.shape[0]
        outputs, probs = [], []
        for start in range(0, n, self.max_batch_size):
            stop = min(start + self.max_batch_size, n)
            rows_mask = None if mask is None else (mask if mask.ndim == 2 else mask[start:stop])
            [(output, attn_probs)] = self.run_works(
                [Work(query[start:stop], key[start:stop], value[start:stop], rows_mask, want_probs)])
            outputs.append(output)
            probs.append(attn_probs)
        if n == 0:
            empty = np.zeros((0, query.shape[1], self.spec.out_dim), np.float32)
            return empty, (np.zeros((0, self.spec.num_heads, query.shape[1], key.shape[1]), np.float32)
                           if want_probs else None)
        return np.concatenate(outputs), (np.concatenate(probs) if want_probs else None)

    def __call__(self, batch: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """A table's batch (Ray Data's numpy format): columns query, key, value, optionally mask
        and id, one item per row, in; id (when given) and `outputs` out, rows in order. Items of
        different lengths (object columns) run in groups of one shape: padding would change a row
        whose keys are all masked (server.batcher, "Exactness")."""
        for name in ("query", "key", "value"):
            if name not in batch:
                raise ValueError(f"batch has no {name!r} column; expected query, key, value and optionally "
                                 f"mask and {ITEM_ID}, got {sorted(batch)}")
        mask = batch.get("mask")
        want_probs = "attn_probs" in self.outputs
        result = {ITEM_ID: np.asarray(batch[ITEM_ID])} if ITEM_ID in batch else {}
        if all(_regular(column) for column in (batch["query"], batch["key"], batch["value"], mask)):
            # Items of one shape (n, ...) each: one predict, no copies per item.
            output, attn_probs = self.predict(batch["query"], batch["key"], batch["value"], mask, want_probs)
            answers = {"output": output, "attn_probs": attn_probs}
            return {**result, **{name: answers[name] for name in self.outputs}}
        columns = {name: _items(batch[name]) for name in ("query", "key", "value")}
        masks = None if mask is None else _items(mask)
        n = len(columns["query"])
        groups: dict[tuple, list[int]] = {}
        for i in range(n):
            shape = (columns["query"][i].shape, columns["key"][i].shape, None if masks is None else masks[i].shape)
            groups.setdefault(shape, []).append(i)
        got: dict[str, list] = {name: [None] * n for name in self.outputs}
        for rows in groups.values():
            def pick(items: list[np.ndarray], rows: list[int] = rows) -> np.ndarray:
                return np.stack([items[i] for i in rows])  # (len(rows), ...): one shape

            output, attn_probs = self.predict(pick(columns["query"]), pick(columns["key"]), pick(columns["value"]),
                                              None if masks is None else pick(masks), want_probs)
            for j, i in enumerate(rows):
                if "output" in got:
                    got["output"][i] = output[j]
                if want_probs:
                    got["attn_probs"][i] = attn_probs[j]
        for name, items in got.items():
            result[name] = _column(items)
        return result

    def _checked(self, query, key, value, mask):
        spec = self.spec
        query, key, value = (np.ascontiguousarray(a, dtype=np.float32) for a in (query, key, value))
        if query.ndim != 3 or query.shape[2] != spec.query_dim:
            raise ValueError(f"query: expected (items, q_len, {spec.query_dim}), got {query.shape}")
        n, lq = query.shape[:2]
        if key.ndim != 3 or key.shape[0] != n or key.shape[2] != spec.kv_dim or value.shape != key.shape:
            raise ValueError(f"key and value: expected ({n}, k_len, {spec.kv_dim}) each, got key {key.shape} "
                             f"and value {value.shape}")
        lk = key.shape[1]
        if lq > spec.max_q_len or lk > spec.max_kv_len:
            raise ValueError(f"lengths: expected q_len <= {spec.max_q_len} and k_len <= {spec.max_kv_len} "
                             f"(config.json's limits), got {lq} and {lk}")
        if mask is not None:
            mask = np.asarray(mask)
            taken = ((lq, lk), (n, lq, lk), (n, 1, lq, lk), (n, spec.num_heads, lq, lk))
            if mask.shape not in taken:
                raise ValueError(f"mask: expected one of the shapes {list(taken)}, got {mask.shape}")
            if mask.dtype != np.bool_:
                if mask.dtype.kind not in "iu" or not np.isin(mask, (0, 1)).all():
                    raise ValueError(f"mask: expected bool or 0/1 integers (True = attend), got {mask.dtype}")
                mask = mask.astype(np.bool_)
        return query, key, value, mask


def _regular(column) -> bool:
    """None, or an (n, ...) array of numbers (not an object column of items of several shapes)."""
    return column is None or (isinstance(column, np.ndarray) and column.dtype != object)


def _items(column) -> list[np.ndarray]:
    """A column as one array per row: an (n, ...) array's rows, or an object column's items."""
    array = column if isinstance(column, np.ndarray) else np.asarray(column)
    if array.dtype == object:
        return [np.asarray(item) for item in array]
    return list(array)


def _column(items: list[np.ndarray]) -> np.ndarray:
    """Rows of one shape stacked (n, ...); rows that differ as an object column, in order."""
    if items and all(item.shape == items[0].shape for item in items):
        return np.stack(items)
    column = np.empty(len(items), dtype=object)
    for i, item in enumerate(items):  # one by one: a slice assignment would try to broadcast them
        column[i] = item
    return column
