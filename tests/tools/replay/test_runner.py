"""The replay runner on CPU with indices-only pools: exact hits, finite pools, every arrival mode."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from memcli.capacity import check_fits
from memcli.errors import CapacityError, MemcliError
from memcli.tools.replay.runner import ReplayOptions, replay
from memcli.tools.study.unlimited import unlimited_config, unlimited_pool_tokens
from memcli.sched.scheduler import Scheduler
from memcli.workload.generate import generate_trace, write_trace
from memcli.workload.readers import read_trace

from tests.tools.replay.helpers import CONVERSATION, SYNTHETIC, page_prefix_hits, plant_leak, shrink_mooncake, small_config


@pytest.fixture(scope="module")
def shrunk(tmp_path_factory):
    """The first 100 conversation requests with 24-token blocks (same hash ids, ~21x fewer tokens)."""
    path = shrink_mooncake(CONVERSATION, tmp_path_factory.mktemp("t") / "shrunk.jsonl", 100, block_size=24)
    return read_trace(path, block_size=24)


@pytest.fixture(scope="module")
def generated(tmp_path_factory):
    path = tmp_path_factory.mktemp("g") / "gen.jsonl"
    write_trace(generate_trace(40, seed=1, system_prompts=2, system_prompt_len=64, turns=3, input_len=32,
                               output_len=64, rate=50), path)
    return read_trace(path)


@pytest.mark.parametrize("page_size", [1, 16])
def test_sequential_unlimited_pool_hits_exactly_the_earlier_prefixes(shrunk, page_size):
    config = unlimited_config(small_config(page_size, rows=4), unlimited_pool_tokens(shrunk, page_size))
    result = replay(config, shrunk, ReplayOptions("sequential"))
    expected = page_prefix_hits([r.input_ids() for r in shrunk.requests], page_size)
    assert result.first_cached_tokens.tolist() == expected
    assert result.prefix.cached_tokens == result.prefix.ceiling_tokens == sum(expected) > 0
    assert result.eviction.evictions == 0
    assert result.summary.finished == shrunk.num_requests
    assert result.integrity.ok and result.integrity.everything_free


@pytest.mark.parametrize("page_size", [1, 8])
def test_sequential_hits_on_a_generated_memcli_trace(generated, page_size):
    config = unlimited_config(small_config(page_size, rows=4), unlimited_pool_tokens(generated, page_size))
    result = replay(config, generated, ReplayOptions("sequential"))
    expected = page_prefix_hits([r.input_ids() for r in generated.requests], page_size)
    assert result.first_cached_tokens.tolist() == expected
    assert sum(expected) > 0


@pytest.mark.parametrize("page_size,pool", [(1, 1200), (16, 1280)])
def test_finite_pool_evicts_and_retracts_and_ends_with_everything_free(generated, page_size, pool):
    config = small_config(page_size, pool=pool, rows=16,
                          scheduler={"init_new_token_ratio": 0.05, "chunked_prefill_size": 256,
                                     "max_prefill_tokens": 512})
    result = replay(config, generated, ReplayOptions("timestamp", check_every_step=True))
    assert result.eviction.evictions > 0 and result.eviction.tokens_evicted > 0
    assert result.scheduling.retractions > 0 and result.scheduling.recomputed_tokens > 0
    assert result.summary.finished == generated.num_requests and result.summary.aborted == 0
    assert result.integrity.ok and result.integrity.checks_run >= result.summary.steps
    assert result.integrity.everything_free
    assert result.integrity.end_available + result.integrity.end_evictable == result.occupancy.pool_tokens
    assert result.occupancy.peak_used_pages * page_size <= pool
    assert result.allocation.frees > 0 and result.allocation.freed_tokens > 0
    assert result.eviction.age_ms["max"] >= result.eviction.age_ms["p90"] >= result.eviction.age_ms["p50"] >= 0


@pytest.mark.parametrize("path", [CONVERSATION, SYNTHETIC])
@pytest.mark.parametrize("arrivals", ["timestamp", "burst"])
def test_shared_trace_heads_replay(path, arrivals):
    trace = read_trace(path, limit=24)
    config = small_config(16, pool=600_000, rows=32, context=200_000)
    result = replay(config, trace, ReplayOptions(arrivals))
    assert result.summary.finished == 24
    assert result.summary.output_tokens == sum(max(r.output_len, 1) for r in trace.requests)
    assert result.integrity.ok and result.integrity.everything_free
    assert 0 <= result.prefix.cached_tokens <= result.prefix.input_tokens == trace.input_tokens
    assert len(result.series["time_ms"]) == result.summary.steps
    if arrivals == "timestamp":
        assert result.summary.simulated_ms >= trace.requests[-1].arrival_ms


def test_burst_puts_every_request_in_the_waiting_queue_at_once(shrunk):
    config = small_config(16, pool=80_000, rows=32)
    burst = replay(config, shrunk, ReplayOptions("burst"))
    assert burst.scheduling.queue.max_waiting > 32  # everything waits at t = 0
    assert burst.summary.finished == shrunk.num_requests


MEMCLI_PROFILE = {"semantics": {"profile": "memcli"}}


def fits(config, trace):
    """The check every command runs before a replay, on a whole trace."""
    check_fits(config, trace.requests, trace.path)


def test_capacity_errors_name_the_request_and_the_fix(shrunk):
    with pytest.raises(CapacityError) as exc:
        fits(small_config(16, pool=20_000, context=2_000, **MEMCLI_PROFILE), shrunk)
    assert "max_context_len 2000" in exc.value.message and "request" in exc.value.message
    assert "--set memory.max_context_len=" in exc.value.hint
    longest = max(r.input_len + r.output_len for r in shrunk.requests)
    with pytest.raises(CapacityError) as exc:
        fits(small_config(1, pool=longest, context=longest, **MEMCLI_PROFILE), shrunk)
    assert "pool holds" in exc.value.message and "max_total_tokens" in exc.value.hint


def test_sglang_request_limits_need_two_tokens_more_and_the_hint_gives_them(shrunk):
    """Under the sglang-0.5.5 profile a request runs whole only when input + output + 2 fits
    min(context, pool) (SGLang clips the output otherwise): the context that holds the longest
    request under the memcli profile is refused, and the hint's context is accepted."""
    longest = max(r.input_len + r.output_len for r in shrunk.requests)
    with pytest.raises(CapacityError) as exc:
        fits(small_config(1, pool=longest + 2, context=longest), shrunk)
    message = exc.value.message
    assert f"more than memory.max_context_len {longest} holds" in message
    assert f"max_context_len >= {longest + 2}" in message
    assert "semantics.request_limits" in message
    assert f"--set memory.max_context_len={longest + 2}" in exc.value.hint
    fits(small_config(1, pool=longest + 2, context=longest + 2), shrunk)
    with pytest.raises(CapacityError) as exc:  # one token short of the two
        fits(small_config(1, pool=longest + 1, context=longest + 1), shrunk)
    assert f"--set memory.max_context_len={longest + 2}" in exc.value.hint


def test_sglang_request_limits_keep_a_prompt_seven_tokens_under_the_context(tmp_path):
    """A short output: the prompt's own limit binds (SGLang aborts a prompt of max_req_len - 5
    tokens or more, max_req_len = context - 1), so the context must exceed the prompt by 7."""
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps({"rid": "a", "input_len": 994, "output_len": 3}) + "\n")
    trace = read_trace(path)
    with pytest.raises(CapacityError) as exc:
        fits(small_config(1, pool=4_000, context=1_000), trace)
    assert "max_context_len >= 1001" in exc.value.message and "max_req_len - 5" in exc.value.message
    fits(small_config(1, pool=4_000, context=1_001), trace)
    fits(small_config(1, pool=4_000, context=997, **MEMCLI_PROFILE), trace)  # row: input + output


def test_timestamp_arrivals_need_times(generated, tmp_path):
    write_trace(generate_trace(5, rate=0), tmp_path / "untimed.jsonl")
    untimed = read_trace(tmp_path / "untimed.jsonl")
    with pytest.raises(MemcliError, match="needs arrival times"):
        replay(small_config(), untimed, ReplayOptions("timestamp"))


def test_integrity_violation_stops_with_the_result_so_far(generated, monkeypatch):
    plant_leak(monkeypatch, after_step=5)
    result = replay(small_config(1, pool=50_000), generated, ReplayOptions("timestamp", check_every_step=True))
    assert not result.integrity.ok
    assert "memory leak detected" in result.integrity.failure
    leaked = result.integrity.history[-1]  # the story of the leaked page ends with its hand-out
    assert (leaked.step, leaked.rid, leaked.op, leaked.dst) == (5, None, "allocator.alloc", "nobody (allocated, unclaimed)")
    assert all(t.page == leaked.page for t in result.integrity.history)
    # Leaked after step 5, caught by the check of step 6, which is in the series too.
    assert result.summary.steps == 6 and len(result.series["time_ms"]) == 6
    assert result.summary.finished < generated.num_requests
    assert result.prefix.requests == int((result.first_cached_tokens >= 0).sum()) > 0


def test_events_stream_is_json_lines(generated, tmp_path):
    path = tmp_path / "events.jsonl"
    config = small_config(4, pool=2_000, rows=16)
    result = replay(config, generated, ReplayOptions("timestamp", events_path=path))
    events = [json.loads(line) for line in path.read_text().splitlines()]
    kinds = {e["type"] for e in events}
    assert {"stored", "removed"} <= kinds
    stored = [e for e in events if e["type"] == "stored"]
    assert all(len(e["token_ids"]) == e["block_size"] == 4 for e in stored)
    removed_pages = sum(len(e["block_hashes"]) for e in events if e["type"] == "removed")
    assert removed_pages * 4 == result.eviction.tokens_evicted
    assert result.config.cache.kv_events


def test_cpu_replay_runs_with_one_torch_thread_and_restores_it(generated, monkeypatch):
    seen = []
    step = Scheduler.step
    monkeypatch.setattr(Scheduler, "step", lambda self: (seen.append(torch.get_num_threads()), step(self))[1])
    before = torch.get_num_threads()
    replay(small_config(), generated, ReplayOptions("burst"))
    assert set(seen) == {1}
    assert torch.get_num_threads() == before


def test_first_cached_tokens_is_minus_one_only_for_unadmitted(generated):
    result = replay(small_config(), generated, ReplayOptions("burst"))
    assert (result.first_cached_tokens >= 0).all()
    assert np.array_equal(result.first_cached_tokens % 16, np.zeros(generated.num_requests, dtype=np.int64))


def test_capacity_errors_name_the_file_and_line(tmp_path):
    path = tmp_path / "mooncake.jsonl"
    path.write_text('{"input_length": 10, "output_length": 5, "hash_ids": [1]}\n\n\n'
                    '{"input_length": 3000, "output_length": 5, "hash_ids": [1, 2, 3, 4, 5, 6]}\n')
    with pytest.raises(CapacityError) as exc:
        fits(small_config(16, pool=20_000, context=2_000), read_trace(path))
    assert exc.value.message.startswith(f"{path}:4: request 4 (#2) needs 3005 tokens")
