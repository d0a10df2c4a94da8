"""The work directory's manifest: which job its parts belong to, and the model version pinned.

Written once when the job starts and once more when the first response names the served
version (`pinned`: a new value, not an edit), always whole (`attnserve.files`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from attnserve.client.batch.fingerprint import Fingerprint, field_of


@dataclass(frozen=True, slots=True)
class Manifest:
    key: str  # fingerprint.key, kept so a reader need not recompute it
    fingerprint: Fingerprint
    items: int  # in the whole input
    batch_size: int  # of the run that started the job (a rerun may use another)
    served_version: str | None = None  # None until the first response: then every request pins it

    @classmethod
    def start(cls, fingerprint: Fingerprint, items: int, batch_size: int) -> Manifest:
        return cls(fingerprint.key, fingerprint, items, batch_size)

    @property
    def pinned(self) -> bool:
        return self.served_version is not None

    def pin(self, served_version: str) -> Manifest:
        return dataclasses.replace(self, served_version=served_version)

    def to_json(self) -> dict[str, Any]:
        data = {"key": self.key, **self.fingerprint.to_json(), "items": self.items, "batch_size": self.batch_size}
        if self.served_version is not None:
            data["served_version"] = self.served_version
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Manifest:
        """ValueError naming the field when `data` is not a manifest this code wrote."""
        served = data.get("served_version")
        if served is not None and not isinstance(served, str):
            raise ValueError(f"field 'served_version': expected str, got {served!r}")
        return cls(key=field_of(data, "key", str), fingerprint=Fingerprint.from_json(data),
                   items=field_of(data, "items", int), batch_size=field_of(data, "batch_size", int),
                   served_version=served)
