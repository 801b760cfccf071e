"""A request as the scheduler sees it: tokens, lengths, progress, and its memory record.

What the request holds in memory is `req.kv` (`memcli.mem_cache.manager.ReqKV`), which only
memory writes; the names below that mirror it (`req_pool_idx`, `prefix_indices`,
`kv_allocated_len`, ...) are read-only. Everything else is the scheduler's.
"""

from __future__ import annotations

from array import array
from operator import attrgetter

import numpy as np
import torch

from memcli.mem_cache.manager import ReqKV


def _mirror(name: str) -> property:
    # attrgetter reads `self.kv.<name>` in one C call: these are read on the hot path.
    return property(attrgetter(f"kv.{name}"), doc=f"`kv.{name}` (read-only: memory writes it)")


def _holds_prompt(buf: np.ndarray, prompt: np.ndarray) -> bool:
    """`prompt` is `buf[:len(prompt)]` and `buf` is longer: a token buffer with room for outputs."""
    return (buf.ndim == 1 and buf.dtype == np.int64 and buf.shape[0] > prompt.shape[0] and prompt.strides == (8,)
            and buf.__array_interface__["data"][0] == prompt.__array_interface__["data"][0])


class Req:
    # Slots: the fields sit in the object itself, which the running batch's per-step passes
    # read for every request (no per-instance dict to reach through).
    __slots__ = ("rid", "origin_input_ids", "input_len", "max_new_tokens", "extra_key", "arrival_ms", "ignore_eos",
                 "eos_len", "device", "kv", "output_ids", "_tokens", "_tokens_of", "_tokens_out", "fill_ids",
                 "first_host_skipped", "extend_input_len", "finished", "aborted", "retraction_count", "is_retracted",
                 "first_cached_tokens", "admit_ms", "finish_ms")

    def __init__(self, rid: str, input_ids: np.ndarray, max_new_tokens: int, device: torch.device,
                 extra_key: str | None = None, arrival_ms: float = 0.0):
        self.rid = rid
        self.origin_input_ids = np.asarray(input_ids, dtype=np.int64)
        self.input_len = len(self.origin_input_ids)  # the prompt is never replaced: its length is kept
        self.max_new_tokens = max_new_tokens
        self.extra_key = extra_key
        self.arrival_ms = arrival_ms
        self.ignore_eos = False  # SGLang's sampling_params.ignore_eos (the trace's; set by the replay)
        self.eos_len = -1  # the output length whose last token is EOS (-1: never; set by the replay)
        self.device = device
        self.kv = ReqKV(device)
        # The output tokens as machine integers (`array("q")`): a run's tokens are copied in as
        # bytes, and read into the token buffer as a buffer, with no Python int per token.
        self.output_ids: array = array("q")
        self._tokens: np.ndarray | None = None  # prompt + outputs, for `token_ids` past the prompt
        self._tokens_of: array | list | None = None  # the output list `_tokens` copies
        self._tokens_out = 0  # outputs copied into `_tokens`
        buf = self.origin_input_ids.base
        if buf is not None and _holds_prompt(buf, self.origin_input_ids):
            # The prompt is the start of a buffer with room after it (`RequestSpec.input_ids(room)`):
            # that buffer is the one `token_ids` reads, the prompt never copied into another.
            self._tokens, self._tokens_of = buf, self.output_ids
        self.fill_ids = self.origin_input_ids
        self.first_host_skipped: int | None = None  # kv.host_skipped_len of the round that first admitted it
        self.extend_input_len = 0
        self.finished = False
        self.aborted = False
        self.retraction_count = 0
        self.is_retracted = False  # retracted and not prefilled again since (read by overlap results)
        self.first_cached_tokens: int | None = None
        self.admit_ms: float | None = None
        self.finish_ms: float | None = None

    req_pool_idx = _mirror("req_pool_idx")
    prefix_indices = _mirror("prefix_indices")
    last_node = _mirror("last_node")
    last_matched_prefix_len = _mirror("last_matched_prefix_len")
    last_host_node = _mirror("last_host_node")
    host_hit_length = _mirror("host_hit_length")
    host_loaded_len = _mirror("host_loaded_len")
    host_skipped_len = _mirror("host_skipped_len")
    kv_allocated_len = _mirror("kv_allocated_len")
    kv_committed_len = _mirror("kv_committed_len")
    kv_freed = _mirror("kv_freed")

    @property
    def seqlen(self) -> int:
        return self.input_len + len(self.output_ids)

    def token_ids(self, n: int) -> np.ndarray:
        """The first `n` tokens of prompt + output (a view: callers do not write it).

        Past the prompt the tokens come from one buffer that holds the prompt and the outputs
        copied so far: only the outputs added since the last call are copied (outputs are
        only ever appended), where joining prompt and outputs would copy the whole prompt
        every time a long request is checkpointed."""
        input_len = self.input_len
        if n <= input_len:
            return self.origin_input_ids[:n]
        out = self.output_ids
        n = min(n, input_len + len(out))
        buf = self._tokens
        if buf is None or self._tokens_of is not out or n > buf.shape[0]:
            buf = self._token_buffer(n)
        copied = input_len + self._tokens_out
        if n > copied:
            buf[copied:n] = out[copied - input_len : n - input_len]
            self._tokens_out = n - input_len
        return buf[:n]

    def _token_buffer(self, n: int) -> np.ndarray:
        """A new buffer for at least `n` tokens, holding the prompt (room doubles as outputs grow,
        up to `max_new_tokens`); a replaced output list is copied again from its start."""
        input_len = self.input_len
        room = max(n - input_len, min(self.max_new_tokens, max(64, 2 * (n - input_len))))
        buf = np.empty(input_len + room, dtype=np.int64)
        buf[:input_len] = self.origin_input_ids
        if self._tokens is not None and self._tokens_of is self.output_ids:
            kept = input_len + self._tokens_out
            buf[input_len:kept] = self._tokens[input_len:kept]
        else:
            self._tokens_out = 0
        self._tokens, self._tokens_of = buf, self.output_ids
        return buf

    def init_next_round_input(self, memory=None) -> None:
        """Set `fill_ids` and, with `memory` (a `MemoryManager`), match the prefix.

        The match is capped at `len(fill_ids) - 1` before matching: at least one token is
        computed so the round produces logits.
        """
        self.fill_ids = self.token_ids(self.seqlen)
        if memory is not None:
            max_prefix_len = max(len(self.fill_ids) - 1, 0)
            memory.match_prefix(self, self.fill_ids[:max_prefix_len])
        self.extend_input_len = len(self.fill_ids) - self.kv.prefix_indices.shape[0]

    def reset_for_retract(self) -> None:
        """Back to the waiting state (memory already emptied its record on release)."""
        self.retraction_count += 1
        self.is_retracted = True
        self.extend_input_len = 0

    def __repr__(self) -> str:
        return (f"Req({self.rid!r}, input={self.input_len}, output={len(self.output_ids)}/{self.max_new_tokens},"
                f" allocated={self.kv.kv_allocated_len})")
