"""Numeric keys: finite and within their stated range, the error naming key, value and range."""

import math
import typing
from dataclasses import fields

import pytest

from memcli.config import RANGES, Config, config_from_dict
from memcli.errors import ConfigError

NUMERIC_EXEMPT = {"scheduler.chunked_prefill_size"}  # a page multiple: its own check


def _numeric_keys() -> list[str]:
    keys = []
    for section in fields(Config):
        for f in fields(section.default_factory):
            args = typing.get_args(typing.get_type_hints(section.default_factory)[f.name]) or (
                typing.get_type_hints(section.default_factory)[f.name],)
            if any(a in (int, float) for a in args):
                keys.append(f"{section.name}.{f.name}")
    return keys


def _error(key: str, value) -> ConfigError:
    section, name = key.split(".")
    raw = {section: {name: value}}
    if key == "memory.kv_budget_gib":
        raw["memory"]["max_total_tokens"] = None
    with pytest.raises(ConfigError) as info:
        config_from_dict(raw)
    return info.value


def test_every_numeric_key_has_a_range():
    assert set(_numeric_keys()) - NUMERIC_EXEMPT == set(RANGES)


@pytest.mark.parametrize("key", sorted(k for k in RANGES if isinstance(RANGES[k].low, float)))
@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf, -5.0])
def test_float_keys_reject_non_finite_and_negative(key, value):
    err = _error(key, value)
    assert err.message == f"{key}: invalid value {value!r}"
    assert err.hint == f"{key} must be {RANGES[key].describe()}"


@pytest.mark.parametrize("key, value, described", [
    ("scheduler.init_new_token_ratio", 1.5, "a finite number in [0, 1]"),
    ("scheduler.min_new_token_ratio_factor", -0.1, "a finite number in [0, 1]"),
    ("scheduler.retract_decode_steps", -1, "an integer >= 0"),
    ("scheduler.new_token_ratio_decay_steps", -1, "an integer >= 0"),
    ("memory.max_total_tokens", 0, "an integer >= 1"),
    ("memory.kv_budget_gib", 0.0, "a finite number in (0, 1073741824]"),
    ("scheduler.max_new_tokens_clip", 0, "an integer >= 1"),
    ("runtime.seed", -1, "an integer in [0, 9223372036854775807]"),
])
def test_out_of_range_names_key_value_and_range(key, value, described):
    err = _error(key, value)
    assert err.message == f"{key}: invalid value {value!r}"
    assert err.hint == f"{key} must be {described}"


def test_integer_too_large_for_a_float_is_a_config_error():
    err = _error("sim.step_base_ms", 10 ** 400)
    assert err.message.startswith("sim.step_base_ms: invalid value")


def test_zero_costs_and_ratio_bounds_are_accepted():
    cfg = config_from_dict({"sim": {"step_base_ms": 0, "kv_read_ns": 0.0},
                            "scheduler": {"init_new_token_ratio": 1.0, "retract_decode_steps": 0}})
    assert cfg.sim.step_base_ms == 0.0 and cfg.scheduler.init_new_token_ratio == 1.0
