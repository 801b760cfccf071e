"""A request as the scheduler sees it: tokens, lengths, and what it holds in memory.

Positions of a request row in `req_to_token`:

    [0, last_matched_prefix_len)                 slots owned by the tree (locked via last_node)
    [last_matched_prefix_len, kv_allocated_len)  slots the request owns (freed on finish)
    [0, kv_committed_len)                        positions whose K/V has been computed

Who writes which field (memory code writes only what SGLang's tree caches write):

    sched (Req, ScheduleBatch, policy, scheduler)  everything else; the batch applies the
                                                   `ExtendAllocation` (req_pool_idx,
                                                   kv_allocated_len) and decode steps
    tree cache `cache_unfinished_req`              prefix_indices, last_node,
                                                   last_matched_prefix_len
    tree cache `cache_finished_req`                kv_freed (also `common.release_reqs`,
                                                   its batched form)
    bench-one-batch (restoring a snapshot)         the fields a snapshot puts back
"""

from __future__ import annotations

import numpy as np
import torch

from memcli.mem_cache.base_prefix_cache import RadixKey


class Req:
    def __init__(self, rid: str, input_ids: np.ndarray, max_new_tokens: int, device: torch.device,
                 extra_key: str | None = None, arrival_ms: float = 0.0):
        self.rid = rid
        self.origin_input_ids = np.asarray(input_ids, dtype=np.int64)
        self.max_new_tokens = max_new_tokens
        self.extra_key = extra_key
        self.arrival_ms = arrival_ms
        self.device = device
        self.output_ids: list[int] = []
        self.fill_ids = self.origin_input_ids
        self.prefix_indices = torch.empty(0, dtype=torch.int64, device=device)
        self.last_node = None
        self.last_matched_prefix_len = 0
        # Host tier (hiradix): the match's host-only part, and what was loaded back so far.
        self.last_host_node = None
        self.host_hit_length = 0
        self.host_loaded_len = 0  # tokens loaded back for this request before its first admission
        self.host_skipped_len = 0  # this round's host hit that was not loaded (threshold, quota, room)
        self.first_host_skipped: int | None = None  # host_skipped_len of the round that first admitted it
        self.extend_input_len = 0
        self.req_pool_idx: int | None = None
        self.kv_allocated_len = 0
        self.kv_committed_len = 0
        self.kv_freed = False
        self.finished = False
        self.aborted = False
        self.retraction_count = 0
        self.is_retracted = False  # retracted and not prefilled again since (read by overlap results)
        self.first_cached_tokens: int | None = None
        self.admit_ms: float | None = None
        self.finish_ms: float | None = None

    @property
    def input_len(self) -> int:
        return len(self.origin_input_ids)

    @property
    def seqlen(self) -> int:
        return len(self.origin_input_ids) + len(self.output_ids)

    def token_ids(self, n: int) -> np.ndarray:
        """The first `n` tokens of prompt + output."""
        if n <= len(self.origin_input_ids):
            return self.origin_input_ids[:n]
        out = np.asarray(self.output_ids[: n - len(self.origin_input_ids)], dtype=np.int64)
        return np.concatenate([self.origin_input_ids, out])

    def init_next_round_input(self, tree_cache=None) -> None:
        """Set `fill_ids` and match the prefix.

        The match is capped at `len(fill_ids) - 1` before matching: at least one token is
        computed so the round produces logits.
        """
        self.fill_ids = self.token_ids(self.seqlen)
        if tree_cache is not None:
            max_prefix_len = max(len(self.fill_ids) - 1, 0)
            match = tree_cache.match_prefix(RadixKey(self.fill_ids[:max_prefix_len], self.extra_key))
            self.prefix_indices, self.last_node = match.device_indices, match.last_node
            self.last_host_node, self.host_hit_length = match.last_host_node, match.host_hit_length
            self.host_skipped_len = 0
            self.last_matched_prefix_len = len(self.prefix_indices)
        self.extend_input_len = len(self.fill_ids) - len(self.prefix_indices)

    def reset_for_retract(self) -> None:
        """Back to the waiting state after its memory was released."""
        self.retraction_count += 1
        self.is_retracted = True
        self.prefix_indices = torch.empty(0, dtype=torch.int64, device=self.device)
        self.last_node = None
        self.last_host_node = None
        self.host_hit_length = 0
        self.last_matched_prefix_len = 0
        self.extend_input_len = 0
        self.req_pool_idx = None
        self.kv_allocated_len = 0
        self.kv_committed_len = 0
        self.kv_freed = False

    def __repr__(self) -> str:
        return (f"Req({self.rid!r}, input={self.input_len}, output={len(self.output_ids)}/{self.max_new_tokens},"
                f" allocated={self.kv_allocated_len})")
