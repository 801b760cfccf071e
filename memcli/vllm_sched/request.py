"""A request as vLLM 0.33's scheduler and KV-cache manager see it (`vllm/v1/request.py`),
plus the fields memcli's reports harvest from every engine's requests."""

from __future__ import annotations

from array import array
from typing import Optional

import numpy as np

WAITING, RUNNING, PREEMPTED = "waiting", "running", "preempted"
FINISHED_LENGTH, FINISHED_ABORTED = "finished_length", "finished_aborted"


class VllmRequest:
    """Prompt and outputs in `all_token_ids` (an `array("q")`); `num_computed_tokens` of them have K/V.

    `extra_keys` are the first block's extra hash keys: vLLM's `("cache_salt", salt)` for a
    trace request with an `extra_key`, else None. `priority` is vLLM's (smaller first; read
    by the priority policy only, 0 by default) and `arrival_time` its arrival on memcli's clock."""

    __slots__ = ("request_id", "all_token_ids", "num_prompt_tokens", "num_computed_tokens", "status",
                 "num_preemptions", "block_hashes", "extra_keys", "max_tokens", "priority", "arrival_time",
                 "skip_reading_prefix_cache", "output_ids", "arrival_ms", "first_cached_tokens", "admit_ms",
                 "finish_ms", "finished", "aborted", "num_output_placeholders", "num_cached_tokens",
                 "extra_key", "seq", "num_in_flight_tokens", "num_stale_output_tokens",
                 "is_prefill_chunk")

    def __init__(self, rid: str, input_ids, max_new_tokens: int, extra_key: Optional[str] = None,
                 arrival_ms: float = 0.0, priority: int = 0, seq: int = 0):
        self.request_id = rid
        # Machine integers (`array("q")`): a prompt arrives as an int array, copied in as bytes
        # with no Python int per token; appends, slices and `len` are a list's.
        if isinstance(input_ids, np.ndarray):
            self.all_token_ids = array("q", np.ascontiguousarray(input_ids, dtype=np.int64).tobytes())
        else:
            self.all_token_ids = array("q", input_ids)
        self.num_prompt_tokens = len(self.all_token_ids)
        self.num_computed_tokens = 0
        self.status = WAITING
        self.num_preemptions = 0
        self.block_hashes: list[bytes] = []
        self.extra_key = extra_key
        self.extra_keys = (("cache_salt", extra_key),) if extra_key else None
        self.max_tokens = max_new_tokens
        self.priority, self.arrival_time, self.seq = priority, arrival_ms, seq
        self.skip_reading_prefix_cache = False
        self.output_ids: list[int] = []
        self.arrival_ms = arrival_ms
        self.first_cached_tokens: Optional[int] = None
        self.admit_ms: Optional[float] = None
        self.finish_ms: Optional[float] = None
        self.finished = self.aborted = False
        self.num_output_placeholders = 0  # async loop: tokens sampled by steps still in flight
        self.num_in_flight_tokens = 0  # tokens scheduled by steps whose output is not processed yet
        self.num_stale_output_tokens = 0  # in-flight tokens of a step scheduled before a preemption
        self.is_prefill_chunk = False
        self.num_cached_tokens = -1  # vLLM's: the hit of the first admission

    # memcli's reports
    @property
    def rid(self) -> str:
        return self.request_id

    @property
    def input_len(self) -> int:
        return self.num_prompt_tokens

    @property
    def retraction_count(self) -> int:
        return self.num_preemptions

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_tokens_with_spec(self) -> int:
        return len(self.all_token_ids)

    def __lt__(self, other: "VllmRequest") -> bool:
        """vLLM's `Request.__lt__`: priority, then arrival time, then request id (the order of
        the priority policy's waiting heap)."""
        if self.priority != other.priority:
            return self.priority < other.priority
        if self.arrival_time != other.arrival_time:
            return self.arrival_time < other.arrival_time
        if self.request_id != other.request_id:
            return self.request_id < other.request_id
        return self.seq < other.seq

    @property
    def is_finished(self) -> bool:
        return self.status.startswith("finished")

    def __repr__(self) -> str:
        return f"VllmRequest({self.request_id}, {self.status}, {self.num_computed_tokens}/{self.num_tokens})"
