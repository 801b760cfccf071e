"""Admission: waiting-queue order and the prefill budget.

The budget mirrors the reference's PrefillAdder: a prefill batch takes requests while the
pool (free + evictable, minus what running requests are expected to still decode) holds
their prompt and expected output, while `max_prefill_tokens` new tokens are not exceeded
(the first request is always allowed), and at most one request is chunked, its chunk cut
to a page multiple of `chunked_prefill_size`.
"""

from __future__ import annotations

import enum

from memcli.mem_cache import common
from memcli.mem_cache.pages import align_down, align_up


class AddResult(enum.Enum):
    CONTINUE = "continue"
    NO_TOKEN = "no_token"  # the pool is full: stop and mark the batch full
    OTHER = "other"  # an input or chunk budget is spent


def uses_lpm(queue: list, policy: str, tree_cache) -> bool:
    """LPM needs a sharing cache; above 128 waiting requests it falls back to FCFS."""
    return policy == "lpm" and not tree_cache.disable and len(queue) <= 128


def order_waiting(queue: list, policy: str, tree_cache) -> list:
    """FCFS keeps arrival order. LPM matches every waiting request (setting its prefix) and
    puts the longest match first (stable)."""
    if not uses_lpm(queue, policy, tree_cache):
        return queue
    for req in queue:
        req.init_next_round_input(tree_cache)
    return sorted(queue, key=lambda r: -len(r.prefix_indices))


class PrefillAdder:
    def __init__(self, tree_cache, allocator, running_reqs: list, new_token_ratio: float,
                 max_prefill_tokens: int, chunked_prefill_size: int | None, page_size: int, clip: int):
        self.tree_cache = tree_cache
        self.allocator = allocator
        self.page_size = page_size
        self.clip = clip
        self.rem_input_tokens = max_prefill_tokens
        self.rem_chunk_tokens = chunked_prefill_size
        self.rem_total_token_offset = sum(
            min(r.max_new_tokens - len(r.output_ids), clip) * new_token_ratio for r in running_reqs
        )
        self.can_run_list: list = []
        self.new_chunked_req = None

    @property
    def rem_total_tokens(self) -> float:
        u = common.usage(self.tree_cache, self.allocator)
        return u.available + u.evictable - self.rem_total_token_offset

    def _update_budget(self, extend_len: int, max_new: int) -> None:
        extend = align_up(extend_len, self.page_size)
        self.rem_total_token_offset += extend + max_new
        self.rem_input_tokens -= extend
        if self.rem_chunk_tokens is not None:
            self.rem_chunk_tokens -= extend

    def budget_state(self) -> AddResult:
        if self.rem_total_tokens <= 0:
            return AddResult.NO_TOKEN
        if self.rem_input_tokens <= 0 or (self.rem_chunk_tokens is not None and self.rem_chunk_tokens <= 0):
            return AddResult.OTHER
        return AddResult.CONTINUE

    def add_chunked_req(self, req):
        """Schedule the next piece of the request being chunked; returns it while still truncated."""
        room = int(self.rem_total_tokens)
        if self.rem_chunk_tokens is not None:
            room = min(room, self.rem_chunk_tokens)
        room = align_down(room, self.page_size)
        if room <= 0:
            return req, False
        truncated = req.extend_input_len > room
        req.extend_input_len = min(req.extend_input_len, room)
        req.fill_ids = req.fill_ids[: len(req.prefix_indices) + req.extend_input_len]
        self.can_run_list.append(req)
        self._update_budget(req.extend_input_len, 0 if truncated else min(req.max_new_tokens, self.clip))
        return (req if truncated else None), True

    def add_one_req(self, req, has_chunked_req: bool) -> AddResult:
        max_new = min(max(req.max_new_tokens - len(req.output_ids), 0), self.clip)
        total = req.extend_input_len + max_new
        if total >= self.rem_total_tokens:
            return AddResult.NO_TOKEN
        extend = align_up(req.extend_input_len, self.page_size)
        if extend >= self.rem_input_tokens and self.can_run_list:
            return AddResult.OTHER
        self.tree_cache.inc_lock_ref(req.last_node)
        if total >= self.rem_total_tokens:  # locking moved the prefix out of evictable
            self.tree_cache.dec_lock_ref(req.last_node)
            return AddResult.NO_TOKEN
        if self.rem_chunk_tokens is None or extend <= self.rem_chunk_tokens:
            self.can_run_list.append(req)
            self._update_budget(req.extend_input_len, max_new)
            return self.budget_state()
        trunc = align_down(self.rem_chunk_tokens, self.page_size)
        if trunc <= 0 or has_chunked_req:
            self.tree_cache.dec_lock_ref(req.last_node)
            return AddResult.OTHER
        req.extend_input_len = trunc
        req.fill_ids = req.fill_ids[: len(req.prefix_indices) + trunc]
        self.can_run_list.append(req)
        self.new_chunked_req = req
        self._update_budget(trunc, 0)
        return self.budget_state()
