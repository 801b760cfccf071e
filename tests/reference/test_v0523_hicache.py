"""The host tier against SGLang 0.5.23's own HiCache: `UnifiedRadixCache.init_hicache` with its
host pool and `HybridCacheController` (copies finish when issued on the CPU), driven by the
0.5.23 reference loop, vs memcli's scheduler under the sglang-0.5.23 engine with
`cache.kind=hiradix`: step by step, both loops, write-through (1st and 2nd hit) and
write-back, on device pools small enough that prefixes go to the host and are loaded back
(page size 1, chunked prefill; page size 16 with retractions)."""

import json

import pytest

from memcli.config import host_pool_size, load_config, replace
from memcli.reference.observe import MemcliSide
from memcli.reference.v0523.diff import compare_steps, reference_steps
from tests.reference.test_steps import CASES, HOST_TIER, _load

ENGINE = {"engine": "sglang-0.5.23", "profile": "sglang-0.5.23"}
RETRACT_PS16 = CASES[5]  # page size 16, a pool small enough to retract


def _case(event_loop, write_policy, case=HOST_TIER, **semantics):
    config, requests, base = _load(case, event_loop)
    cache = {"kind": "hiradix", "write_policy": write_policy, "host_ratio": 2.0 if case is HOST_TIER else 1.0}
    config = replace(config, semantics={**ENGINE, "event_loop": event_loop, **semantics}, cache=cache)
    return config, requests, base


def _loaded_back(config, requests, base, case) -> int:
    """Tokens memcli loads back from the host over the whole replay."""
    side = MemcliSide(config, requests, case.arrivals, base)
    while not side.is_done():
        side.step()
    return side.stack.tree_cache.loaded_back_tokens


@pytest.mark.parametrize("event_loop", ["overlap", "normal"])
@pytest.mark.parametrize("case, write_policy", [
    (HOST_TIER, "write_through"), (HOST_TIER, "write_through_selective"), (HOST_TIER, "write_back"),
    (RETRACT_PS16, "write_through"), (RETRACT_PS16, "write_back"),
], ids=["ps1-write_through", "ps1-write_through_selective", "ps1-write_back", "ps16-write_through", "ps16-write_back"])
def test_host_tier_matches_sglang_0523(worker0523, event_loop, case, write_policy):
    config, requests, base = _case(event_loop, write_policy, case)
    steps = reference_steps(worker0523, config, requests, case.arrivals, base)
    if write_policy != "write_through_selective":  # here no node is inserted by two requests
        assert max(s.obs.host_used for s in steps) >= config.pool_size  # the host holds a device pool's worth
    diff = compare_steps(steps, config, requests, case.arrivals, base)
    assert diff.failure is None, diff.failure
    assert diff.divergence is None, "\n".join(["sglang:", *diff.divergence[0].lines(),
                                               "memcli:", *diff.divergence[1].lines()])
    assert diff.steps == len(steps)
    if event_loop == "normal" and case is HOST_TIER and write_policy != "write_through_selective":
        assert _loaded_back(config, requests, base, case) > 0


@pytest.mark.parametrize("write_policy, key, old", [
    ("write_through", "hicache_evict", "full_need"),
    ("write_through", "tree_stamps", "radix"),  # 0.5.5's tree and insert walk under the host tier
    ("write_back", "write_back_demote", "batched"),
    ("write_back", "write_back_host_reclaim", "leaves"),
])
def test_0055_host_tier_behaviours_are_caught(worker0523, write_policy, key, old):
    """Each host-tier behaviour of 0.5.23, flipped back to 0.5.5's, diverges from 0.5.23."""
    config, requests, base = _case("normal", write_policy)
    steps = reference_steps(worker0523, config, requests, HOST_TIER.arrivals, base)
    flipped, _, _ = _case("normal", write_policy, **{key: old})
    assert compare_steps(steps, flipped, requests, HOST_TIER.arrivals, base).divergence is not None


@pytest.mark.parametrize("size, page_size, ratio", [(9000, 1, 2.0), (4096, 16, 0.5), (24000, 16, 1.3)])
def test_host_pool_size_is_0523s(worker0523, size, page_size, ratio):
    """`ratio` x the device pool in pages, plus a padding page (a pool smaller than the device
    one only warns); 0.5.5's size (`host_pool_padding: none`) is a page short."""
    sglang = worker0523.call("host_pool", size=size, page_size=page_size, ratio=ratio)
    settings = {"memory": {"max_total_tokens": size, "page_size": page_size, "max_context_len": min(size, 4096)},
                "cache": {"kind": "hiradix", "host_ratio": ratio}}
    config = replace(load_config(None, ()), semantics=ENGINE, **settings)
    assert host_pool_size(config) == sglang
    old = replace(config, semantics={**ENGINE, "host_pool_padding": "none"})
    assert host_pool_size(old) == sglang - page_size


CLI_HOST = ["--engine", "sglang-0.5.23", "--set", "cache.kind=hiradix", "--set", "memory.max_total_tokens=90000",
            "--set", "memory.max_context_len=88000"]


def test_reference_diff_runs_0523s_host_tier(worker0523):
    from typer.testing import CliRunner

    from memcli.cli.app import app

    trace = "tests/data/conversation_head300.jsonl"
    result = CliRunner().invoke(app, ["reference", "diff", trace, "--limit", "6", *CLI_HOST, "--json"])
    assert result.exit_code == 0, result.stdout + result.stderr
    doc = json.loads(result.stdout)
    assert doc["divergent"] is False and doc["config"]["cache"]["kind"] == "hiradix" and doc["steps"] > 100
    refused = CliRunner().invoke(app, ["reference", "diff", trace, "--limit", "2", *CLI_HOST,
                                       "--set", "cache.host_size_gib=4"])
    assert refused.exit_code == 2 and "cache.host_size_gib" in refused.stderr and "Traceback" not in refused.stderr
