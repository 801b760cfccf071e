"""Config loading and validation, `--set` overrides, and `memcli show-config` end to end."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from memcli.cli.app import app
from memcli.config import (
    GIB,
    Config,
    ModelConfig,
    apply_overrides,
    builtin_config_text,
    config_from_dict,
    load_config,
    parse_override,
    replace,
)
from memcli.errors import ConfigError

CONFIG_DIR = Path(__file__).resolve().parents[1] / "configs"
MEMORY_KEYS = ("page_size, max_total_tokens, kv_budget_gib, max_running_requests, max_context_len,"
               " kv_pool, need_sort, debug")


def config_error(raw: dict) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        config_from_dict(raw)
    return info.value


def memory(**values) -> dict:
    return {"memory": values}


# ------------------------------------------------------------------ loading


def test_builtin_default_loads_with_dataclass_defaults():
    cfg = load_config()
    assert cfg == Config()
    assert cfg.page_size == 1
    assert cfg.pool_size == 16384
    assert cfg.req_to_token_cols == 4096 + 4
    assert cfg.model.bytes_per_token == 4 * 2 * 64 * 2 * 2


def test_default_yaml_documents_every_field():
    text = builtin_config_text()
    raw = yaml.safe_load(text)
    assert raw == Config().to_dict()
    for line in text.splitlines():
        if line.startswith(" ") and ":" in line:
            assert "#" in line, f"no comment on {line!r}"


@pytest.mark.parametrize("path", sorted(CONFIG_DIR.glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_config_loads(path):
    cfg = load_config(path)
    assert cfg.pool_size % cfg.page_size == 0
    assert cfg.pool_size >= cfg.memory.max_context_len


def test_llama_configs_size_the_pool_from_the_budget():
    big = load_config(CONFIG_DIR / "llama3-70b-h200.yaml")
    assert big.model.bytes_per_token == 80 * 8 * 128 * 2 * 2 == 320 * 1024
    assert big.memory.kv_budget_gib == 50.0 and isinstance(big.memory.kv_budget_gib, float)
    assert big.pool_size == 50 * GIB // (320 * 1024) == 163840
    small = load_config(CONFIG_DIR / "llama3-8b-h200.yaml")
    assert small.pool_size == 80 * GIB // (128 * 1024) == 655360


def test_empty_file_is_the_defaults(tmp_path):
    path = tmp_path / "empty.yaml"
    path.write_text("")
    assert load_config(path) == Config()


def test_empty_section_accepts_overrides(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("memory:\ncache:\n  kind: chunk\n")
    cfg = load_config(path, ["memory.page_size=4"])
    assert cfg.page_size == 4 and cfg.cache.kind == "chunk"


def test_file_errors_name_the_file(tmp_path):
    with pytest.raises(ConfigError, match="cannot read config"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("memory:\n  page_size: [1\n")
    with pytest.raises(ConfigError, match=r"bad\.yaml:\d+: not valid YAML"):
        load_config(bad)
    listed = tmp_path / "list.yaml"
    listed.write_text("- memory\n")
    with pytest.raises(ConfigError, match="expected a mapping of sections") as info:
        load_config(listed, ["memory.page_size=4"])
    assert "memory" in info.value.hint


# ------------------------------------------------------------------ overrides


@pytest.mark.parametrize(
    "text, value",
    [
        ("memory.page_size=16", 16),
        ("sim.step_base_ms=2.5", 2.5),
        ("memory.kv_budget_gib=null", None),
        ("memory.kv_budget_gib=", None),
        ("cache.eviction_policy=lfu", "lfu"),
        ("memory.need_sort=true", True),
        ("runtime.device=cpu", "cpu"),
        (" memory.page_size = 8", 8),
    ],
)
def test_parse_override_reads_the_value_as_yaml(text, value):
    keys, parsed = parse_override(text)
    assert keys == text.partition("=")[0].strip().split(".")
    assert parsed == value and type(parsed) is type(value)


@pytest.mark.parametrize("text", ["memory.page_size", "page_size=4", "a.b.c=1", "memory.=1", ".x=1"])
def test_parse_override_rejects_bad_keys(text):
    with pytest.raises(ConfigError) as info:
        parse_override(text)
    assert repr(text) in info.value.message


def test_overrides_apply_on_top_of_the_file_without_mutating_it():
    raw = {"memory": {"page_size": 4}}
    merged = apply_overrides(raw, ["memory.max_total_tokens=64", "cache.kind=none"])
    assert merged == {"memory": {"page_size": 4, "max_total_tokens": 64}, "cache": {"kind": "none"}}
    assert raw == {"memory": {"page_size": 4}}


def test_load_config_with_overrides():
    cfg = load_config(None, ["memory.page_size=16", "memory.max_total_tokens=null",
                             "memory.kv_budget_gib=0.5", "sim.kv_read_ns=12", "scheduler.policy=lpm"])
    assert cfg.page_size == 16
    assert cfg.memory.max_total_tokens is None
    assert cfg.pool_size == GIB // 2 // 2048 == 262144
    assert cfg.sim.kv_read_ns == 12.0 and cfg.scheduler.policy == "lpm"


def test_int_is_accepted_for_float_fields():
    cfg = load_config(None, ["sim.step_base_ms=3"])
    assert cfg.sim.step_base_ms == 3.0 and isinstance(cfg.sim.step_base_ms, float)


# ------------------------------------------------------------------ unknown keys and types


def test_unknown_key_names_the_dotted_path_and_lists_valid_keys():
    err = config_error(memory(page_sise=4))
    assert "'memory.page_sise'" in err.message
    assert err.hint == f"valid keys of memory: {MEMORY_KEYS}"


def test_unknown_key_through_set():
    with pytest.raises(ConfigError) as info:
        load_config(None, ["memory.bogus=1"])
    assert "'memory.bogus'" in info.value.message
    assert "page_size" in info.value.hint and "max_total_tokens" in info.value.hint


def test_unknown_section_lists_valid_sections():
    err = config_error({"memroy": {}})
    assert "'memroy'" in err.message
    assert err.hint == "valid sections: model, memory, cache, scheduler, sim, runtime, semantics"
    with pytest.raises(ConfigError) as info:
        load_config(None, ["memroy.page_size=4"])
    assert "memroy.page_size" in info.value.message
    assert "model, memory, cache" in info.value.hint


def test_section_must_be_a_mapping():
    err = config_error({"memory": 5})
    assert err.message.startswith("memory: expected a mapping")
    with pytest.raises(ConfigError, match="expected a mapping of sections"):
        config_from_dict([1, 2])


@pytest.mark.parametrize(
    "section, key, value, expected",
    [
        ("memory", "page_size", "16", "int"),
        ("memory", "page_size", 16.0, "int"),
        ("memory", "page_size", True, "int"),
        ("memory", "max_total_tokens", "big", "int or null"),
        ("memory", "need_sort", 1, "bool"),
        ("memory", "kv_pool", "sparse", "one of 'materialized', 'indices'"),
        ("model", "dtype", "int8", "one of 'float32', 'bfloat16'"),
        ("sim", "step_base_ms", "fast", "float"),
        ("cache", "eviction_policy", None, "one of 'lru', 'lfu', 'fifo'"),
    ],
)
def test_wrong_types_name_the_key_the_value_and_the_expected_type(section, key, value, expected):
    err = config_error({section: {key: value}})
    assert err.message == f"{section}.{key}: invalid value {value!r}"
    assert err.hint.startswith(f"{section}.{key} must be {expected}")


# ------------------------------------------------------------------ sizes


@pytest.mark.parametrize("page_size", [0, -4, 3, 12, 48])
def test_page_size_must_be_a_power_of_two(page_size):
    err = config_error(memory(page_size=page_size))
    assert err.message == f"memory.page_size: invalid value {page_size}"
    assert "power of two" in err.hint


@pytest.mark.parametrize("page_size", [1, 2, 64, 128])
def test_powers_of_two_are_accepted(page_size):
    cfg = config_from_dict({"memory": {"page_size": page_size}, "scheduler": {"chunked_prefill_size": 1024}})
    assert cfg.page_size == page_size


def test_pool_smaller_than_one_page():
    err = config_error(memory(page_size=64, max_total_tokens=40, max_context_len=32))
    assert "pool holds 40 tokens, less than one page of 64" in err.message
    assert err.message.startswith("memory.max_total_tokens")
    err = config_error({"memory": {"page_size": 16, "max_total_tokens": None, "kv_budget_gib": 1e-9}})
    assert err.message.startswith("memory.kv_budget_gib")


def test_context_longer_than_pool():
    err = config_error(memory(max_total_tokens=1000, max_context_len=2000))
    assert err.message == "memory.max_context_len: 2000 is longer than the pool (1000 tokens)"
    assert "at most 1000" in err.hint


def test_context_is_checked_against_the_rounded_pool():
    err = config_error({"memory": {"page_size": 64, "max_total_tokens": 1000, "max_context_len": 1000},
                        "scheduler": {"chunked_prefill_size": 512}})
    assert "longer than the pool (960 tokens)" in err.message


@pytest.mark.parametrize("chunk", [100, 8, 0])
def test_chunked_prefill_size_must_be_a_page_multiple(chunk):
    err = config_error({"memory": {"page_size": 16}, "scheduler": {"chunked_prefill_size": chunk}})
    assert err.message == f"scheduler.chunked_prefill_size: {chunk} is not a positive multiple of page_size 16"
    assert "multiple of 16" in err.hint


def test_chunking_can_be_disabled():
    cfg = config_from_dict({"memory": {"page_size": 16}, "scheduler": {"chunked_prefill_size": None}})
    assert cfg.scheduler.chunked_prefill_size is None


def test_pool_is_rounded_down_to_a_page_multiple():
    cfg = config_from_dict({"memory": {"page_size": 64, "max_total_tokens": 1000, "max_context_len": 512},
                            "scheduler": {"chunked_prefill_size": 512}})
    assert cfg.requested_total_tokens == 1000
    assert cfg.pool_size == 960


def test_kv_budget_becomes_tokens_through_bytes_per_token():
    raw = {
        "model": {"num_layers": 3, "num_kv_heads": 4, "head_dim": 32, "dtype": "float32"},
        "memory": {"page_size": 16, "max_total_tokens": None, "kv_budget_gib": 0.25},
    }
    cfg = config_from_dict(raw)
    bytes_per_token = 3 * 4 * 32 * 2 * 4
    assert cfg.model.bytes_per_token == bytes_per_token == 3072
    assert cfg.requested_total_tokens == GIB // 4 // bytes_per_token == 87381
    assert cfg.pool_size == 87381 // 16 * 16 == 87376


@pytest.mark.parametrize("dtype, itemsize",
                         [("float32", 4), ("bfloat16", 2), ("float16", 2), ("float8_e4m3fn", 1), ("float8_e5m2", 1)])
def test_bytes_per_token_by_dtype(dtype, itemsize):
    assert ModelConfig(num_layers=5, num_kv_heads=3, head_dim=16, dtype=dtype).bytes_per_token == 5 * 3 * 16 * 2 * itemsize


@pytest.mark.parametrize("tokens, budget", [(None, None), (4096, 1.0)])
def test_exactly_one_of_max_total_tokens_and_kv_budget(tokens, budget):
    err = config_error(memory(max_total_tokens=tokens, kv_budget_gib=budget))
    assert err.message == "memory: set exactly one of max_total_tokens and kv_budget_gib"


def test_budget_must_be_positive():
    err = config_error(memory(max_total_tokens=None, kv_budget_gib=-1))
    assert err.message == "memory.kv_budget_gib: invalid value -1.0"


@pytest.mark.parametrize(
    "raw, key",
    [
        ({"model": {"num_layers": 0}}, "model.num_layers"),
        ({"memory": {"max_running_requests": 0}}, "memory.max_running_requests"),
        ({"memory": {"max_context_len": 1}}, "memory.max_context_len"),
        ({"scheduler": {"max_prefill_tokens": 0}}, "scheduler.max_prefill_tokens"),
    ],
)
def test_other_impossible_sizes_name_the_key(raw, key):
    assert config_error(raw).message.startswith(key)


def test_replace_validates_again():
    cfg = replace(Config(), memory={"page_size": 16})
    assert cfg.page_size == 16 and Config().page_size == 1
    with pytest.raises(ConfigError, match="memory.page_size"):
        replace(cfg, memory={"page_size": 3})


def test_config_is_frozen():
    cfg = Config()
    with pytest.raises(AttributeError):
        cfg.memory.page_size = 4  # type: ignore[misc]


# ------------------------------------------------------------------ memcli show-config

runner = CliRunner()


def show_config(*args, **kwargs):
    return runner.invoke(app, ["show-config", *args], env={"NO_COLOR": "1"}, **kwargs)


def test_show_config_default():
    result = show_config()
    assert result.exit_code == 0, result.stderr
    assert "page_size" in result.stdout and "pool_size" in result.stdout
    assert "16,384" in result.stdout
    assert result.stderr == ""


def test_show_config_json_is_one_document():
    result = show_config("--json", "--set", "memory.page_size=64", "--set", "memory.max_total_tokens=1000",
                         "--set", "memory.max_context_len=512", "--set", "scheduler.chunked_prefill_size=512")
    assert result.exit_code == 0, result.stderr
    doc = json.loads(result.stdout)
    assert doc["config"]["memory"]["page_size"] == 64
    assert doc["derived"]["pool_size"] == 960
    assert doc["derived"]["requested_total_tokens"] == 1000
    assert doc["derived"]["num_pages"] == 15
    assert doc["derived"]["kv_pool_bytes"] == (960 + 64) * 2048
    assert result.stderr == ""


def test_show_config_reads_a_file():
    result = show_config("--config", str(CONFIG_DIR / "llama3-8b-h200.yaml"), "--json")
    assert result.exit_code == 0, result.stderr
    assert json.loads(result.stdout)["derived"]["pool_size"] == 655360


@pytest.mark.parametrize(
    "override, message",
    [
        ("memory.page_size=3", "memory.page_size: invalid value 3"),
        ("memory.bogus=1", "unknown config key 'memory.bogus'"),
        ("memory.page_size", "expected key.path=value"),
        ("memory.page_size=abc", "memory.page_size: invalid value 'abc'"),
    ],
)
def test_show_config_bad_set_exits_2_with_error_and_hint(override, message, monkeypatch):
    monkeypatch.delenv("MEMCLI_DEBUG", raising=False)
    result = show_config("--set", override, "--json")
    assert result.exit_code == 2
    lines = result.stderr.splitlines()
    assert lines[0].startswith("error: ") and message in lines[0]
    assert len(lines) == 2 and lines[1].startswith("hint: ")
    assert "Traceback" not in result.stderr
    assert result.stdout == ""


def test_semantics_profile_sets_every_behaviour_and_overrides_win():
    default = load_config(None, []).behaviour
    assert (default.engine, default.profile) == ("sglang-0.5.23", "sglang-0.5.23")
    assert (default.evict_amount, default.lfu_hits, default.prompt_split) == ("shortfall", "insert", "prompt")
    sglang = load_config(None, ["semantics.engine=sglang-0.5.5"]).behaviour
    assert sglang.profile == "sglang-0.5.5"
    assert (sglang.evict_amount, sglang.split_stamp, sglang.lfu_hits, sglang.retract_requeue) == (
        "full_need", "refresh", "never", "back")
    memcli = load_config(None, ["semantics.profile=memcli"]).behaviour
    assert (memcli.evict_amount, memcli.split_stamp, memcli.lfu_hits, memcli.retract_requeue) == (
        "shortfall", "keep", "count", "front")
    mixed = load_config(None, ["semantics.profile=memcli", "semantics.evict_amount=full_need"])
    assert mixed.behaviour.evict_amount == "full_need" and mixed.behaviour.split_stamp == "keep"
    assert mixed.semantics.overrides() == {"evict_amount": "full_need"}


def test_behaviour_is_resolved_once_per_config_and_a_replaced_config_resolves_its_own():
    config = load_config(None, ["semantics.profile=memcli"])
    assert config.behaviour is config.behaviour  # resolved once: the limits read it for every request
    assert config.behaviour.split_stamp == "keep"
    other = dataclasses.replace(config, semantics=dataclasses.replace(config.semantics, split_stamp="refresh"))
    assert other.behaviour.split_stamp == "refresh" and config.behaviour.split_stamp == "keep"
    assert other != config and config == dataclasses.replace(config)  # equality reads the fields alone


def test_every_behaviour_has_a_value_in_each_profile():
    from memcli.config import PROFILE_CHOICES, PROFILES, SemanticsConfig

    keys = [f.name for f in dataclasses.fields(SemanticsConfig) if f.name not in ("profile", "engine")]
    assert sorted(keys) == sorted(PROFILE_CHOICES)
    for key, choices in PROFILE_CHOICES.items():
        assert set(choices) == set(PROFILES), key
    for profile in PROFILES:
        resolved = SemanticsConfig(profile=profile).resolved()
        assert all(getattr(resolved, key) == PROFILE_CHOICES[key][profile] for key in keys)


def test_unknown_behaviour_value_names_the_key():
    with pytest.raises(ConfigError) as info:
        load_config(None, ["semantics.evict_amount=some"])
    assert "semantics.evict_amount" in info.value.message


def test_show_config_names_the_semantics_in_force():
    from typer.testing import CliRunner

    result = CliRunner().invoke(app, ["show-config", "--json", "--set", "semantics.profile=memcli",
                                      "--set", "semantics.lfu_hits=never"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["command"] == "show-config"
    assert doc["semantics_in_force"]["profile"] == "memcli"
    assert doc["semantics_in_force"]["lfu_hits"] == "never"  # the override
    assert doc["semantics_in_force"]["evict_amount"] == "shortfall"  # the profile's
    text = CliRunner().invoke(app, ["show-config", "--engine", "sglang-0.5.5",
                                    "--set", "semantics.lfu_hits=count"]).stdout
    assert "semantics in force: sglang-0.5.5 + lfu_hits=count" in " ".join(text.split())
    assert "count (set)" in text


def test_show_config_prints_the_engine_and_0055s_values_where_0523_differs():
    from memcli.config import PROFILE_CHOICES, SGLANG_0523_CHOICES

    result = CliRunner().invoke(app, ["show-config", "--json", "--engine", "sglang-0.5.23",
                                      "--set", "semantics.page_estimate=exact"])
    doc = json.loads(result.stdout)
    in_force, baseline = doc["semantics_in_force"], doc["baseline"]
    assert in_force["engine"] == "sglang-0.5.23" and baseline["engine"] == "sglang-0.5.5"
    assert set(in_force) == {"engine", "profile", *SGLANG_0523_CHOICES}  # every key the engine reads
    old = {k: v["sglang-0.5.5"] for k, v in PROFILE_CHOICES.items()}
    expected = {k: old[k] for k, v in SGLANG_0523_CHOICES.items() if v != old[k]}
    expected.update(engine="sglang-0.5.5", profile="sglang-0.5.5", page_estimate="one_per_request")  # the override
    assert baseline["differs"] == expected
    text = CliRunner(env={"COLUMNS": "200"}).invoke(app, ["show-config", "--engine", "sglang-0.5.23"]).stdout
    assert text.startswith("engine sglang-0.5.23: SGLang 0.5.23")
    row = next(line for line in text.splitlines() if "semantics.prompt_split" in line)
    assert [cell.strip() for cell in row.split("│")[1:4]] == ["semantics.prompt_split", "prompt", "none"]
    row = next(line for line in text.splitlines() if "semantics.page_estimate" in line)
    assert [cell.strip() for cell in row.split("│")[1:4]] == ["semantics.page_estimate", "one_per_request", ""]
    old = json.loads(CliRunner().invoke(app, ["show-config", "--engine", "sglang-0.5.5", "--json"]).stdout)
    assert "baseline" not in old  # an engine without an earlier release: its document as before


def test_a_retired_key_is_an_unknown_key_whose_hint_says_why():
    with pytest.raises(ConfigError, match="unknown config key 'sim.write_kv'") as info:
        load_config(None, ["sim.write_kv=false"])
    assert "retired" in info.value.hint and "delete the key" in info.value.hint
