"""`memcli check-page-size --engine vllm-0.33`: every holder of vLLM's block size, each
injected mismatch caught by the check it breaks, and block sizes vLLM refuses (exit 2)."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from memcli.cli.app import app

runner = CliRunner()
HOLDERS = ["cache_config", "kv_cache_spec", "block_pool", "block_hasher", "kv_events", "router"]


def check(*args):
    return runner.invoke(app, ["check-page-size", "--engine", "vllm-0.33", "--steps", "150", "--allow-unfinished",
                               *map(str, args)], env={"NO_COLOR": "1"})


def document(*args, code: int = 0) -> dict:
    result = check(*args, "--json")
    assert result.exit_code == code, result.stderr + result.stdout
    return json.loads(result.stdout)


def test_every_holder_agrees_and_the_workload_keeps_every_check():
    doc = document("--page-size", "16", "32")
    for run, bs in zip(doc["runs"], (16, 32)):
        assert [c["name"] for c in run["static"]["components"]] == HOLDERS
        assert {c["page_size"] for c in run["static"]["components"]} == {bs}
        assert all(c["ok"] for c in run["static"]["checks"])
        (phase,) = run["phases"]
        assert {c["name"]: c["status"] for c in phase["checks"]}["router"] == "pass"
        assert phase["coverage"]["kv_events"] > 0 and phase["page_size"] == bs


@pytest.mark.parametrize("holder, caught", [
    ("kv_cache_spec", "slot_mapping"), ("block_pool", "blocks_cover"), ("block_hasher", "block_hashes"),
    ("kv_events", "kv_events"), ("router", "router"),
])
def test_an_injected_block_size_is_caught_by_the_check_it_breaks(holder, caught):
    doc = document("--set", "memory.page_size=16", "--inject", f"{holder}.page_size=32", code=1)
    (run,) = doc["runs"]
    assert [c["name"] for c in run["static"]["components"] if not c["agrees"]] == [holder]
    assert not next(c for c in run["static"]["checks"] if c["name"] == "block sizes agree")["ok"]
    assert run["phases"][0]["first_violation"]["check"] == caught


@pytest.mark.parametrize("args, message", [
    (["--page-size", "8"], "multiples of 16"),
    (["--inject", "tree_cache.page_size=1"], "no such holder"),
])
def test_what_vllm_does_not_have_exits_2(args, message):
    result = check(*args)
    assert result.exit_code == 2 and message in result.stderr and "hint:" in result.stderr


def test_the_coverage_table_shows_vllms_counts_only():
    """Under vLLM the table lists what the block manager's run counted (no SGLang-only rows of
    dashes), and its counts are the run's own."""
    from typer.testing import CliRunner

    from memcli.cli.app import app

    out = CliRunner().invoke(app, ["check-page-size", "--engine", "vllm-0.33", "--page-size", "16", "--json"])
    assert out.exit_code == 0, out.output
    import json
    cov = json.loads(out.stdout)["runs"][0]["phases"][0]["coverage"]
    assert cov["requests"] == cov["finished"] == 30
    assert cov["prefill_batches"] > 0 and cov["decode_steps"] > 0 and cov["radix_hits"] > 0
    assert cov["evicted_tokens"] == cov["evicted_blocks"] * 16
    assert "chunked_requests" not in cov and "mean_partial_page_waste" not in cov
    table = CliRunner().invoke(app, ["check-page-size", "--engine", "vllm-0.33", "--page-size", "16"]).output
    assert "preemptions (by recompute)" in table and "non-final prefill chunks" not in table
