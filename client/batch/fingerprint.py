"""What makes two runs the same job: the model, the version asked, the outputs, and the inputs'
content, sampled so that inputs larger than RAM are fingerprinted in a fraction of a second.

    fp = fingerprint(job, shards)
    fp.key  # sha256 of its JSON: the job's key
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from attnserve.client.batch.shards import Shard
from attnserve.client.batch.spec import BatchJob

FORMAT = "attnserve.batch/1"
# Files up to this size are hashed whole; larger ones by head, tail and samples.
_HASH_WHOLE_BYTES = 8 << 20
_HASH_EDGE_BYTES = 1 << 20
_HASH_SAMPLES = 64
_HASH_SAMPLE_BYTES = 64 << 10


def _sampled_sha256(path: Path) -> str:
    """sha256 of the whole file when small; else of its size, head, tail and evenly spaced samples.

    A fingerprint against mixing different inputs (regenerated data differs everywhere), not a
    proof against a single byte edited in the middle of a huge file.
    """
    size = path.stat().st_size
    digest = hashlib.sha256(str(size).encode())
    with open(path, "rb") as f:
        if size <= _HASH_WHOLE_BYTES:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
        else:
            spots = [0, size - _HASH_EDGE_BYTES]
            step = (size - _HASH_SAMPLE_BYTES) // (_HASH_SAMPLES + 1)
            for i, start in enumerate(spots + [step * (j + 1) for j in range(_HASH_SAMPLES)]):
                f.seek(start)
                digest.update(f.read(_HASH_EDGE_BYTES if i < 2 else _HASH_SAMPLE_BYTES))
    return digest.hexdigest()


def field_of(data: dict[str, Any], name: str, kind: type) -> Any:
    """`data[name]`, checked to be a `kind` (a bool is no int): reading JSON this package wrote."""
    value = data.get(name)
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise ValueError(f"field {name!r}: expected {kind.__name__}, got {value!r}")
    return value


@dataclass(frozen=True, slots=True)
class InputFile:
    file: str  # relative to the input directory (or to the input file's folder)
    items: int
    size_bytes: int
    sha256_sampled: str

    def to_json(self) -> dict[str, Any]:
        return {"file": self.file, "items": self.items, "bytes": self.size_bytes,
                "sha256_sampled": self.sha256_sampled}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> InputFile:
        return cls(field_of(data, "file", str), field_of(data, "items", int), field_of(data, "bytes", int),
                   field_of(data, "sha256_sampled", str))


@dataclass(frozen=True, slots=True)
class Fingerprint:
    model: str
    model_version: str  # as asked; empty: the server's default
    outputs: tuple[str, ...]
    inputs: tuple[InputFile, ...]
    format: str = FORMAT
    shard: str = ""  # "i/n" for one share of `--shard`; "" (every item) keeps older jobs' keys

    @property
    def key(self) -> str:
        """The job's key: in the manifest, and in the finished output's zip comment."""
        return hashlib.sha256(json.dumps(self.to_json(), sort_keys=True).encode()).hexdigest()

    def to_json(self) -> dict[str, Any]:
        data = {"format": self.format, "model": self.model, "model_version": self.model_version,
                "outputs": list(self.outputs), "inputs": [f.to_json() for f in self.inputs]}
        if self.shard:
            data["shard"] = self.shard
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Fingerprint:
        outputs, inputs = field_of(data, "outputs", list), field_of(data, "inputs", list)
        if not all(isinstance(name, str) for name in outputs) or not all(isinstance(f, dict) for f in inputs):
            raise ValueError(f"fields 'outputs' and 'inputs': expected names and objects, got {outputs!r}, {inputs!r}")
        return cls(model=field_of(data, "model", str), model_version=field_of(data, "model_version", str),
                   outputs=tuple(outputs), inputs=tuple(InputFile.from_json(f) for f in inputs),
                   format=field_of(data, "format", str),
                   shard=field_of(data, "shard", str) if "shard" in data else "")


def fingerprint(job: BatchJob, shards: list[Shard]) -> Fingerprint:
    """shards: every shard of the input (a share of `--shard` is named by job.shard)."""
    base = job.input_path if job.input_path.is_dir() else job.input_path.parent
    return Fingerprint(
        shard="" if job.shard is None else f"{job.shard[0]}/{job.shard[1]}",
        model=job.model,
        model_version=job.model_version,
        outputs=job.outputs,
        inputs=tuple(InputFile(str(s.path.relative_to(base)), s.count, s.path.stat().st_size,
                               _sampled_sha256(s.path)) for s in shards),
    )
