"""`--check` under vLLM: every step is checked for what it changed, and a fault planted in one
pool call is reported at the step that made it, by the step check."""

from pathlib import Path

import pytest

from memcli.config import load_config
from memcli.mem_cache import block_pool
from memcli.mem_cache.block_manager import BlockChecker, BlockManager
from memcli.mem_cache.integrity.checker import CheckPolicy
from memcli.tools.replay.runner import ReplayOptions, replay
from memcli.vllm_sched import scheduler as vllm_scheduler
from memcli.workload.readers import read_trace

TRACE = Path("tests/data/conversation_head300.jsonl")
POINTS = ["semantics.engine=vllm-0.33", "memory.max_total_tokens=120000", "memory.max_context_len=100000"]


def _replay(limit: int = 120, points: tuple = ()):
    trace = read_trace(TRACE, limit=limit)
    config = load_config(None, [*POINTS, *points], builtin="replay")
    return replay(config, trace, ReplayOptions("timestamp", check_every_step=True))


@pytest.mark.parametrize("points", [(), ("semantics.event_loop=sync",), ("cache.kind=none",)])
def test_every_step_is_checked_and_passes(points):
    result = _replay(points=points)
    integrity = result.integrity
    assert integrity.ok and integrity.failure is None
    assert integrity.incremental_checks == result.summary.steps > 100
    assert result.summary.finished + result.summary.aborted == 120


def _plant(monkeypatch, method: str, call: int, fault) -> list:
    """Run `fault(pool, args)` after the `call`-th call of `BlockPool.method`; the step it
    happened in is returned in the list."""
    calls, where, current = [0], [], [None]
    original_step = vllm_scheduler.VllmScheduler.step

    def step(self):
        current[0] = self.step_count
        return original_step(self)

    original = getattr(block_pool.BlockPool, method)

    def wrapped(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        calls[0] += 1
        if calls[0] == call:
            fault(self, args)
            where.append(current[0])
        return out

    monkeypatch.setattr(vllm_scheduler.VllmScheduler, "step", step)
    monkeypatch.setattr(block_pool.BlockPool, method, wrapped)
    return where


def _lost_decrement(pool, args):
    block = next(b for b in pool.dirty[-1] if not b.is_null)  # the blocks just freed (the call consumed its iterator)
    block.ref_cnt += 1  # freed, yet still counted as held


def _lost_map_entry(pool, args):
    blocks, hashes, first, end = args[:4]
    del pool.cached[hashes[first]]  # cached, yet its hash is gone from the map


def _stale_queue(pool, args):
    (n,) = args
    pool.num_cached_free += 1  # a counter the queue no longer agrees with


@pytest.mark.parametrize("method, call, fault, words", [
    ("free_blocks", 5, _lost_decrement, "holders"),
    ("cache_full_blocks", 40, _lost_map_entry, "maps to None"),
    ("get_new_blocks", 60, _stale_queue, "pool counters"),
])
def test_a_planted_fault_is_reported_at_its_step(monkeypatch, method, call, fault, words):
    where = _plant(monkeypatch, method, call, fault)
    result = _replay()
    integrity = result.integrity
    assert where and not integrity.ok
    assert integrity.failure_check == "block_step" and integrity.failure_step == where[0]
    assert words in integrity.failure and f"step {where[0]}:" in integrity.failure


def test_the_policys_levels_choose_the_step_check_and_the_walk():
    memory = BlockManager(8, 4, 64)
    for level, tracks, walks in [("none", False, False), ("incremental", True, False), ("full", False, True),
                                 ("both", True, True)]:
        checker = BlockChecker(memory, CheckPolicy(level))
        assert (checker.tracks, checker.walks) == (tracks, walks)
    assert memory.pool.dirty is not None  # the last checker keeps the pool's changes
    held = memory.pool.get_new_blocks(2)
    assert memory.pool.dirty == [held]


def _filled_manager() -> tuple:
    from memcli.vllm_sched.request import VllmRequest
    memory = BlockManager(16, 4, 64)
    req = VllmRequest("a", list(range(10)), 4)
    memory.hash_request(req)
    memory.allocate_slots(req, 10, has_scheduled_reqs=False)
    return memory, req


@pytest.mark.parametrize("fault, words", [
    (lambda pool: setattr(pool.blocks[1], "ref_cnt", 2), "holders counted"),
    (lambda pool: pool.free.append_n([pool.blocks[5]]), "links for"),
    (lambda pool: setattr(pool.blocks[1], "ref_cnt", 0), "in free queue: False"),
    (lambda pool: setattr(pool, "num_cached_free", 3), "counters"),
    (lambda pool: setattr(next(iter(pool.cached.values())), "key", None), "unhashed"),
])
def test_the_whole_pool_walk_finds_a_planted_fault(fault, words):
    memory, req = _filled_manager()
    assert memory.check([req])[0].held_blocks == 3
    fault(memory.pool)
    with pytest.raises(Exception, match=words):
        memory.check([req])
