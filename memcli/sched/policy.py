"""Admission: waiting-queue order and the prefill budget.

The budget mirrors the reference's PrefillAdder: a prefill batch takes requests while the
pool (free + evictable, minus what running requests are expected to still decode) holds
their prompt and expected output, while `max_prefill_tokens` new tokens are not exceeded
(the first request is always allowed), and at most one request is chunked, its chunk cut
to a page multiple of `chunked_prefill_size`.
"""

from __future__ import annotations

import enum

from memcli.mem_cache.manager import MemoryManager
from memcli.mem_cache.pages import align_down, align_up


class AddResult(enum.Enum):
    CONTINUE = "continue"
    NO_TOKEN = "no_token"  # the pool is full: stop and mark the batch full
    OTHER = "other"  # an input or chunk budget is spent


def uses_lpm(queue: list, policy: str, memory: MemoryManager) -> bool:
    """LPM needs a sharing cache; above 128 waiting requests it falls back to FCFS."""
    return policy == "lpm" and memory.sharing and len(queue) <= 128


def order_waiting(queue: list, policy: str, memory: MemoryManager) -> list:
    """FCFS keeps arrival order. LPM matches every waiting request (setting its prefix) and
    puts the longest match first (stable)."""
    if not uses_lpm(queue, policy, memory):
        return queue
    for req in queue:
        req.init_next_round_input(memory)
    return sorted(queue, key=lambda r: -len(r.prefix_indices))


def remaining_output_offset(reqs: list, ratio: float, clip: int, ignore_eos_whole: bool = False) -> float:
    """`sum(min(r.max_new_tokens - len(r.output_ids), clip) * w_r for r in reqs)`, w_r being
    `ratio`, or 1.0 for an `ignore_eos` request under `ignore_eos_whole`: the expected output
    the running requests still hold the pool for.

    Bit-identical to that expression: the same products, summed by `sum` in request order. The
    `min` is spelt as the comparison the builtin makes (`clip` only when `clip < left`), and
    the weight is hoisted when it is the same for every request: the call of `min` costs more
    than the rest of the term, and the sum is taken over every running request whenever a
    prefill batch is tried.
    """
    if ignore_eos_whole:
        return sum([(clip if clip < (left := r.max_new_tokens - len(r.output_ids)) else left)
                    * (1.0 if r.ignore_eos else ratio) for r in reqs])
    return sum([(clip if clip < (left := r.max_new_tokens - len(r.output_ids)) else left) * ratio for r in reqs])


class PrefillAdder:
    def __init__(self, memory: MemoryManager, running_reqs: list, new_token_ratio: float,
                 max_prefill_tokens: int, chunked_prefill_size: int | None, page_size: int, clip: int,
                 align_chunks: bool = True, budget: str = "none", chunk_instead: bool = False,
                 full_chunk: bool = False, ignore_eos_whole: bool = False):
        self.memory = memory
        self.align_chunks = align_chunks
        # SGLang 0.5.23's PrefillBudget: one page per request (semantics.admission_reserve:
        # page); with it, a long request chunked where 0.5.5 stopped (rem_input_gate: chunk)
        # and a whole chunk for a continuation the budget leaves nothing (chunk_progress).
        self.reserve = page_size if budget == "page" else 0
        self.chunk_instead = chunk_instead
        self.full_chunk = full_chunk
        self.page_size = page_size
        self.clip = clip
        self.rem_input_tokens = max_prefill_tokens
        self.rem_chunk_tokens = chunked_prefill_size
        # A running request's remaining output times the ratio; under 0.5.23 whole for an
        # `ignore_eos` request (semantics.ignore_eos_ratio: one).
        self.rem_total_token_offset = remaining_output_offset(running_reqs, new_token_ratio, clip, ignore_eos_whole)
        self.can_run_list: list = []
        self.new_chunked_req = None
        # What SGLang's scheduler logs for the batch: #cached-token (prefixes of the requests
        # added; 0 for a chunked request's next piece) and #new-token (their extends in pages).
        self.log_hit_tokens = 0
        self.log_input_tokens = 0

    @property
    def rem_total_tokens(self) -> float:
        u = self.memory.usage()
        return u.available + u.evictable - self.rem_total_token_offset

    def _update_budget(self, extend_len: int, max_new: int, prefix_len: int = 0) -> None:
        extend = align_up(extend_len, self.page_size)
        self.log_hit_tokens += prefix_len
        self.log_input_tokens += extend
        self.rem_total_token_offset += extend + max_new + self.reserve
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
        if self.reserve:
            return self._add_chunked_req_budget(req)
        return self._add_chunked_req(req)

    def _add_chunked_req_budget(self, req):
        """0.5.23: what the budget allows, and the whole chunk when it allows nothing (the
        piece must progress to free its KV); one page reserved with it."""
        room = int(self.rem_total_tokens)
        if self.rem_chunk_tokens is not None:
            room = min(room, self.rem_chunk_tokens) if room > 0 or not self.full_chunk else self.rem_chunk_tokens
        return self._schedule_piece(req, room)

    def _schedule_piece(self, req, room: int):
        """Schedule up to `room` tokens of the chunked request (none when `room <= 0`); returns
        (the request while still truncated, whether a piece was scheduled)."""
        if room <= 0:
            return req, False
        truncated = req.extend_input_len > room
        req.extend_input_len = min(req.extend_input_len, room)
        req.fill_ids = req.fill_ids[: req.prefix_indices.shape[0] + req.extend_input_len]
        self.can_run_list.append(req)
        self._update_budget(req.extend_input_len, 0 if truncated else min(req.max_new_tokens, self.clip))
        return (req if truncated else None), True

    def _add_chunked_req(self, req):
        """Schedule the next piece of the request being chunked; returns it while still truncated.

        The piece is what the budget allows, floored to a page with `align_chunks` (SGLang
        does not floor it). With no room at all it is not scheduled (SGLang would schedule an
        empty or negative piece)."""
        room = int(self.rem_total_tokens)
        if self.rem_chunk_tokens is not None:
            room = min(room, self.rem_chunk_tokens)
        if self.align_chunks:
            room = align_down(room, self.page_size)
        return self._schedule_piece(req, room)

    def add_one_req_budget(self, req, has_chunked: bool = False) -> AddResult:
        """SGLang 0.5.23's admission (`_select_prefill_admission` over `PrefillBudget`): the
        prefix locked, prompt + expected output + one page must fit; with chunked prefill a
        request longer than the chunk budget is chunked (its end floored to a page), whatever
        the input budget and whether another request is being chunked. A host hit (hiradix)
        counts as cached for the shape; it is then loaded back (all or none, the lock moving
        to the new last node), and when nothing loads the shape is chosen again without it."""
        max_new = min(max(req.max_new_tokens - len(req.output_ids), 0), self.clip)
        memory = self.memory
        memory.lock(req.last_node)
        shape = self._budget_shape(req, max_new, req.host_hit_length, has_chunked)
        if not isinstance(shape, AddResult) and req.host_hit_length > 0 and memory.load_back(req) == 0:
            shape = self._budget_shape(req, max_new, 0, has_chunked)
        if isinstance(shape, AddResult):
            memory.unlock(req.last_node)
            return shape
        prefix = req.prefix_indices.shape[0]
        extend, chunked = shape
        req.extend_input_len = extend
        if chunked:
            max_new = 0
            req.fill_ids = req.fill_ids[: prefix + extend]
            self.new_chunked_req = req
        self.can_run_list.append(req)
        self._update_budget(req.extend_input_len, max_new, prefix)
        return self.budget_state()

    def _budget_shape(self, req, max_new: int, host_hit: int, has_chunked: bool):
        """0.5.23's `_select_prefill_admission` with `host_hit` tokens counted as cached: the
        (extend, chunked) shape, or the AddResult that refuses the request."""
        ps = self.page_size
        held = req.prefix_indices.shape[0]
        full, prefix = len(req.fill_ids), held + host_hit
        if full - held + max_new + ps >= self.rem_total_tokens:
            return AddResult.NO_TOKEN
        extend = full - prefix
        paged = align_up(extend, ps)
        gate_input = self.rem_chunk_tokens is None or not self.chunk_instead
        if gate_input and self.can_run_list and paged >= self.rem_input_tokens:
            return AddResult.OTHER
        if self.rem_chunk_tokens is not None and paged > self.rem_chunk_tokens:
            extend = align_down(prefix + align_down(self.rem_chunk_tokens, ps), ps) - prefix
            if extend <= 0 or (has_chunked and not self.chunk_instead):
                return AddResult.OTHER
            return extend, True
        return extend, False

    def add_one_req(self, req, has_chunked_req: bool) -> AddResult:
        """Admit `req` if the budgets allow, locking its prefix. A match with a host-only part
        (hiradix) is loaded back first (`init_load_back`): its prefix grows by what was loaded,
        and the lock moves to the new last node. Before the lock, the input budget counts the
        host hit as cached (SGLang's `real_input_tokens`)."""
        max_new = min(max(req.max_new_tokens - len(req.output_ids), 0), self.clip)
        total = req.extend_input_len + max_new
        if total >= self.rem_total_tokens:
            return AddResult.NO_TOKEN
        real_input = align_up(req.extend_input_len - req.host_hit_length, self.page_size)
        if real_input >= self.rem_input_tokens and self.can_run_list:
            return AddResult.OTHER
        memory = self.memory
        memory.lock(req.last_node)
        if total >= self.rem_total_tokens:  # locking moved the prefix out of evictable
            memory.unlock(req.last_node)
            return AddResult.NO_TOKEN
        if req.host_hit_length > 0 and memory.load_back(req):
            req.extend_input_len = len(req.fill_ids) - len(req.prefix_indices)
        extend = align_up(req.extend_input_len, self.page_size)
        if extend >= self.rem_input_tokens and self.can_run_list:
            memory.unlock(req.last_node)
            return AddResult.OTHER
        if self.rem_chunk_tokens is None or extend <= self.rem_chunk_tokens:
            self.can_run_list.append(req)
            self._update_budget(req.extend_input_len, max_new, len(req.prefix_indices))
            return self.budget_state()
        trunc = align_down(self.rem_chunk_tokens, self.page_size)
        if trunc <= 0 or has_chunked_req:
            memory.unlock(req.last_node)
            return AddResult.OTHER
        req.extend_input_len = trunc
        req.fill_ids = req.fill_ids[: len(req.prefix_indices) + trunc]
        self.can_run_list.append(req)
        self.new_chunked_req = req
        self._update_budget(trunc, 0, len(req.prefix_indices))
        return self.budget_state()


class AdmissionGate:
    """Whether a step may admit new requests, and how many.

    `every_step` (memcli): every step builds a fresh budget, and admits while
    running + admitted (+ the chunked request) stay under `max_running`.

    `batch_is_full` (SGLang 0.5.5's `running_batch.batch_is_full`): the flag is set when the
    request limit is reached or the pool budget says NO_TOKEN; while it is set, only a chunked
    request's next piece runs. It is cleared only when a batch shrinks: a prefill batch whose
    requests finished or whose chunked request left it, or a decode batch that lost requests
    (finished or retracted). Requests that finished in a decode step still count against the
    limit until the next decode update (or idle step) filters them out (`lagging`).
    """

    def __init__(self, kind: str, max_running: int):
        if kind not in ("every_step", "batch_is_full", "batch_is_full_relaxed"):
            raise ValueError(f"admission gate {kind!r}: unknown")
        self.sglang = kind != "every_step"
        # SGLang 0.5.23: the running batch is filtered at the start of every step (finished
        # requests leave it, and a shrink clears the flag), an empty running batch clears it,
        # and NO_TOKEN sets it only when something runs or was admitted.
        self.relaxed = kind == "batch_is_full_relaxed"
        self.max_running = max_running
        self.full = False
        self.lagging = 0

    def may_try(self, has_waiting: bool, has_chunked: bool, num_running: int) -> bool:
        """Before a prefill batch is built: is there anything to try?"""
        if self.relaxed:
            self.decode_filtered()
            if num_running == 0:
                self.full = False
        if self.sglang:
            if (self.full or not has_waiting) and not has_chunked:
                return False
            if self.max_running - (num_running + self.lagging) <= 0 and not has_chunked:
                self.full = True
                return False
            return True
        return (has_waiting or has_chunked) and (num_running < self.max_running or has_chunked)

    def has_room(self, num_running: int, num_admitted: int, has_chunked: bool) -> bool:
        """Before each waiting request: may one more be admitted?"""
        if self.sglang:
            if num_admitted >= self.max_running - (num_running + self.lagging):
                if self.relaxed and num_running == 0:
                    return False  # 0.5.23: the flag of an empty running batch, which this prefill replaces
                self.full = True
            return not self.full
        return num_running + num_admitted + has_chunked < self.max_running

    def stopped(self, result: AddResult, hierarchical: bool = False, num_admitted: int = 0,
                num_running: int = 0) -> None:
        """The budget refused a request. With a host tier (SGLang's hierarchical cache) the
        pool budget closes the gate only when something was admitted or is running."""
        if self.sglang and result == AddResult.NO_TOKEN:
            if self.relaxed:  # set on an empty running batch, the flag goes with it when this prefill replaces it
                self.full = num_running > 0
            else:
                self.full = (num_admitted > 0 or num_running > 0) if hierarchical else True

    def shrank(self) -> None:
        """A prefill or decode batch lost requests."""
        self.full = False

    def finished_in_decode(self, num: int) -> None:
        if self.sglang:
            self.lagging += num

    def quiet(self, has_waiting: bool, has_chunked: bool) -> bool:
        """`may_try` would answer False, and change nothing, for as many steps as the inputs
        stay these (a running batch that neither shrinks nor empties)."""
        if has_chunked:
            return False
        if self.sglang:
            return (self.full or not has_waiting) and not self.lagging
        return not has_waiting

    def decode_filtered(self) -> None:
        """The decode update (or an idle step) dropped the finished requests of the last decode."""
        if self.lagging:
            self.lagging = 0
            self.full = False
