"""The decode path's shortcuts equal what they replace: the adder's output offset bit for bit,
the lengths' sum kept per decode step, and each step record's held tokens recounted from the
requests that hold memory."""

import random

import pytest
import torch

from memcli.sched.batch import ScheduleBatch
from memcli.sched.policy import remaining_output_offset
from memcli.sched.req import Req
from tests.sched.helpers import small_stack
from tests.sched.test_scheduler import make_scheduler, shared_prefix_workload


class _Running:
    def __init__(self, max_new_tokens: int, outputs: int, ignore_eos: bool):
        self.max_new_tokens, self.output_ids, self.ignore_eos = max_new_tokens, [0] * outputs, ignore_eos


def _plain_offset(reqs, ratio, clip, ignore_eos_whole):
    # The expression `PrefillAdder` summed before `remaining_output_offset`.
    return sum(min(r.max_new_tokens - len(r.output_ids), clip) * (1.0 if ignore_eos_whole and r.ignore_eos else ratio)
               for r in reqs)


@pytest.mark.parametrize("ignore_eos_whole", [False, True])
def test_remaining_output_offset_is_the_plain_sum_bit_for_bit(ignore_eos_whole):
    rng = random.Random(7)
    for trial in range(300):
        clip = rng.choice([1, 16, 4096, 10**6])
        reqs = [_Running(rng.choice([clip, clip + 1, rng.randint(0, 2 * clip + 5)]), rng.randint(0, clip + 3),
                         rng.random() < 0.3) for _ in range(rng.randint(0, 60))]
        ratio = rng.choice([0.7, 1.0, rng.random(), 1 / 3, 0.1 + 1e-9 * trial])
        got = remaining_output_offset(reqs, ratio, clip, ignore_eos_whole)
        want = _plain_offset(reqs, ratio, clip, ignore_eos_whole)
        if not reqs:
            assert got == want == 0
            continue
        assert type(got) is float and got.hex() == want.hex(), (trial, got, want)


@pytest.mark.parametrize("page_size", [1, 16])
def test_seq_lens_sum_follows_every_way_lengths_change(page_size):
    _, stack = small_stack(page_size=page_size, pool=4096, cache="chunk", rows=16, context=512)
    rng = random.Random(page_size)
    reqs = [Req(str(i), list(range(rng.randint(1, 40))), 64, stack.device) for i in range(9)]
    for r in reqs:
        r.init_next_round_input(stack.memory)
    batch = ScheduleBatch(reqs[:6], stack.memory)
    batch.prepare_for_extend()
    other = ScheduleBatch(reqs[6:], stack.memory)
    other.prepare_for_extend()
    for step in range(12):
        assert batch.seq_lens_sum() == int(batch.seq_lens_cpu.sum()), step
        batch.prepare_for_decode()
        assert batch.seq_lens_sum() == int(batch.seq_lens_cpu.sum()), step
        if step == 2:
            batch.filter_batch([0, 2, 3, 5])
        if step == 4:
            batch.merge_batch(other)
        if step == 6:
            saved = batch.seq_lens_cpu  # a restore puts back an older tensor
            batch.prepare_for_decode()
            batch.seq_lens_cpu = saved
        if step == 8:
            batch.seq_lens_cpu = torch.tensor([3, 4, 5])  # replaced from outside


def _recounted_held(sched) -> int:
    """The docstring of `Scheduler._held_tokens`, spelt out: what `active_reqs()` own, not
    yet freed, plus the decode slots in flight of released requests."""
    held = sum(r.kv.kv_allocated_len - r.kv.last_matched_prefix_len for r in sched.active_reqs() if not r.kv.kv_freed)
    if sched.overlap is not None:
        held += len(sched.overlap.in_flight_slots())
    return held


@pytest.mark.parametrize("engine", ["sglang-0.5.5", "sglang-0.5.23"])
@pytest.mark.parametrize("event_loop", ["overlap", "normal"])
@pytest.mark.parametrize("page_size", [1, 16])
def test_every_record_holds_the_recounted_tokens(engine, event_loop, page_size):
    cfg, stack = small_stack(page_size, pool=1024, rows=8, context=256, chunk=64, semantics__engine=engine,
                             semantics__event_loop=event_loop)
    seen = []
    sched = make_scheduler(stack, cfg, retract_every=7,
                           on_step=lambda s, record: seen.append((record.held_tokens, _recounted_held(s))))
    shared_prefix_workload(sched, n=20, max_out=30, gap_ms=0.5)
    sched.run(max_steps=3000)
    assert sched.is_done() and sched.stats.retracted_requests > 0
    assert seen and all(held == want for held, want in seen)
    assert any(held > 0 for held, _ in seen)


def _finishing_over_running(loop) -> set:
    """`OverlapLoop._finishing_in_flight` as first written: the running batch scanned."""
    if not loop.result_queue:
        return set()
    queued = set(loop.result_queue[0].reqs)
    return {r for r in loop.sched.running.reqs if len(r.output_ids) + 1 >= r.max_new_tokens and r in queued}


@pytest.mark.parametrize("page_size", [1, 16])
def test_finishing_in_flight_is_the_set_the_running_batch_gives(page_size, monkeypatch):
    from memcli.sched import overlap

    cfg, stack = small_stack(page_size, pool=1024, rows=8, context=256, chunk=32, semantics__engine="sglang-0.5.23",
                             semantics__event_loop="overlap")
    assert cfg.behaviour.skip_finishing_decode == "skip"
    real, sets = overlap.OverlapLoop._finishing_in_flight, []

    def checked(loop):
        got = real(loop)
        assert got == _finishing_over_running(loop)
        sets.append(got)
        return got

    monkeypatch.setattr(overlap.OverlapLoop, "_finishing_in_flight", checked)
    sched = make_scheduler(stack, cfg, retract_every=5)
    shared_prefix_workload(sched, n=30, max_out=6, gap_ms=0.3)
    sched.run(max_steps=3000)
    assert sched.is_done() and any(sets) and not all(sets)
