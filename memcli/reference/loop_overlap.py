"""SGLang 0.5.5's overlap loop (`Scheduler.event_loop_overlap`, its default) over its real objects.

`OverlapReferenceLoop.step()` is one iteration of:

    receive arrivals -> batch = get_next_batch_to_run()
                     -> batch: run_batch(batch), result_queue.append(batch.copy())
                     -> last_batch: process_batch_result(result_queue.popleft())
                        else, no batch either: self_check_during_idle()
                     -> last_batch = batch

Everything but the loop and the memory side of the result processing is SGLang's own:
batches are built with `enable_overlap=True` (so `new_page_count_next_decode` counts
`seqlen % ps == 0` and `prepare_for_decode` makes new length tensors), and the queued copy is
`ScheduleBatch.copy()`. The result processing adds SGLang's overlap branches to the normal
loop's (`scheduler_output_processor_mixin.py`):

* prefill: a request retracted after launch that had produced outputs frees the slot at
  `seqlen - 1` of its row (the retraction freed only `seqlen - 1` positions);
* decode: a request finished or retracted after launch frees its slot in `out_cache_loc`,
  with ps > 1 only when `(seqlen - 1) % ps == 0` (the slot opened a page).

The loop is done when every request finished and no result is left to process.
"""

from __future__ import annotations

from collections import deque
from typing import Any, Optional, Sequence

from memcli.config import Config
from memcli.reference.loader import Reference
from memcli.reference.loop import ReferenceLoop
from memcli.workload.spec import RequestSpec


class OverlapReferenceLoop(ReferenceLoop):
    """`ReferenceLoop` stepping `event_loop_overlap`."""

    def __init__(self, config: Config, requests: Sequence[RequestSpec], arrivals: str = "burst",
                 output_token_base: int = 1 << 40, ref: Optional[Reference] = None):
        super().__init__(config, requests, arrivals, output_token_base, ref)
        self.enable_overlap = True
        self.result_queue: deque = deque()

    def is_done(self) -> bool:
        return super().is_done() and self.last_batch is None and not self.result_queue

    def step(self) -> None:
        """One iteration of `event_loop_overlap`."""
        with self._environment():
            batch = self._launch()
            if batch is not None:
                result = batch.copy()
                result.output_ids = batch.output_ids  # the sampled tokens (SGLang: the batch result)
                self.result_queue.append(result)
            if self.last_batch is not None:
                self.process_batch_result(self.result_queue.popleft())
            elif batch is None:
                self.self_check_during_idle()
            self.step_batch = batch
            self.last_batch = batch
        self.step_count += 1

    def _process_prefill(self, batch: Any, tokens: list[int]) -> None:
        for i, (req, token) in enumerate(zip(batch.reqs, tokens)):
            if req.is_retracted and len(req.output_ids) > 0:
                seq_len = len(req.origin_input_ids) + len(req.output_ids)
                row = batch.req_to_token_pool.req_to_token[batch.req_pool_indices[i]]
                self.allocator.free(row[seq_len - 1: seq_len])
                continue
            if not req.is_retracted:
                self._prefill_token(req, token)

    def _process_decode(self, batch: Any, tokens: list[int]) -> None:
        ps = self.config.page_size
        self.allocator.free_group_begin()
        for i, (req, token) in enumerate(zip(batch.reqs, tokens)):
            if req.finished() or req.is_retracted:
                if ps == 1 or (len(req.origin_input_ids) + len(req.output_ids) - 1) % ps == 0:
                    self.allocator.free(batch.out_cache_loc[i: i + 1])
                continue
            self._decode_token(req, token)
        self.allocator.free_group_end()


def reference_loop(config: Config, requests: Sequence[RequestSpec], arrivals: str = "burst",
                   output_token_base: int = 1 << 40, ref: Optional[Reference] = None) -> ReferenceLoop:
    """SGLang's loop in the mode of `semantics.event_loop`: overlap (its default) or normal."""
    cls = OverlapReferenceLoop if config.behaviour.event_loop == "overlap" else ReferenceLoop
    return cls(config, requests, arrivals, output_token_base, ref)
