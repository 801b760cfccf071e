"""The ceiling computation against a plain set of page-aligned prefixes."""

from __future__ import annotations

import numpy as np
import pytest

from memcli.mem_cache.pages import align_down
from memcli.tools.replay.ceiling import shared_prefix_lens
from memcli.workload.generate import generate_trace, write_trace
from memcli.workload.readers import read_trace
from memcli.workload.spec import RequestSpec, Trace

from tests.tools.replay.helpers import CONVERSATION, page_prefix_hits, shrink_mooncake


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_mooncake_ceiling_matches_prefix_set(tmp_path, page_size):
    trace = read_trace(shrink_mooncake(CONVERSATION, tmp_path / "t.jsonl", 120, block_size=24), block_size=24)
    expected = page_prefix_hits([r.input_ids() for r in trace.requests], page_size)
    assert align_down(shared_prefix_lens(trace), page_size).tolist() == expected


@pytest.mark.parametrize("page_size", [1, 8])
def test_memcli_ceiling_matches_prefix_set(tmp_path, page_size):
    records = generate_trace(60, seed=3, system_prompts=3, system_prompt_len=40, turns=3, input_len=12, output_len=4)
    write_trace(records, tmp_path / "g.jsonl")
    trace = read_trace(tmp_path / "g.jsonl")
    expected = page_prefix_hits([r.input_ids() for r in trace.requests], page_size)
    assert align_down(shared_prefix_lens(trace), page_size).tolist() == expected
    assert sum(expected) > 0


def _memcli(*prompts, extra_keys=None):
    keys = extra_keys or [None] * len(prompts)
    reqs = [RequestSpec.from_ids(str(i), ids, 1, extra_key=k) for i, (ids, k) in enumerate(zip(prompts, keys))]
    return Trace("mem.jsonl", "memcli", 4, reqs)


def test_token_level_cap_and_namespaces():
    trace = _memcli([1, 2, 3, 4, 5], [1, 2, 3, 9], [1, 2, 3, 4, 5], [1, 2, 3, 4, 5],
                    extra_keys=[None, None, None, "lora"])
    # Second: shares 3 tokens. Third: the whole prompt, capped at input_len - 1. Fourth: other namespace.
    assert shared_prefix_lens(trace).tolist() == [0, 3, 4, 0]


def test_mooncake_partial_last_block_shares_up_to_the_shorter_length():
    reqs = [
        RequestSpec("1", 10, 1, hash_ids=(7, 8, 9), block_size=4),   # blocks 4 + 4 + 2
        RequestSpec("2", 11, 1, hash_ids=(7, 8, 9), block_size=4),   # last block 3 long: shares 10
        RequestSpec("3", 6, 1, hash_ids=(7, 5), block_size=4),       # diverges at block 2
        RequestSpec("4", 12, 1, hash_ids=(1, 8, 9), block_size=4),   # same later ids, other path: nothing
    ]
    trace = Trace("m.jsonl", "mooncake", 4, reqs)
    assert shared_prefix_lens(trace).tolist() == [0, 10, 4, 0]
    assert np.array_equal(align_down(shared_prefix_lens(trace), 4), [0, 8, 4, 0])
