"""A chunked request's prefix between chunks (`PrefixStore`, `ExtendPlan.kept_prefix`).

Each chunk's checkpoint hands the request its row so far as a new int64 prefix; on a CPU the
prefix is read into one buffer per request, past the part it held, and an extend leaves the
prefix a kept row holds already unwritten. What the request, its row and the tree hold must be
what a full copy and a full write give.
"""

import json

import pytest
import torch
from typer.testing import CliRunner

from kernels import alloc as kalloc
from memcli.cli.app import app
from memcli.mem_cache import manager, radix_cache
from memcli.mem_cache.req_kv import PrefixStore
from memcli.sched.batch import ScheduleBatch
from memcli.sched.req import Req
from tests.sched.helpers import small_stack, tokens
from tests.sched.test_decode_runs import CONVERSATION, _strip


def _chunks(stack, req, ends):
    """Prefill `req` chunk by chunk up to each of `ends`, as the scheduler does (the match
    first, no match between chunks, the chunk into the tree after each); yields the plan and
    the prefix after each chunk."""
    req.init_next_round_input(stack.memory)
    start = req.prefix_indices.shape[0]
    for end in ends:
        req.fill_ids = req.origin_input_ids[:end]
        req.extend_input_len = end - start
        batch = ScheduleBatch([req], stack.memory)
        assert batch.prepare_for_extend()
        stack.memory.cache_unfinished(req, chunked=True)
        yield batch.extend_plan, req.prefix_indices
        start = end


def _row(stack, req, n):
    return stack.req_to_token_pool.req_to_token[req.req_pool_idx, :n].to(torch.int64)


@pytest.mark.parametrize("ps", [1, 4])
def test_chunk_prefixes_grow_in_one_buffer_and_stay_copies(ps):
    _, stack = small_stack(page_size=ps, pool=256, semantics__engine="sglang-0.5.23")
    req = Req("a", tokens((0, 40)), 4, stack.device)
    ends = [8, 16, 24, 40]
    seen = []
    for i, (plan, prefix) in enumerate(_chunks(stack, req, ends)):
        assert prefix.dtype == torch.int64 and prefix.is_contiguous()
        assert torch.equal(prefix, _row(stack, req, ends[i]))  # what the full cast gives
        # The extend of every chunk after the first left the prefix its row held unwritten.
        assert plan.kept_prefix == (None if i == 0 else [ends[i - 1]])
        seen.append((prefix, prefix.clone()))
    store = req.kv.prefix_store
    assert isinstance(store, PrefixStore) and store.view is req.prefix_indices
    # One buffer for every chunk: each prefix is a view of its start.
    assert {p.data_ptr() for p, _ in seen} == {store.buffer.data_ptr()}
    # Every prefix handed out still holds what it held when it was handed out.
    for prefix, copy in seen:
        assert torch.equal(prefix, copy)


def test_a_prefix_that_is_not_the_stores_view_is_read_whole_into_a_new_store():
    _, stack = small_stack(page_size=1, pool=256, semantics__engine="sglang-0.5.23")
    req = Req("a", tokens((0, 30)), 4, stack.device)
    steps = _chunks(stack, req, [10, 20, 30])
    next(steps)
    first = req.kv.prefix_store
    # Anything else that sets the prefix (a match, a load-back) makes it a tensor of its own.
    req.kv.prefix_indices = req.prefix_indices.clone()
    assert req.kv.prefix_in_row() == 0
    plan, prefix = next(steps)
    assert plan.kept_prefix is None  # the extend wrote the whole prefix
    assert req.kv.prefix_store is not first
    assert torch.equal(prefix, _row(stack, req, 20))
    plan, prefix = next(steps)
    assert plan.kept_prefix == [20] and req.kv.prefix_store.buffer.data_ptr() == prefix.data_ptr()


def test_a_prefix_whose_row_was_given_back_is_written_again():
    """SGLang 0.5.5 gives a chunked request's row back between chunks: its next extend takes
    a row that holds nothing of the prefix, and writes all of it."""
    _, stack = small_stack(page_size=1, pool=256, semantics__engine="sglang-0.5.5")
    req = Req("a", tokens((0, 30)), 4, stack.device)
    steps = _chunks(stack, req, [10, 20, 30])
    for i, (plan, prefix) in enumerate(steps):
        assert plan.kept_prefix is None
        assert torch.equal(prefix, _row(stack, req, prefix.shape[0]))
        stack.memory.free_row(req)
        assert req.kv.prefix_in_row() == 0


def test_a_partial_page_the_checkpoint_rewrites_takes_a_new_store():
    """Page size 4, a chunk ending mid-page: the next checkpoint may point that page's slots
    at the tree's, so the prefix past the last whole page is read again into a new buffer
    (the one handed out keeps its values)."""
    _, stack = small_stack(page_size=4, pool=256, semantics__engine="sglang-0.5.23")
    req = Req("a", tokens((0, 30)), 4, stack.device)
    steps = _chunks(stack, req, [10, 20])
    _, first = next(steps)
    kept = first.clone()
    _, second = next(steps)
    assert second.data_ptr() != first.data_ptr()
    assert torch.equal(first, kept) and torch.equal(second, _row(stack, req, 20))


def _table(rows=2, cols=16):
    return torch.zeros((rows, cols), dtype=torch.int32)


def test_the_cpu_writer_leaves_a_kept_prefix_and_writes_the_rest():
    table = _table()
    table[0, :3] = torch.tensor([7, 8, 9], dtype=torch.int32)
    prefixes = [torch.tensor([7, 8, 9, 10, 11], dtype=torch.int64)]
    free = torch.arange(20, 40, dtype=torch.int64)
    full = _table()
    kalloc.alloc_extend_write_torch(full, [0], torch.tensor([5]), torch.tensor([8]), prefixes, free, 1)
    kalloc.alloc_extend_write_torch(table, [0], torch.tensor([5]), torch.tensor([8]), prefixes, free, 1,
                                    kept_prefix=[3])
    assert torch.equal(table, full)
    # The writer trusts the caller: a row that does not hold what it claims keeps what it holds.
    wrong = _table()
    kalloc.alloc_extend_write_torch(wrong, [0], torch.tensor([5]), torch.tensor([8]), prefixes, free, 1,
                                    validate=False, kept_prefix=[3])
    assert wrong[0, :3].tolist() == [0, 0, 0] and wrong[0, 3:8].tolist() == [10, 11, 20, 21, 22]


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_a_kept_prefix_the_row_does_not_hold_is_refused(backend):
    table = _table()
    prefixes = [torch.tensor([7, 8, 9], dtype=torch.int64)]
    free = torch.arange(20, 40, dtype=torch.int64)
    with pytest.raises(ValueError, match="does not hold the first 2 slots of its prefix"):
        kalloc.alloc_extend_write(table, [0], torch.tensor([3]), torch.tensor([5]), prefixes, free, 1,
                                  backend=backend, kept_prefix=[2])
    with pytest.raises(ValueError, match="outside its prefix"):
        kalloc.alloc_extend_write(table, [0], torch.tensor([3]), torch.tensor([5]), prefixes, free, 1,
                                  backend=backend, kept_prefix=[4])
    table[0, :2] = torch.tensor([7, 8], dtype=torch.int32)
    out = kalloc.alloc_extend_write_torch(table, [0], torch.tensor([3]), torch.tensor([5]), prefixes, free, 1,
                                          kept_prefix=[2])
    assert table[0, :5].tolist() == [7, 8, 9, 20, 21] and out.out_cache_loc.tolist() == [20, 21]


@pytest.mark.parametrize("ps", ["1", "16"])
def test_the_replay_of_chunked_requests_is_the_same_with_full_copies(monkeypatch, tmp_path, ps):
    """Replays with chunked prompts (chunks of 2,048 tokens): the same documents and step logs
    when every checkpoint copies the whole row and every extend writes the whole prefix."""

    def run(name):
        steps = tmp_path / f"{name}.jsonl"
        result = CliRunner().invoke(app, ["replay", str(CONVERSATION), "--limit", "120", "--set",
                                          "scheduler.chunked_prefill_size=2048", "--set", f"memory.page_size={ps}",
                                          "--json", "--steps-out", str(steps)])
        assert result.exit_code == 0, result.output
        return _strip(json.loads(result.stdout)), steps.read_text()

    fast = run("fast")
    monkeypatch.setattr(manager, "_prefix_in_row", lambda kv: 0)
    monkeypatch.setattr(radix_cache.RadixCache, "_next_prefix",
                        lambda self, req, row, row_id, unchanged, up_to: self._row_slots(row, 0, up_to))
    assert run("full") == fast
