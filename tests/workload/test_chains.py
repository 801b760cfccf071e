"""A prompt's chained block values read from the trie's shared prefixes equal the values
computed from its own tokens, for every request of the bundled head and block sizes that
divide the trace's blocks, straddle them or exceed them."""

import hashlib
from pathlib import Path

import pytest

from memcli.mem_cache.block_pool import block_hashes, none_hash
from memcli.workload.chains import SharedPrefixChains
from memcli.workload.readers import read_trace

HEAD = Path("tests/data/conversation_head300.jsonl")


def _chain(tokens, size: int, start: int, parent):
    """A chain of blake2b digests over each block's tokens (as vLLM's hashes chain SHA-256)."""
    out, prev = [], parent or b""
    for i in range(start, len(tokens) // size):
        prev = hashlib.blake2b(prev + tokens[i * size:(i + 1) * size].tobytes(), digest_size=16).digest()
        out.append(prev)
    return out


@pytest.mark.parametrize("size", [16, 48, 64, 512, 1024])
def test_every_prompt_gets_its_own_chain(size):
    trace = read_trace(HEAD)
    chains = SharedPrefixChains(trace, size)
    for spec in trace.requests:
        tokens = spec.input_ids()
        asked = []

        def compute(start, parent, tokens=tokens):
            asked.append(start)
            return _chain(tokens, size, start, parent)

        got = chains.prompt_values(spec.rid, len(tokens) // size, compute)
        assert got == _chain(tokens, size, 0, None), spec.rid
    assert chains.read > 0 and chains.computed > 0
    assert chains.read + chains.computed == sum(spec.input_len // size for spec in trace.requests)
    assert chains.kept == {}  # every node's last user let its values go


def test_vllm_hashes_through_the_chains_are_vllms():
    trace = read_trace(HEAD, limit=120)
    chains, root = SharedPrefixChains(trace, 16), none_hash()
    for spec in trace.requests:
        tokens = spec.input_ids()
        got = chains.prompt_values(spec.rid, len(tokens) // 16,
                                   lambda start, parent, t=tokens: block_hashes(t, 16, start, parent, None, root))
        assert got == block_hashes(tokens, 16, 0, None, None, root)
    assert chains.read > 0


def test_a_request_the_trace_does_not_name_is_not_answered():
    chains = SharedPrefixChains(read_trace(HEAD, limit=5), 16)
    assert chains.prompt_values("not-in-the-trace", 4, lambda start, parent: []) is None
