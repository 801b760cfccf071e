"""generate_trace: determinism, sharing structure, arrivals; writer and summary."""

from __future__ import annotations

import json
from collections import defaultdict

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from memcli.errors import MemcliError
from memcli.workload.generate import generate_trace, prefix_reuse_tokens, summarize_records, write_trace
from memcli.workload.readers import read_trace


def chats(records):
    """chat id -> records of that chat in file order."""
    by_chat = defaultdict(list)
    for record in records:
        chat, turn = record["rid"].split("-turn")
        by_chat[chat].append((int(turn), record))
    return by_chat


def common_prefix_len(a, b) -> int:
    n = min(len(a), len(b))
    diff = np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))
    return int(diff[0]) if len(diff) else n


def test_same_seed_same_records():
    assert generate_trace(50, seed=3) == generate_trace(50, seed=3)
    assert generate_trace(50, seed=3) != generate_trace(50, seed=4)


def test_record_shape():
    records = generate_trace(20, seed=1)
    assert len(records) == 20
    for record in records:
        assert set(record) == {"rid", "input_ids", "output_len", "arrival_ms"}
        assert all(type(t) is int and 0 <= t < 32000 for t in record["input_ids"])
        assert record["output_len"] >= 1
    assert len({r["rid"] for r in records}) == 20


def test_turns_extend_the_previous_turn_and_its_reply():
    records = generate_trace(300, seed=2, turns=4, input_len=20, output_len=10, system_prompt_len=50)
    by_chat = chats(records)
    assert sum(len(v) for v in by_chat.values()) == 300
    for turns in by_chat.values():
        assert [t for t, _ in turns] == list(range(1, len(turns) + 1))
        assert len(turns) <= 4
        for (_, prev), (_, nxt) in zip(turns, turns[1:]):
            prev_ids, next_ids = prev["input_ids"], nxt["input_ids"]
            assert next_ids[: len(prev_ids)] == prev_ids
            # the reply (as long as the previous output) and a user message of at least 1 token
            assert len(next_ids) >= len(prev_ids) + prev["output_len"] + 1


def test_system_prompts_are_shared_across_chats():
    records = generate_trace(200, seed=5, system_prompts=3, system_prompt_len=64, turns=2)
    first_turns = [r["input_ids"] for r in records if r["rid"].endswith("-turn1")]
    prompts = {tuple(ids[:64]) for ids in first_turns}
    assert len(prompts) == 3
    assert len(first_turns) > 3 * 10
    for ids in first_turns:
        assert len(ids) > 64


def test_no_system_prompts():
    records = generate_trace(30, seed=5, system_prompts=0, turns=1)
    firsts = {r["input_ids"][0] for r in records}
    assert len(firsts) > 20


def test_chats_interleave():
    records = generate_trace(100, seed=0, turns=3)
    order = [r["rid"].split("-")[0] for r in records]
    switches = sum(a != b for a, b in zip(order, order[1:]))
    assert switches > 50


def test_poisson_arrivals_and_mean_lengths():
    records = generate_trace(3000, seed=9, rate=20.0, input_len=16, output_len=40, system_prompt_len=8, turns=1)
    arrivals = np.array([r["arrival_ms"] for r in records])
    assert np.all(np.diff(arrivals) >= 0)
    gaps = np.diff(np.concatenate([[0.0], arrivals]))
    assert abs(gaps.mean() - 50.0) < 5.0
    outputs = np.array([r["output_len"] for r in records])
    assert abs(outputs.mean() - 40) < 2 and outputs.min() >= 1 and outputs.max() <= 79
    user_lens = np.array([len(r["input_ids"]) - 8 for r in records])
    assert abs(user_lens.mean() - 16) < 1 and user_lens.min() >= 1 and user_lens.max() <= 31


def test_rate_zero_writes_no_arrivals():
    assert all("arrival_ms" not in r for r in generate_trace(10, seed=0, rate=0))


@pytest.mark.parametrize(
    "kwargs, flag",
    [
        ({"num_requests": 0}, "--requests"),
        ({"seed": -1}, "--seed"),
        ({"turns": 0}, "--turns"),
        ({"input_len": 0}, "--input-len"),
        ({"output_len": -1}, "--output-len"),
        ({"system_prompts": -1}, "--system-prompts"),
        ({"system_prompt_len": 0}, "--system-prompt-len"),
        ({"rate": -1.0}, "--rate"),
        ({"rate": float("inf")}, "--rate"),
        ({"rate": float("nan")}, "--rate"),
    ],
)
def test_bad_parameters(kwargs, flag):
    args = {"num_requests": 5, **kwargs}
    with pytest.raises(MemcliError, match=flag) as exc:
        generate_trace(**args)
    assert exc.value.hint


def test_round_trip_through_the_reader(tmp_path):
    records = generate_trace(60, seed=11, input_len=32, output_len=8, system_prompt_len=40)
    path = tmp_path / "gen.jsonl"
    num_bytes = write_trace(records, path)
    assert num_bytes == path.stat().st_size
    trace = read_trace(path)
    assert trace.format == "memcli" and trace.num_requests == 60 and trace.has_timestamps
    for spec, record in zip(trace.requests, records):
        assert spec.rid == record["rid"]
        assert spec.input_ids().tolist() == record["input_ids"]
        assert spec.output_len == record["output_len"] and spec.arrival_ms == record["arrival_ms"]
    assert json.loads(path.read_text().splitlines()[0]) == records[0]


def test_write_refuses_to_overwrite(tmp_path):
    path = tmp_path / "gen.jsonl"
    path.write_text("keep me\n")
    with pytest.raises(MemcliError, match="already exists") as exc:
        write_trace([{"input_ids": [1], "output_len": 1}], path)
    assert "--force" in exc.value.hint
    assert path.read_text() == "keep me\n"
    write_trace([{"input_ids": [1], "output_len": 1}], path, overwrite=True)
    assert path.read_text() == '{"input_ids":[1],"output_len":1}\n'


def test_summary_counts_reuse_by_construction():
    records = generate_trace(40, seed=7, system_prompts=1, system_prompt_len=30, turns=2, input_len=5, output_len=5)
    summary = summarize_records(records)
    assert summary.num_requests == 40
    assert summary.input_tokens == sum(len(r["input_ids"]) for r in records)
    assert summary.output_tokens == sum(r["output_len"] for r in records)
    assert summary.duration_ms == records[-1]["arrival_ms"]
    assert summary.max_input_len == max(len(r["input_ids"]) for r in records)
    # Lower bound from the structure: every later turn reuses its previous turn's whole input,
    # every other first turn at least the shared system prompt.
    lower = 0
    for turns in chats(records).values():
        for (_, prev), _ in zip(turns, turns[1:]):
            lower += len(prev["input_ids"])
    num_first = sum(r["rid"].endswith("-turn1") for r in records)
    lower += 30 * (num_first - 1)
    assert lower <= summary.reusable_input_tokens <= lower + 5 * len(records)
    assert 0 < summary.reusable_fraction < 1


def brute_force_reuse(seqs):
    return sum(max((common_prefix_len(s, t) for t in seqs[:i]), default=0) for i, s in enumerate(seqs))


@given(st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=8), max_size=12))
def test_prefix_reuse_matches_brute_force(seqs):
    arrays = [np.array(s, dtype=np.int64) for s in seqs]
    assert prefix_reuse_tokens(arrays) == brute_force_reuse(seqs)


def test_prefix_reuse_large_ids():
    seqs = [[2**40, 5, 6], [2**40, 5, 7], [2**40 + 1]]
    assert prefix_reuse_tokens([np.array(s) for s in seqs]) == brute_force_reuse(seqs) == 2
