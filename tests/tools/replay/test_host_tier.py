"""Replays with the host tier: tiers that add up, transfer totals that match the step series,
the checks after every step, sweeps of the host size and the write policy."""

from __future__ import annotations

import json

import numpy as np
import pytest
from typer.testing import CliRunner

from memcli.cli.app import app
from memcli.tools.replay.runner import ReplayOptions, replay
from memcli.workload.readers import read_trace

from tests.tools.replay.helpers import CONVERSATION, shrink_mooncake, small_config


@pytest.fixture(scope="module")
def trace_path(tmp_path_factory):
    # Blocks of 32 tokens: the conversation trace's sharing, 16 x fewer tokens.
    return shrink_mooncake(CONVERSATION, tmp_path_factory.mktemp("h") / "t.jsonl", 300, block_size=32)


@pytest.fixture(scope="module")
def trace(trace_path):
    return read_trace(trace_path, block_size=32)


def _config(policy="write_through", ratio=8.0, **sections):
    """SGLang 0.5.5's host tier (HiRadixCache), whose numbers these tests pin."""
    cache = {"kind": "hiradix", "host_ratio": ratio, "write_policy": policy}
    sections["semantics"] = {"engine": "sglang-0.5.5", **sections.get("semantics", {})}
    return small_config(page_size=1, pool=12_000, rows=32, context=12_000, cache=cache, **sections)


@pytest.mark.parametrize("policy", ["write_through", "write_through_selective", "write_back"])
def test_tiers_add_up_and_transfers_match_the_series(trace, policy):
    cfg = _config(policy)
    result = replay(cfg, trace, ReplayOptions(check_every_step=True))
    assert result.integrity.ok, result.integrity.failure
    h = result.host_tier
    assert h.device_hit_tokens + h.host_loaded_tokens == result.prefix.cached_tokens
    assert h.miss_tokens >= 0 and h.host_loaded_tokens > 0
    t, bpt = h.transfers, cfg.model.bytes_per_token
    assert t["d2h_bytes"] == int(result.series["d2h_bytes"].sum()) == t["backed_up_tokens"] * bpt
    assert t["h2d_bytes"] == int(result.series["h2d_bytes"].sum()) == t["loaded_back_tokens"] * bpt
    assert h.peak_host_used_tokens == int(result.series["host_used"].max()) <= h.host_pool_tokens
    if policy == "write_back":
        assert t["write_backs"] > 0 and t["write_back_stall_ms"] > 0
    else:
        assert t["write_backs"] == 0


def test_the_host_tier_raises_the_hit_rate(trace):
    device_only = replay(small_config(page_size=1, pool=12_000, rows=32, context=12_000), trace, ReplayOptions())
    tiered = replay(_config(), trace, ReplayOptions())
    assert tiered.prefix.cached_tokens > device_only.prefix.cached_tokens
    assert device_only.host_tier is None


def test_a_larger_host_pool_loads_more_back(trace):
    small, large = (replay(_config(ratio=r, semantics={"host_pool_floor": "any"}), trace, ReplayOptions())
                    for r in (1.0, 8.0))
    assert large.host_tier.host_loaded_tokens > small.host_tier.host_loaded_tokens
    assert small.host_tier.transfers["host_evicted_tokens"] > large.host_tier.transfers["host_evicted_tokens"]


def test_cli_json_and_sweeps(trace_path):
    runner = CliRunner()
    base = ["replay", str(trace_path), "--block-size", "32", "--limit", "120", "--json",
            "--set", "memory.max_total_tokens=12000", "--set", "memory.max_context_len=12000",
            "--set", "cache.kind=hiradix", "--set", "runtime.device=cpu", "--engine", "sglang-0.5.5"]
    out = runner.invoke(app, base + ["--check"])
    assert out.exit_code == 0, out.output
    doc = json.loads(out.stdout)
    tiers = doc["host_tier"]
    assert set(tiers["hit_rate"]) == {"device_hit", "host_loaded", "host_skipped", "miss"}
    assert sum(tiers["tokens"][k] for k in ("device_hit", "host_loaded", "host_skipped", "miss")) == doc["input_tokens"]
    assert len(doc["series"]["host_used"]) == len(doc["series"]["time_ms"])
    for key, values in (("cache.host_size_gib", "1.0,2.0"), ("cache.write_policy", "write_through,write_back")):
        out = runner.invoke(app, base + ["--sweep", f"{key}={values}", "--jobs", "1"])
        assert out.exit_code == 0, out.output
        rows = json.loads(out.stdout)["points"]
        assert [r["point"][key] for r in rows] == [float(v) if "gib" in key else v for v in values.split(",")]
        assert all(0 <= r["tier_device_hit"] <= 1 and "host_evicted_tokens" in r for r in rows)
    pools = [r["host_pool_tokens"] for r in rows]
    assert pools[0] == pools[1]  # the write policy does not change the pool
    human = runner.invoke(app, [arg for arg in base if arg != "--json"] + ["--sweep", "cache.write_policy=write_back",
                                                                           "--jobs", "1"])
    assert human.exit_code == 0, human.output
    assert "host tier by cache.write_policy" in human.stdout and "write_policy=write_back" in human.stdout


def test_a_host_pool_not_above_the_device_pool_is_refused_under_sglang(trace_path):
    out = CliRunner().invoke(app, ["replay", str(trace_path), "--block-size", "32", "--set", "cache.kind=hiradix",
                                   "--set", "cache.host_ratio=1", "--engine", "sglang-0.5.5"])
    assert out.exit_code == 2
    assert "error: cache.host_ratio" in out.output and "semantics.host_pool_floor=any" in out.output


def test_series_host_used_is_time_weighted_in_the_mean(trace):
    result = replay(_config(), trace, ReplayOptions())
    used, t = result.series["host_used"], result.series["time_ms"]
    expected = np.average(used[:-1], weights=np.diff(t))
    assert result.host_tier.mean_host_used_tokens == pytest.approx(expected)


def test_a_host_size_sweep_plots_the_tiers(trace_path, tmp_path):
    pytest.importorskip("matplotlib")
    out = tmp_path / "tiers.png"
    result = CliRunner().invoke(app, ["replay", str(trace_path), "--block-size", "32", "--limit", "60",
                                      "--set", "memory.max_total_tokens=12000", "--set", "memory.max_context_len=12000",
                                      "--set", "cache.kind=hiradix", "--sweep", "cache.host_ratio=2,4", "--plot", str(out),
                                      "--engine", "sglang-0.5.5"])
    assert result.exit_code == 0, result.output
    assert out.read_bytes()[:4] == b"\x89PNG" and "host tier by cache.host_ratio" in result.stdout
