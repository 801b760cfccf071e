"""vLLM 0.33's waiting queue under `--scheduling-policy priority`
(`vllm/v1/core/sched/request_queue.py`, `PriorityRequestQueue`): a heap ordered by
`Request.__lt__`, i.e. (priority, arrival time, request id); a smaller priority is served first.

FCFS keeps the scheduler's plain deque; this class offers the part of the deque's surface the
scheduler uses, with vLLM's priority meaning: every way in (`append`, `appendleft`,
`extendleft`) pushes onto the heap ("there is no concept of prepending" in vLLM's words), and
the front is the heap's least request.
"""

from __future__ import annotations

import heapq
from collections import deque
from typing import Iterable, Iterator


class PriorityWaiting:
    """The heap of waiting requests, plus the arrival times of the requests added and not yet
    known to have arrived (requests are added in arrival order), so that the scheduler can
    count the arrived ones without scanning the heap."""

    def __init__(self) -> None:
        self._heap: list = []
        self._arrivals: deque = deque()

    def append(self, req) -> None:
        """A new request (vLLM's `add_request`)."""
        heapq.heappush(self._heap, req)
        self._arrivals.append(req.arrival_ms)

    def appendleft(self, req) -> None:
        """A preempted request back (vLLM's `prepend_request`: a push)."""
        heapq.heappush(self._heap, req)

    def extendleft(self, reqs: Iterable) -> None:
        """Requests skipped in a step back (vLLM's `prepend_requests`: pushes)."""
        for req in reqs:
            heapq.heappush(self._heap, req)

    def popleft(self):
        return heapq.heappop(self._heap)

    def __getitem__(self, index: int):
        if index != 0:
            raise IndexError("a priority queue shows its front only")
        return self._heap[0]

    def remove(self, req) -> None:
        self._heap.remove(req)
        heapq.heapify(self._heap)

    def arrived(self, clock_ms: float) -> int:
        """Waiting requests that have arrived by `clock_ms` (the clock never goes back, and a
        request leaves the queue only once it has arrived)."""
        arrivals = self._arrivals
        while arrivals and arrivals[0] <= clock_ms:
            arrivals.popleft()
        return len(self._heap) - len(arrivals)

    def __len__(self) -> int:
        return len(self._heap)

    def __bool__(self) -> bool:
        return bool(self._heap)

    def __iter__(self) -> Iterator:
        """In service order, as vLLM's iteration."""
        return iter(sorted(self._heap))
