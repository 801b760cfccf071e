"""`memcli bench-one-batch --engine vllm-0.33`: the static batch through memcli's vLLM manager,
its blocks checked against vLLM's rules, and `--compare vllm-0.33` timing vLLM's real
`KVCacheManager` from the wheel (skipped with the reason when the wheel cannot be fetched)."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from memcli.cli.app import app
from memcli.config import load_config, replace
from memcli import engines
from memcli.reference.vllm033.loader import vllm_unavailable_reason
from memcli.tools.bench_one_batch.blocks import blocks_record, case_batch, time_batch
from memcli.tools.bench_one_batch.cases import Case

runner = CliRunner()
QUICK = ["--repeat", "1", "--warmup", "0", "--rounds", "1"]
VLLM = ["--engine", "vllm-0.33", "--set", "runtime.device=cpu"]


def invoke(*args):
    return runner.invoke(app, ["bench-one-batch", *VLLM, *map(str, args)], env={"NO_COLOR": "1"})


def bench_json(*args) -> dict:
    result = invoke(*args, "--json")
    assert result.exit_code == 0, result.stderr + result.stdout
    return json.loads(result.stdout)


def test_the_static_batch_takes_hits_and_frees_the_blocks_vllm_rules_give():
    # 2 prompts of 40 tokens, 20 cached: one full block hits; 19 decode steps reach 59 tokens.
    doc = bench_json("-b", 2, "--input-len", 40, "--output-len", 20, "--prefix-len", 20, "--tree-cache", "radix",
                     *QUICK)
    (case,) = doc["cases"]
    assert case["page_size"] == 16 and case["page_sizes"] == {"block_size": 16}
    assert case["cached_prefix_len"] == 16 and case["prefill_new_tokens"] == 2 * 40 - 32
    got = case["blocks"]["measured"]
    assert (got["hit_tokens"], got["prefill_blocks"], got["decode_blocks"], got["freed_blocks"]) == (32, 4, 2, 8)
    assert (got["queries"], got["hits"], got["held_blocks"]) == (80, 32, 0)
    # Full blocks of both requests stay cached: 59 tokens give 3 each.
    assert got["cached_blocks"] == 6
    assert case["blocks"]["ok"] and case["blocks"]["differ"] == [] and case["idle"]["ok"]
    assert case["prefill_allocated_tokens"] == 64 and case["decode_allocated_tokens"] == 32
    assert case["freed_tokens"] == 128
    assert set(case["phases"]) == {"prefill_memory", "decode_memory", "free"}
    assert case["prefill_latency"] is None and case["total_latency"] is None
    assert case["phases"]["decode_memory"]["samples"] == 19


def test_caching_off_takes_no_hit_and_the_table_labels_what_is_not_timed():
    result = invoke("-b", 1, "--input-len", 33, "--output-len", 2, *QUICK)
    assert result.exit_code == 0, result.stderr
    assert "not timed on a block manager" in result.stdout and "get_computed_blocks" in result.stdout
    doc = bench_json("-b", 1, "--input-len", 33, "--output-len", 2, *QUICK)
    got = doc["cases"][0]["blocks"]["measured"]
    assert (got["hit_tokens"], got["prefill_blocks"], got["cached_blocks"], got["queries"]) == (0, 3, 0, 0)


def test_a_figure_off_the_rules_fails_the_check():
    config = replace(load_config(None, ["semantics.engine=vllm-0.33"]), cache={"kind": "radix"})
    case = Case(2, 40, 4, 20, 16)
    batch = case_batch(engines.get(config).static_batch, case, config, seed=0)
    _, _, figures = time_batch(batch, 3, repeat=1, warmup=0)
    assert blocks_record(batch, figures, 3)["ok"]
    wrong = blocks_record(batch, figures._replace(prefill_blocks=figures.prefill_blocks + 1), 3)
    assert not wrong["ok"] and wrong["differ"] == ["prefill_blocks"]


@pytest.mark.parametrize("args, message", [
    (["--prefix-len", "8", "--input-len", "40"], "prefix caching is off"),
    (["--page-size", "8"], "multiples of 16"),
    (["--compare", "sglang-0.5.5"], "would not do the same work"),
    (["--compare", "vllm-0.33", "--compare-backend", "fa3"], "reads no attention backend"),
])
def test_bad_input_exits_2_with_a_hint(args, message):
    result = invoke("-b", 1, *args, *QUICK)
    assert result.exit_code == 2, result.stdout
    assert message in result.stderr and "hint:" in result.stderr


def test_comparing_vllm_needs_the_vllm_engine():
    result = runner.invoke(app, ["bench-one-batch", "--engine", "sglang-0.5.5", "--compare", "vllm-0.33", *QUICK],
                           env={"NO_COLOR": "1"})
    assert result.exit_code == 2 and "add --engine vllm-0.33" in result.stderr


def test_compare_times_vllm_real_manager_on_the_same_blocks_round_by_round():
    reason = vllm_unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    doc = bench_json("-b", 2, "--input-len", 40, "--output-len", 18, "--prefix-len", 20, "--tree-cache", "radix",
                     "--compare", "vllm-0.33", "--repeat", "1", "--warmup", "0", "--rounds", "2")
    compare = doc["compare"]
    assert compare["name"] == "vllm-0.33" and compare["attention_backend"] is None
    assert "KVCacheManager" in compare["setup"] and "sha256" in compare["setup"]
    assert "prefix caching on" in compare["setup"]
    assert [row["phase"] for row in compare["rows"]] == ["prefill_memory", "decode_memory", "free"]
    for row in compare["rows"]:
        assert len(row["reference"]["round_medians_us"]) == len(row["memcli"]["round_medians_us"]) == 2
        assert row["paired_speedup"] is not None and row["paired_speedup"] > 0
    assert doc["cases"][0]["blocks"]["ok"]
