"""The prefix-sharing ceiling of a trace, computed without the radix tree.

For request i (trace order), `shared_len[i]` is the longest prefix of its input that it shares,
token by token, with the input of any earlier request in the same `extra_key` namespace,
capped at `input_len - 1` (an engine always computes at least one token):

    shared_len[i] = min(max_{j < i} lcp(input_i, input_j), input_len_i - 1)

This is exactly what a cache that never evicts gives each request when the requests run one
after another: a finished request leaves its prompt and its output in the cache, and output
tokens are unique, so only earlier prompts can match. With pages of `ps` tokens the cache
holds every full page of every earlier prompt, and the hit is `shared_len` floored to a page.

Two exact computations, neither a tree of slots:

- Mooncake traces (`hash_ids`): a dict keyed by (parent block, hash id) per block, holding the
  furthest position any earlier request covered in that block. Cost O(blocks).
- memcli traces (token ids): the earlier prompts kept sorted as big-endian bytes; the
  longest common prefix with a set of strings is reached at a sorted neighbour.
"""

from __future__ import annotations

import bisect
from typing import Iterable

import numpy as np

from memcli.workload.spec import RequestSpec, Trace


def shared_prefix_lens(trace: Trace) -> np.ndarray:
    """`shared_len` of every request, int64, in trace order (see the module docstring)."""
    if trace.format == "mooncake":
        shared = _mooncake_lcp(trace.requests)
    else:
        shared = _token_lcp(trace.requests)
    caps = np.fromiter((r.input_len - 1 for r in trace.requests), dtype=np.int64, count=trace.num_requests)
    return np.minimum(shared, caps)


def _mooncake_lcp(requests: Iterable[RequestSpec]) -> np.ndarray:
    """Block-level walk: equal hash ids on equal paths mean equal tokens, up to the shorter
    request's length inside the last block."""
    children: dict[tuple[int, int], int] = {}
    covered_to: list[int] = [0]  # per block node: furthest token position an earlier request reached
    out = []
    for req in requests:
        bs, node, start, best = req.block_size, 0, 0, 0
        for h in req.hash_ids:
            end = min(start + bs, req.input_len)
            child = children.get((node, h))
            if child is None:
                child = len(covered_to)
                children[(node, h)] = child
                covered_to.append(end)
            else:
                best = max(best, min(end, covered_to[child]))
                covered_to[child] = max(covered_to[child], end)
            node, start = child, end
        out.append(best)
    return np.asarray(out, dtype=np.int64)


def _token_lcp(requests: Iterable[RequestSpec]) -> np.ndarray:
    sorted_inputs: dict[str | None, list[bytes]] = {}
    out = []
    for req in requests:
        keys = sorted_inputs.setdefault(req.extra_key, [])
        key = np.ascontiguousarray(req.input_ids(), dtype=">i8").tobytes()
        pos = bisect.bisect_left(keys, key)
        best = max((_common_prefix_len(key, other) for other in keys[max(pos - 1, 0) : pos + 1]), default=0)
        keys.insert(pos, key)
        out.append(best)
    return np.asarray(out, dtype=np.int64)


def _common_prefix_len(a: bytes, b: bytes) -> int:
    """Equal leading int64 tokens of two big-endian token strings."""
    n = min(len(a), len(b)) // 8
    diff = np.flatnonzero(np.frombuffer(a, ">i8", n) != np.frombuffer(b, ">i8", n))
    return int(diff[0]) if len(diff) else n
