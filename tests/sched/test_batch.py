"""ScheduleBatch: the O(1) count of pages a decode step opens follows every way lengths change."""

import numpy as np
import pytest
import torch

from memcli.mem_cache import pages
from memcli.sched.batch import ScheduleBatch
from memcli.sched.req import Req
from tests.sched.helpers import small_stack


def counted(batch, page_size):
    return pages.decode_new_pages(batch.seq_lens_cpu, page_size)


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_decode_page_count_matches_a_direct_count_at_every_step(page_size):
    _, stack = small_stack(page_size=page_size, pool=4096, cache="chunk", rows=16, context=512)
    rng = np.random.default_rng(page_size)
    reqs = [Req(str(i), rng.integers(0, 1000, int(rng.integers(1, 40))), 64, stack.device) for i in range(9)]
    for r in reqs:
        r.init_next_round_input(stack.memory)
    batch = ScheduleBatch(reqs, stack.memory)
    batch.prepare_for_extend()
    for step in range(3 * page_size + 2):
        assert batch.decode_pages_needed(page_size) == counted(batch, page_size), step
        opened_before = stack.allocator.in_use_tokens
        opened = batch.decode_pages_needed(page_size)
        batch.prepare_for_decode()
        assert stack.allocator.in_use_tokens - opened_before == opened * page_size
        if step == 2:
            batch.filter_batch([0, 2, 3, 5, 8])  # lengths change other than by a step
        if step == 5:
            saved = batch.seq_lens_cpu  # a restore puts back an older tensor
            batch.prepare_for_decode()
            batch.seq_lens_cpu = saved
            batch.seq_lens = saved.to(batch.device)
            assert batch.decode_pages_needed(page_size) == counted(batch, page_size)


def test_decode_page_count_of_an_empty_batch_is_zero():
    _, stack = small_stack(page_size=4)
    batch = ScheduleBatch([], stack.memory)
    assert batch.decode_pages_needed(4) == 0 and batch.decode_pages_needed(1) == 0
    batch.seq_lens_cpu = torch.tensor([4, 5, 8, 9])
    assert batch.decode_pages_needed(4) == 2
