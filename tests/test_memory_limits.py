"""server.memory.limits: the table of size bounds agrees with the code it describes (config
defaults, the constants it names, the objects that enforce each bound), so it cannot drift."""

from __future__ import annotations

import dataclasses
import importlib

import pytest
from attnserve.server.config import ServerConfig
from attnserve.server.memory.limits import LIMITS, Limit


def _resolve(dotted: str) -> object:
    """attnserve.server.<module>.<attribute...>: the longest importable module, then attributes."""
    parts = dotted.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        try:
            obj = importlib.import_module("attnserve.server." + ".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for name in parts[cut:]:
            obj = getattr(obj, name)
        return obj
    raise AssertionError(f"{dotted}: no module under attnserve.server")


CONFIG_DEFAULTS = {f.name: f.default for f in dataclasses.fields(ServerConfig)}


@pytest.mark.parametrize("limit", LIMITS, ids=lambda limit: limit.name)
def test_each_limit_matches_its_setting_constant_and_enforcer(limit: Limit):
    assert limit.setting or limit.constant, f"{limit.name}: neither a setting nor a constant holds it"
    if limit.setting is not None:
        assert limit.setting in CONFIG_DEFAULTS, f"{limit.name}: ServerConfig has no field {limit.setting}"
        if limit.default is not None:
            assert CONFIG_DEFAULTS[limit.setting] == limit.default, (
                f"{limit.name}: ServerConfig.{limit.setting} defaults to {CONFIG_DEFAULTS[limit.setting]}, "
                f"the table says {limit.default}")
    if limit.constant is not None:
        assert _resolve(limit.constant) == limit.default, (
            f"{limit.name}: {limit.constant} is {_resolve(limit.constant)}, the table says {limit.default}")
    for where in limit.enforced_by:
        assert callable(_resolve(where)), f"{limit.name}: {where} is not a function or class"


def test_every_size_setting_of_the_config_is_in_the_table():
    """A new max_* setting (or a bound-like one) cannot be added without its row."""
    sized = {name for name in CONFIG_DEFAULTS if name.startswith("max_") or name.endswith("_bytes")}
    sized -= {"max_batch_size", "max_queue_delay_ms", "max_padding_ratio"}  # batching policy, not size bounds
    in_table = {limit.setting for limit in LIMITS}
    assert sized <= in_table, f"size settings missing from server/memory/limits.py: {sorted(sized - in_table)}"
