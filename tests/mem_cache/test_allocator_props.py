"""Random operation sequences on both allocators against a plain-list model of the free list.

The model keeps the free list as a Python list (the token allocator appends freed slots at
the tail; the paged allocator prepends the sorted, de-duplicated pages; allocations take from
the head) and the live requests with their slots, so every extend has a consistent
`last_loc` and every free releases one whole request. After every step the returned slots,
the free list, the request rows and `check_integrity()` must agree with the model.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from memcli.mem_cache.allocator import make_allocator

CPU = torch.device("cpu")
MAX_ROWS = 6


def cdiv(a, b):
    return -(-a // b)


def i64(values):
    return torch.tensor(values, dtype=torch.int64)


@dataclass
class Request:
    row: int
    slots: list[int] = field(default_factory=list)


class FreeListModel:
    """What the allocator's free list must look like, as plain lists."""

    def __init__(self, size: int, page_size: int, need_sort: bool):
        self.size, self.page_size, self.need_sort = size, page_size, need_sort
        self.clear()

    def clear(self) -> None:
        self.free = list(range(1, self.size // self.page_size + 1))
        self.release: list[int] = []

    def page_ids(self) -> list[int]:
        return self.free + self.release

    def take(self, num_pages: int) -> list[int] | None:
        if num_pages > len(self.free) and self.release:
            self.free, self.release = sorted(self.free + self.release), []
        if num_pages > len(self.free):
            return None
        pages, self.free = self.free[:num_pages], self.free[num_pages:]
        return pages

    def put(self, slots: list[int]) -> None:
        if not slots:
            return
        if self.page_size == 1:
            pages = list(slots)
        else:
            pages = sorted({s // self.page_size for s in slots})
        if self.need_sort:
            self.release += pages
        elif self.page_size == 1:
            self.free += pages
        else:
            self.free = pages + self.free


def extend_slots(page_size: int, slots: list[int], seq_len: int, pages: list[int]) -> list[int]:
    """New slots of one request: finish the prefix's last page, then its own new pages, with
    position t at offset t % page_size."""
    pre = len(slots)
    last_loc = slots[-1] if slots else -1
    first_new_page = cdiv(pre, page_size)
    out = []
    for t in range(pre, seq_len):
        if t < first_new_page * page_size:
            out.append(last_loc + 1 + t - pre)
        else:
            out.append(pages[t // page_size - first_new_page] * page_size + t % page_size)
    return out


class Harness:
    """One allocator, its model, the live requests and a req_to_token table."""

    def __init__(self, page_size: int, num_pages: int, need_sort: bool):
        self.ps = page_size
        self.size = page_size * num_pages
        self.allocator = make_allocator(self.size, page_size, CPU, "torch", need_sort=need_sort)
        self.model = FreeListModel(self.size, page_size, need_sort)
        self.requests: list[Request] = []
        self.req_to_token = torch.zeros((MAX_ROWS, self.size + 2), dtype=torch.int32)
        self.snapshot = None

    # -- helpers -----------------------------------------------------------------------------
    def free_rows(self) -> list[int]:
        used = {r.row for r in self.requests}
        return [r for r in range(MAX_ROWS) if r not in used]

    def write_row(self, req: Request) -> None:
        self.req_to_token[req.row, : len(req.slots)] = torch.tensor(req.slots, dtype=torch.int32)

    def pick_requests(self, data, min_size: int) -> list[Request]:
        if not self.requests:
            return []
        idx = data.draw(st.lists(st.sampled_from(range(len(self.requests))), min_size=min_size,
                                 max_size=len(self.requests), unique=True))
        return [self.requests[i] for i in idx]

    # -- operations --------------------------------------------------------------------------
    def op_alloc(self, data) -> None:
        num_pages = data.draw(st.integers(1, self.size // self.ps + 1))
        out = self.allocator.alloc(num_pages * self.ps)
        pages = self.model.take(num_pages)
        if pages is None:
            assert out is None
            return
        expected = [p * self.ps + k for p in pages for k in range(self.ps)]
        assert out.tolist() == expected
        rows = self.free_rows()
        if rows:
            req = Request(rows[0], expected)
            self.requests.append(req)
            self.write_row(req)
        else:
            self.allocator.free(out)
            self.model.put(expected)

    def op_extend(self, data) -> None:
        grow_existing = data.draw(st.booleans())
        batch = self.pick_requests(data, 1) if grow_existing else []
        rows = self.free_rows()
        if not batch and not rows:
            return
        num_new = data.draw(st.integers(0 if batch else 1, min(2, len(rows))))
        batch += [Request(row) for row in rows[:num_new]]
        extend_lens = [data.draw(st.integers(1, self.ps + self.ps // 2 + 2)) for _ in batch]
        prefix_lens = [len(r.slots) for r in batch]
        seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens)]
        need = [cdiv(s, self.ps) - cdiv(p, self.ps) for p, s in zip(prefix_lens, seq_lens)]
        before = self.req_to_token.clone()
        written = self.allocator.alloc_extend_write(
            self.req_to_token, [r.row for r in batch], i64(prefix_lens), i64(seq_lens),
            [i64(r.slots) for r in batch], sum(need), extend_num_tokens=sum(extend_lens))
        pages = self.model.take(sum(need))
        if pages is None:
            assert written is None and torch.equal(self.req_to_token, before)
            return
        out = written.out_cache_loc
        expected, start = [], 0
        for req, seq_len, n in zip(batch, seq_lens, need):
            expected += extend_slots(self.ps, req.slots, seq_len, pages[start : start + n])
            start += n
        assert out.tolist() == expected
        offset = 0
        for req, n in zip(batch, extend_lens):
            req.slots = req.slots + expected[offset : offset + n]
            offset += n
            if req not in self.requests:
                self.requests.append(req)
            self.write_row(req)

    def decode_expected(self, batch: list[Request]) -> list[int] | None:
        opens = [len(r.slots) % self.ps == 0 for r in batch]
        pages = self.model.take(sum(opens))
        if pages is None:
            return None
        it = iter(pages)
        return [next(it) * self.ps if o else r.slots[-1] + 1 for r, o in zip(batch, opens)]

    def op_decode_write(self, data) -> None:
        batch = self.pick_requests(data, 1)
        if not batch:
            return
        seq = i64([len(r.slots) for r in batch])
        before = self.req_to_token.clone()
        written = self.allocator.alloc_decode_write(seq, seq.clone(), i64([r.row for r in batch]),
                                                    self.req_to_token)
        out = None if written is None else written.out_cache_loc
        expected = self.decode_expected(batch)
        if expected is None:
            assert torch.equal(self.req_to_token, before)
        if expected is None:
            assert out is None
            return
        assert out.tolist() == expected
        for req, slot in zip(batch, expected):
            req.slots = req.slots + [slot]

    def free_request(self, req: Request) -> None:
        self.allocator.free(self.req_to_token[req.row, : len(req.slots)].to(torch.int64))
        self.requests.remove(req)

    def op_free(self, data) -> None:
        if self.requests:
            req = data.draw(st.sampled_from(self.requests))
            self.free_request(req)
            self.model.put(req.slots)

    def op_free_group(self, data) -> None:
        batch = self.pick_requests(data, 1)
        self.allocator.free_group_begin()
        for req in batch:
            self.free_request(req)
        assert self.allocator.free_page_ids().tolist() == self.model.page_ids()
        self.allocator.free_group_end()
        self.model.put([s for req in batch for s in req.slots])

    def op_backup(self, data) -> None:
        self.snapshot = (
            self.allocator.backup_state(),
            copy.deepcopy((self.model.free, self.model.release, self.requests)),
            self.req_to_token.clone(),
        )

    def op_restore(self, data) -> None:
        if self.snapshot is None:
            return
        state, (free, release, requests), req_to_token = self.snapshot
        self.allocator.restore_state(state)
        self.model.free, self.model.release = list(free), list(release)
        self.requests = copy.deepcopy(requests)
        self.req_to_token = req_to_token.clone()

    def op_clear(self, data) -> None:
        self.allocator.clear()
        self.model.clear()
        self.requests = []

    OPS = ["alloc", "extend", "extend", "decode_write", "decode_write", "free", "free", "free_group",
           "backup", "restore", "clear"]

    def step(self, data) -> None:
        name = data.draw(st.sampled_from(self.OPS))
        getattr(self, f"op_{name}")(data)
        self.check()

    def check(self) -> None:
        allocator, model = self.allocator, self.model
        assert allocator.free_page_ids().tolist() == model.page_ids()
        assert allocator.available_size() == len(model.page_ids()) * self.ps
        owned = {s // self.ps for req in self.requests for s in req.slots}
        assert allocator.in_use_tokens == len(owned) * self.ps
        assert not owned & set(model.page_ids())
        for req in self.requests:
            assert self.req_to_token[req.row, : len(req.slots)].tolist() == req.slots
            assert all(s % self.ps == t % self.ps for t, s in enumerate(req.slots))
        report = allocator.check_integrity()
        assert report.ok, str(report)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    data=st.data(),
    page_size=st.sampled_from([1, 2, 4, 16]),
    num_pages=st.integers(2, 10),
    need_sort=st.booleans(),
    num_steps=st.integers(1, 30),
)
def test_random_operations_match_the_free_list_model(data, page_size, num_pages, need_sort, num_steps):
    harness = Harness(page_size, num_pages, need_sort)
    harness.check()
    for _ in range(num_steps):
        harness.step(data)
