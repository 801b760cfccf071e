"""vLLM's free-block queue as an array with holes, against a plain list of the same operations:
the same order after every operation, through the window's moves to the middle of its array."""

import random

import numpy as np
import pytest

from memcli.errors import IntegrityError
from memcli.mem_cache import block_pool
from memcli.mem_cache.block_pool import FreeQueue


@pytest.mark.parametrize("vector_min", [1, 16, 1 << 30])
@pytest.mark.parametrize("seed", range(4))
def test_the_queue_keeps_the_linked_lists_order(monkeypatch, seed, vector_min):
    monkeypatch.setattr(block_pool, "VECTOR_MIN", vector_min)
    rng = random.Random(seed)
    n = 40
    queue, model = FreeQueue(n), list(range(n))
    out: list[int] = []  # blocks not queued
    for _ in range(3000):
        op = rng.random()
        if op < 0.35 and model:
            k = rng.randint(1, min(len(model), 20))
            got = queue.popleft_n(k)
            assert got == model[:k]
            del model[:k]
            out += got
        elif op < 0.5 and model:
            gone = rng.sample(model, rng.randint(1, min(len(model), 20)))
            if len(gone) == 1 or rng.random() < 0.5:
                for block in gone:
                    queue.remove(block)
            else:
                queue.remove_n(np.asarray(gone, dtype=np.int64))
            model = [b for b in model if b not in gone]
            out += gone
        elif out:
            back = rng.sample(out, rng.randint(1, min(len(out), 20)))
            out = [b for b in out if b not in back]
            if op < 0.75:
                queue.append_n(back)
                model += back
            else:
                queue.prepend_n(back)
                model[:0] = back
        assert queue.ids() == model and queue.num_free == len(model)
        assert all((b in queue) == (b in model) for b in range(n))


def test_taking_more_than_is_free_or_removing_an_unqueued_block_is_refused():
    queue = FreeQueue(4)
    queue.popleft_n(2)
    with pytest.raises(IntegrityError, match="ran out"):
        queue.popleft_n(3)
    with pytest.raises(IntegrityError, match="block 0 is not in the free queue"):
        queue.remove(0)
    with pytest.raises(IntegrityError, match="block 1 is not in the free queue"):
        queue.remove_n(np.asarray([3, 1], dtype=np.int64))
    assert queue.ids() == [2, 3]
