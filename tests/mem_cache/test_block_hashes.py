"""vLLM's chained block hashes: `block_hashes` builds each block's pickle bytes in numpy for
many blocks at once; every hash must be the SHA-256 of `pickle.dumps((parent, block, extra))`."""

import hashlib
import pickle
import random
from array import array

import numpy as np
import pytest

from memcli.mem_cache.block_pool import FAST_HASH_MIN_BLOCKS, block_hashes, none_hash

SALT = (("cache_salt", "s"),)
# Each pickle form of an int: BININT1, BININT2, BININT (negatives too), LONG1 past int32.
EDGES = [0, 1, 255, 256, 65535, 65536, 2**31 - 1, 2**31, -1, -2**31, -2**31 - 1, 10**12]


def pickled_chain(tokens, block_size, start=0, parent=None, first_extra=None):
    """The hashes as vLLM computes them, one pickle per block."""
    out, prev = [], none_hash() if parent is None else parent
    for i in range(start, len(tokens) // block_size):
        block = tuple(int(x) for x in tokens[i * block_size:(i + 1) * block_size])
        data = pickle.dumps((prev, block, first_extra if i == 0 else None), protocol=pickle.HIGHEST_PROTOCOL)
        prev = hashlib.sha256(data).digest()
        out.append(prev)
    return out


def tokens_of(rng, kind, n, block_size):
    if kind == "bininit":  # Mooncake's token ids: every block one layout
        return [rng.randrange(65536, 2**31) for _ in range(n)]
    if kind == "runs":  # runs of blocks of every form
        return [rng.randrange(65536, 2**31) if (i // (3 * block_size)) % 2 else rng.choice(EDGES) for i in range(n)]
    return [rng.choice(EDGES) if rng.random() < 0.3 else rng.randrange(0, 2**28) >> rng.randrange(0, 28)
            for _ in range(n)]


@pytest.mark.parametrize("block_size", [1, 3, 4, 5, 16])
@pytest.mark.parametrize("kind", ["bininit", "runs", "mixed"])
def test_block_hashes_are_the_pickles_hashes(block_size, kind):
    """Lists, int arrays and `array("q")` alike, from any block on (a parent given), with and
    without a salted first block, below and above the count hashed from built bytes."""
    rng = random.Random(f"{block_size}-{kind}")
    fast = 0
    for _ in range(25):
        n = rng.randrange(0, 40 * block_size)
        tokens = tokens_of(rng, kind, n, block_size)
        start = rng.randrange(0, max(1, n // block_size))
        parent = pickled_chain(tokens, block_size)[start - 1] if start else None
        extra = SALT if rng.random() < 0.3 else None
        want = pickled_chain(tokens, block_size, start, parent, extra)
        fast += block_size >= 4 and len(want) >= FAST_HASH_MIN_BLOCKS
        for form in (tokens, np.array(tokens, dtype=np.int64), array("q", tokens)):
            assert block_hashes(form, block_size, start, parent, extra) == want
    assert fast or block_size < 4  # the built bytes were exercised


def test_one_changed_token_changes_its_block_and_every_later_hash():
    tokens = list(range(70000, 70000 + 16 * 8))
    before = block_hashes(tokens, 16)
    tokens[16 * 3 + 5] = 300  # a BININT2 in block 3
    after = block_hashes(tokens, 16)
    assert after[:3] == before[:3] and all(a != b for a, b in zip(after[3:], before[3:]))
    assert after == pickled_chain(tokens, 16)
