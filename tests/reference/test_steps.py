"""Step-level differential tests: SGLang 0.5.5's scheduler loop (real objects) vs memcli's.

Every case runs in both of SGLang's loops (`semantics.event_loop`: overlap, its default, and
normal). The reference loop must itself be sane on every case (all requests finish, the pool
is conserved); memcli's scheduler must match it step by step.

The bundled traces have prompts of up to 87 k tokens; to keep pools small (evictions,
chunked prefill, retractions) the cases take the first requests that fit a context, and the
paged (page size 16) cases cap outputs so that the Triton interpreter runs few decode
kernels on the CPU.
"""

import dataclasses
from typing import NamedTuple

import pytest

from memcli.config import load_config, replace
from memcli.reference.loop_overlap import reference_loop
from memcli.reference.observe import observe_reference, run_side_by_side
from memcli.workload.readers import read_trace
from memcli.workload.spec import output_token_base

CONVERSATION = "tests/data/conversation_head300.jsonl"
SYNTHETIC = "tests/data/synthetic_head200.jsonl"

CHUNK_INSERT_TIMING = (
    "chunked request: SGLang inserts a non-final chunk into the tree (cache_unfinished_req(chunked=True)) at the"
    " start of the next get_next_batch_to_run, so after the step the chunk's slots are still the request's;"
    " memcli inserts it in process_prefill_result, so they are already protected tree tokens")


class Case(NamedTuple):
    name: str
    trace: str
    num_requests: int
    max_len: int  # requests with input + output above this are skipped
    output_cap: int | None
    arrivals: str
    settings: tuple[str, ...]


def _settings(ps, pool, context, chunk, running):
    return (f"memory.page_size={ps}", f"memory.max_total_tokens={pool}", f"memory.max_context_len={context}",
            f"scheduler.chunked_prefill_size={chunk}", f"memory.max_running_requests={running}")


CASES = [
    Case("conversation-burst-ps1", CONVERSATION, 40, 88000, None, "burst", _settings(1, 90000, 88000, 2048, 32)),
    Case("conversation-small-ps1", CONVERSATION, 40, 12000, None, "burst", _settings(1, 20000, 12000, 1024, 32)),
    Case("synthetic-timestamp-ps1", SYNTHETIC, 40, 12000, None, "timestamp", _settings(1, 24000, 12000, 1024, 16)),
    Case("conversation-burst-ps16", CONVERSATION, 40, 12000, 12, "burst", _settings(16, 24000, 12000, 1024, 16)),
    Case("synthetic-timestamp-ps16", SYNTHETIC, 40, 12000, 12, "timestamp", _settings(16, 24000, 12000, 2048, 16)),
    # A pool small enough to retract at page size 16 (under overlap: a victim whose decode is in flight).
    Case("conversation-retract-ps16", CONVERSATION, 40, 12000, 40, "burst", _settings(16, 13000, 12000, 1024, 16)),
]


LOOPS = ("overlap", "normal")


def _load(case, event_loop="overlap"):
    trace = read_trace(case.trace, limit=300)
    requests = [r for r in trace.requests if r.input_len + r.output_len <= case.max_len][: case.num_requests]
    if case.output_cap is not None:
        requests = [dataclasses.replace(r, output_len=min(r.output_len, case.output_cap)) for r in requests]
    # SGLang 0.5.5's engine: these cases run against its reference loop (test_v0523_steps.py
    # switches the same cases to sglang-0.5.23).
    config = load_config(None, case.settings + (f"semantics.event_loop={event_loop}", "semantics.engine=sglang-0.5.5"))
    return config, requests, output_token_base(trace)


@pytest.mark.parametrize("event_loop", LOOPS)
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_reference_loop_finishes_and_conserves_the_pool(ref, case, event_loop):
    config, requests, base = _load(case, event_loop)
    loop = reference_loop(config, requests, case.arrivals, base, ref=ref)
    kinds = set()
    try:
        while not loop.is_done():
            loop.step()
            obs = observe_reference(loop)
            kinds.add(obs.kind)
            assert obs.available + obs.evictable + obs.protected <= config.pool_size
            assert loop.step_count < 20000
    finally:
        loop.close()
    assert sorted(loop.finished_rids, key=int) == sorted((r.rid for r in requests), key=int)
    available, evictable, protected = loop.sizes()
    assert (available + evictable, protected) == (config.pool_size, 0)
    assert loop.req_to_token_pool.available_size() == config.memory.max_running_requests
    assert {"prefill", "decode"} <= kinds


@pytest.mark.parametrize("event_loop", LOOPS)
def test_reference_loop_evicts_chunks_and_retracts(ref, event_loop):
    config, requests, base = _load(CASES[0], event_loop)
    loop = reference_loop(config, requests, "burst", base, ref=ref)
    evicted = retracted = chunked = 0
    try:
        while not loop.is_done():
            loop.step()
            evicted += loop.step_evicted
            retracted += len(loop.step_retracted)
            chunked += loop.chunked_req is not None
    finally:
        loop.close()
    assert evicted > 0 and retracted > 0 and chunked > 0


@pytest.mark.parametrize("event_loop", LOOPS)
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_memcli_matches_the_reference_step_by_step(ref, case, event_loop):
    config, requests, base = _load(case, event_loop)
    result = run_side_by_side(config, requests, case.arrivals, base, ref=ref)
    assert result.divergence is None, result.divergence


# The host tier: SGLang's HiRadixCache (synchronous cache controller) against memcli's, on a
# device pool small enough that finished prefixes are backed up, evicted to the host and
# loaded back.
HOST_TIER = Case("synthetic-hiradix-ps1", SYNTHETIC, 100, 8000, None, "burst",
                 _settings(1, 9000, 8000, 2048, 32) + ("cache.kind=hiradix",))


@pytest.mark.parametrize("write_policy", ("write_through", "write_back"))
@pytest.mark.parametrize("event_loop", LOOPS)
def test_memcli_matches_the_reference_with_a_host_tier(ref, monkeypatch, event_loop, write_policy):
    config, requests, base = _load(HOST_TIER, event_loop)
    config = replace(config, cache={"write_policy": write_policy})
    loads = []
    real_load = ref.hiradix_cache.HiRadixCache.init_load_back

    def counted(self, last_node, host_hit_length, *args, **kwargs):
        loaded = real_load(self, last_node, host_hit_length, *args, **kwargs)
        loads.append(len(loaded[0]))
        return loaded

    monkeypatch.setattr(ref.hiradix_cache.HiRadixCache, "init_load_back", counted)
    result = run_side_by_side(config, requests, HOST_TIER.arrivals, base, ref=ref)
    assert result.divergence is None, result.divergence
    assert sum(loads) > 0  # prefixes came back from the host tier
    assert result.notes and "synchronous" in result.notes[0]


@pytest.mark.parametrize("event_loop", LOOPS)
def test_requests_finishing_on_eos(ref, event_loop):
    """Every other request stops on EOS, 40 tokens before its max_new_tokens: memcli's 0.5.5
    profile follows SGLang 0.5.5 step by step (its admission reserves the larger limit)."""
    case = CASES[5]
    config, plain, base = _load(case, event_loop)
    requests = [dataclasses.replace(r, max_new_tokens=r.output_len + 40) if i % 2 == 0 else r
                for i, r in enumerate(plain)]
    result = run_side_by_side(config, requests, case.arrivals, base, ref=ref)
    assert result.divergence is None, result.divergence


@pytest.mark.parametrize("case", [CASES[0], CASES[4]], ids=[CASES[0].name, CASES[4].name])
def test_decode_runs_are_compared_step_by_step(ref, case, monkeypatch):
    # memcli's fast path takes steady decode runs at once; each of their steps is compared with
    # SGLang's, in order, and a slot written wrong inside a run is found at its step.
    from memcli.sched import decode_run

    taken, compared = [], []
    take = decode_run.DecodeRuns.take
    monkeypatch.setattr(decode_run.DecodeRuns, "take", lambda self, *a: taken.append(take(self, *a)) or taken[-1])
    config, requests, base = _load(case, "overlap")
    fast = run_side_by_side(config, requests, case.arrivals, base, ref=ref,
                            on_step=lambda sglang, memcli: compared.append(memcli.step))
    assert fast.divergence is None and fast.failure is None
    assert max(taken) >= 3 and sum(taken) > 0.1 * fast.steps and compared == list(range(fast.steps))
    plain = run_side_by_side(config, requests, case.arrivals, base, ref=ref, plain_loop=True)
    assert plain.divergence is None and plain.steps == fast.steps

    break_runs(monkeypatch, case)
    broken = run_side_by_side(config, requests, case.arrivals, base, ref=ref)
    sglang, memcli = broken.divergence
    assert memcli.kind == "decode" and memcli.differing(sglang) == ["out_cache_loc"]


def break_runs(monkeypatch, case) -> None:
    """Make every decode run of three steps or more write two rows' slots of its second step
    swapped (`case`'s page size picks the allocator)."""
    from memcli.mem_cache import allocator

    cls = allocator.TokenToKVPoolAllocator if "memory.page_size=1" in case.settings \
        else allocator.PagedTokenToKVPoolAllocator
    write = cls.alloc_decode_run_write

    def wrong(self, seq_lens_cpu, req_pool_indices, req_to_token, opened, observe=None):
        out = write(self, seq_lens_cpu, req_pool_indices, req_to_token, opened, observe)
        if len(opened) >= 3 and seq_lens_cpu.numel() >= 2:
            table = req_to_token.numpy()
            a, b = req_pool_indices.numpy()[:2]
            la, lb = seq_lens_cpu.numpy()[:2] + 1
            table[a, la], table[b, lb] = table[b, lb], table[a, la]
        return out

    monkeypatch.setattr(cls, "alloc_decode_run_write", wrong)
