"""The trace's future uses: which request next uses (and last used) a page, for both trace
formats, as admissions and retractions move the boundary."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from memcli.workload.future import FutureTooLarge, block_trie, build_future, check_future_fits
from memcli.workload.readers import read_trace
from memcli.workload.spec import RequestSpec, Trace, mooncake_token_ids


def mooncake(tmp_path, rows, block_size=4):
    path = tmp_path / "m.jsonl"
    path.write_text("".join(json.dumps({"timestamp": i, "input_length": n, "output_length": 1, "hash_ids": h}) + "\n"
                            for i, (n, h) in enumerate(rows)))
    return read_trace(path, block_size=block_size)


def path_handle(future, tokens, pieces=1):
    """Advance in `pieces` steps (the cache advances node by node)."""
    handle = future.start(None)
    for part in np.array_split(np.asarray(tokens, dtype=np.int64), pieces):
        handle = future.advance(handle, part)
    return handle


def test_mooncake_next_use_follows_the_hash_chain_and_the_match_cap(tmp_path):
    # 0: blocks 1,2 (8 tokens)  1: blocks 1,3  2: blocks 1,2 but only 6 tokens  3: blocks 1,2,5
    trace = mooncake(tmp_path, [(8, [1, 2]), (8, [1, 3]), (6, [1, 2]), (12, [1, 2, 5])])
    future = build_future(trace, page_size=1)
    tokens = mooncake_token_ids((1, 2, 5), 4, 12)
    at = lambda e, pieces=1: future.next_use(path_handle(future, tokens[:e], pieces))  # noqa: E731
    assert at(4) == 0 and at(5) == 0
    future.set_admitted(0, True)
    assert at(4) == 1  # request 1 shares block 1 only
    assert at(5) == 2 and at(5, pieces=3) == 2  # same handle, however it is reached
    assert at(6) == 3  # request 2 matches at most 5 tokens (input_len - 1)
    future.set_admitted(1, True), future.set_admitted(2, True), future.set_admitted(3, True)
    assert at(6) is None and future.last_use(path_handle(future, tokens[:6])) == 3
    future.set_admitted(2, False)  # retracted: it will match again
    assert at(5) == 2 and future.frontier == 2
    for end in (4, 5, 6, 8):  # an evicted leaf's pair, its users looked up once
        handle = path_handle(future, tokens[:end])
        assert future.last_and_next_use(handle) == (future.last_use(handle), future.next_use(handle))
    assert future.last_and_next_use(path_handle(future, tokens[:5])) == (3, 2)
    assert future.last_and_next_use(path_handle(future, tokens[:6])) == (3, None)
    assert future.last_and_next_use(None) == (None, None)


def test_mooncake_paths_that_leave_the_trace_have_no_users(tmp_path):
    trace = mooncake(tmp_path, [(8, [1, 2]), (8, [1, 2])])
    future = build_future(trace, page_size=1)
    tokens = mooncake_token_ids((1, 2), 4, 8)
    assert future.advance(future.start(None), np.append(tokens, 10_000)) is None  # an output token
    assert future.advance(future.start(None), tokens[::-1].copy()) is None
    assert future.advance(future.start(None), mooncake_token_ids((7,), 4, 4)) is None  # an unknown block
    assert future.start("lora") is None  # a namespace the trace does not have


def test_token_traces_are_indexed_by_page(tmp_path):
    a = RequestSpec.from_ids("a", [1, 2, 3, 4, 5, 6], 1)
    b = RequestSpec.from_ids("b", [1, 2, 3, 4, 9, 9, 9], 1)
    c = RequestSpec.from_ids("c", [1, 2, 3, 4, 5], 1)
    d = RequestSpec.from_ids("d", [1, 2, 3, 4, 5, 6, 7], 1, extra_key="x")
    trace = Trace(tmp_path / "t.jsonl", "memcli", 512, [a, b, c, d])
    future = build_future(trace, page_size=2)
    handle = lambda ids, extra=None: future.advance(future.start(extra), np.asarray(ids, dtype=np.int64))  # noqa: E731
    assert future.next_use(handle([1, 2, 3, 4])) == 0
    assert future.next_use(handle([1, 2, 3, 4, 5, 6])) is None  # a's cap is 5 tokens, d is another namespace
    assert future.next_use(handle([1, 2, 3, 4, 5, 6], "x")) == 3
    assert future.next_use(handle([1, 2, 3])) is None  # not a page end
    future.set_admitted(0, True)
    assert future.next_use(handle([1, 2, 3, 4])) == 1 and future.last_use(handle([1, 2, 3, 4])) == 0
    two_steps = future.advance(handle([1, 2]), np.asarray([3, 4], dtype=np.int64))
    assert two_steps == handle([1, 2, 3, 4])


def test_a_token_trace_too_large_for_the_index_is_refused(tmp_path, monkeypatch):
    import memcli.workload.future as future_mod

    monkeypatch.setattr(future_mod, "MAX_PAGE_ENTRIES", 3)
    trace = Trace(tmp_path / "t.jsonl", "memcli", 512, [RequestSpec.from_ids("a", list(range(10)), 1)])
    with pytest.raises(FutureTooLarge, match="index of 9 pages") as info:
        check_future_fits(trace, 1)
    assert "larger page size" in info.value.hint
    check_future_fits(trace, 4)


def test_mooncake_short_advance_equals_the_numpy_one(tmp_path, monkeypatch):
    """Up to `_SHORT` tokens are walked in Python: every slice of a path, of a path with one
    token changed (id, offset, unknown block), gives the handle numpy's walk gives."""
    from memcli.workload import future as future_module

    rows = [(12, [1, 2, 5]), (10, [1, 3, 6]), (8, [4, 2])]
    future = build_future(mooncake(tmp_path, rows), page_size=1)
    paths = [mooncake_token_ids(tuple(h), 4, n) for n, h in rows]
    cases = []
    for tokens in paths:
        for start in range(len(tokens)):
            for end in range(start + 1, min(start + future_module._SHORT, len(tokens)) + 1):
                handle = future.advance(future.start(None), tokens[:start]) if start else future.start(None)
                piece = tokens[start:end].copy()
                cases.append((handle, piece))
                for bad in (piece + 1, piece + 4, piece * 0 + 99 * 4):
                    cases.append((handle, bad))
    short = [future.advance(h, t) for h, t in cases]
    monkeypatch.setattr(future_module, "_SHORT", 0)
    assert short == [future.advance(h, t) for h, t in cases]
    assert sum(h is not None for h in short) > len(paths)  # real paths were walked, not only refused


def test_mooncake_long_advance_equals_the_token_walk(tmp_path, monkeypatch):
    """Runs longer than `_SHORT` (the numpy walk) give the token-by-token walk's handle: every
    slice of paths of several blocks, and the same slices with one token changed anywhere
    (inside a block, at a block start, at the last token) or two blocks swapped."""
    from memcli.workload import future as future_module

    rows = [(44, [1, 2, 5, 7, 8, 9, 3, 4, 6, 10, 11]), (40, [1, 2, 5, 7, 8, 12, 13, 14, 15, 16]),
            (30, [4, 2, 9, 9, 9, 9, 9, 9])]
    future = build_future(mooncake(tmp_path, rows), page_size=1)
    paths = [mooncake_token_ids(tuple(h), 4, n) for n, h in rows]
    cases = []
    for tokens in paths:
        for start in range(len(tokens)):
            handle = future.advance(future.start(None), tokens[:start]) if start else future.start(None)
            for end in range(start + 1, len(tokens) + 1):
                piece = tokens[start:end].copy()
                cases.append((handle, piece))
                for where in {0, len(piece) // 2, len(piece) - 1, (-start) % 4}:
                    if where < len(piece):
                        bad = piece.copy()
                        bad[where] += 4  # the same offset in another block
                        cases.append((handle, bad))
                if len(piece) >= 8 + (-start) % 4:
                    head = (-start) % 4
                    swapped = piece.copy()
                    swapped[head:head + 4], swapped[head + 4:head + 8] = piece[head + 4:head + 8], piece[head:head + 4]
                    cases.append((handle, swapped))
    monkeypatch.setattr(future_module, "_SHORT", 10**9)
    walked = [future.advance(h, t) for h, t in cases]
    monkeypatch.setattr(future_module, "_SHORT", 0)
    assert walked == [future.advance(h, t) for h, t in cases]
    assert sum(h is not None for h in walked) > len(cases) // 8  # real paths were walked, not only refused
    assert sum(h is None for h in walked) > len(cases) // 4


def _trie_by_walk(requests):
    """The block trie as one walk of the requests in trace order, block by block."""
    roots, children, block_hash, users = {}, {}, [-1], [[]]
    for j, req in enumerate(requests):
        node = roots.get(req.extra_key)
        if node is None:
            node = roots[req.extra_key] = len(users)
            users.append([])
            block_hash.append(-1)
        for h in req.hash_ids:
            child = children.get((node, h))
            if child is None:
                child = children[(node, h)] = len(users)
                users.append([])
                block_hash.append(h)
            users[child].append(j)
            node = child
    return roots, children, block_hash, users


@pytest.mark.parametrize("seed", range(6))
def test_block_trie_equals_the_walk_of_the_requests(seed):
    rng = np.random.default_rng(seed)
    requests = []
    for j in range(int(rng.integers(1, 40))):
        shared = rng.integers(0, 4, size=int(rng.integers(0, 6)))  # a few common prefixes
        own = rng.integers(100 + 50 * seed, 120 + 50 * seed, size=int(rng.integers(0 if shared.size else 1, 5)))
        blocks = tuple(int(h) for h in np.concatenate([shared, own]))
        key = [None, "tenant-a", "tenant-b"][int(rng.integers(0, 3))] if seed % 2 else None
        requests.append(RequestSpec(f"r{j}", len(blocks) * 4, 1, extra_key=key, hash_ids=blocks, block_size=4))
    trie = block_trie(requests)
    roots, children, block_hash, users = _trie_by_walk(requests)
    assert trie.roots == roots and trie.children == children
    assert trie.block_hash.tolist() == block_hash
    assert [trie.flat[trie.starts[n]:trie.starts[n + 1]].tolist() for n in range(len(users))] == users
    assert trie.starts[-1] == len(trie.flat) == sum(map(len, users))


def test_block_trie_of_the_bundled_trace_equals_the_walk():
    trace = read_trace(Path(__file__).parents[1] / "data" / "conversation_head300.jsonl")
    trie = block_trie(trace.requests)
    roots, children, block_hash, users = _trie_by_walk(trace.requests)
    assert trie.roots == roots and trie.children == children and trie.block_hash.tolist() == block_hash
    assert trie.flat.tolist() == [j for u in users for j in u]


def test_prompt_handles_equal_advancing_along_the_prompt_then_outputs():
    trace = read_trace(Path(__file__).parents[1] / "data" / "conversation_head300.jsonl")
    future = build_future(trace, page_size=1)
    base = trace.max_token_id + 1  # output tokens start above every prompt token
    rng = np.random.default_rng(0)
    for j in rng.choice(trace.num_requests, size=12, replace=False).tolist():
        spec = trace.requests[j]
        assert future.prompt_index(spec.rid) == j
        tokens = np.concatenate([spec.input_ids(), base + np.arange(40, dtype=np.int64)])
        for pos in sorted({1, 511, 512, 513, spec.input_len - 1, spec.input_len, spec.input_len + 1,
                           spec.input_len + 17, *rng.integers(1, spec.input_len, size=6).tolist()}):
            walked = future.advance(future.start(spec.extra_key), tokens[:pos])
            assert future.prompt_handle(j, pos) == walked, (j, pos)
    assert future.prompt_index("no such request") is None


def test_block_trie_keys_hash_ids_of_any_size():
    # Ids far apart (64-bit hashes) key as well as small ones: by their rank among the trace's ids.
    big = [2**62 - 5, 7, 2**61 + 3]
    requests = [RequestSpec(f"r{j}", len(blocks) * 4, 1, hash_ids=tuple(blocks), block_size=4)
                for j, blocks in enumerate([[big[0], big[1]], [big[0], big[2]], [big[1]]])]
    trie = block_trie(requests)
    roots, children, block_hash, users = _trie_by_walk(requests)
    assert trie.children == children and trie.block_hash.tolist() == block_hash
    assert trie.flat.tolist() == [j for u in users for j in u]


def _brute_uses(future, handle, pos):
    """(last_use, next_use) by definition, over the handle's users as `users` lists them."""
    users = future.users(handle)[0].tolist()
    past = [j for j in users if future.admitted[j] and future.caps[j] >= pos]
    to_come = [j for j in users if not future.admitted[j] and future.caps[j] >= pos]
    return (max(past) if past else None), (min(to_come) if to_come else None)


@pytest.mark.parametrize("kind", ["mooncake", "tokens"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_lookups_equal_their_definition_as_admissions_come_and_go(tmp_path, kind, seed):
    """The eviction's lookups (bisect over the index's users, the flags as bytes) answer as the
    definition over `users` does, through admissions and retractions in any order."""
    rng = np.random.default_rng(seed)
    if kind == "mooncake":
        rows = [(int(rng.integers(9, 13)), [1, *rng.integers(2, 4, size=2).tolist()]) for _ in range(40)]
        trace = mooncake(tmp_path, rows)
        prompts = [mooncake_token_ids(h, 4, n) for n, h in rows]
    else:
        prompts = [np.array([1, 2, *rng.integers(3, 5, size=int(rng.integers(2, 8))).tolist()]) for _ in range(40)]
        trace = Trace(tmp_path / "t.jsonl", "memcli", 512,
                      [RequestSpec.from_ids(f"r{j}", p.tolist(), 1) for j, p in enumerate(prompts)])
    future = build_future(trace, page_size=1 if kind == "mooncake" else 2)
    checked = 0
    for _ in range(60):
        j = int(rng.integers(0, 40))
        future.set_admitted(j, not future.admitted[j])
        prompt = prompts[int(rng.integers(0, 40))]
        end = int(rng.integers(1, len(prompt) + 1))
        handle = path_handle(future, prompt[:end])
        if handle is None or future.users(handle) is None:
            continue
        want = _brute_uses(future, handle, end)
        assert future.last_and_next_use(handle) == want
        assert (future.last_use(handle), future.next_use(handle)) == want
        checked += 1
    assert checked > 20


@pytest.mark.parametrize("kind", ["mooncake", "tokens"])
def test_kept_indexes_are_built_once_and_shared_by_futures_with_their_own_state(tmp_path, kind, monkeypatch):
    """`build_future(..., kept)`: the second future of a trace takes the first one's read-only
    index (nothing is built again) and answers as a future built alone, while admissions
    stay each future's own."""
    from memcli.workload import future as future_module

    if kind == "mooncake":
        trace = mooncake(tmp_path, [(8, [1, 2]), (8, [1, 3]), (12, [1, 2, 5])])
        tokens, page_size, build = mooncake_token_ids((1, 2, 5), 4, 12), 1, "block_trie"
    else:
        prompts = [[1, 2, 3, 4], [1, 2, 5, 6], [1, 2, 3, 4, 7, 8]]
        trace = Trace(tmp_path / "t.jsonl", "memcli", 512, [RequestSpec.from_ids(f"r{j}", p, 1) for j, p in enumerate(prompts)])
        tokens, page_size, build = np.array(prompts[2]), 2, "_prefix_hashes"
    kept: dict = {}
    first = build_future(trace, page_size, kept)
    assert len(kept) == 1
    calls = []
    original = getattr(future_module, build)
    monkeypatch.setattr(future_module, build, lambda *a, **k: calls.append(1) or original(*a, **k))
    second = build_future(trace, page_size, kept)
    assert calls == [] and second._flat is first._flat
    alone = build_future(trace, page_size)
    assert calls  # without `kept` the index is built
    first.set_admitted(0, True)
    for end in range(page_size, len(tokens) + 1, page_size):
        handle = path_handle(second, tokens[:end])
        assert second.last_and_next_use(handle) == alone.last_and_next_use(path_handle(alone, tokens[:end]))
    assert not second.admitted[0] and second.frontier == 0
    if kind == "tokens":  # another page size is another index
        build_future(trace, 1, kept)
        assert len(kept) == 2
