"""read_trace: format detection, every bad-input error, limits, memcli synthesis, real traces."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from memcli.errors import MemcliError, TraceError
from memcli.workload.readers import MEMCLI_KEYS, read_trace
from memcli.workload.spec import SYNTHETIC_TOKEN_BASE, output_token_base


@pytest.fixture(scope="module")
def traces_dir() -> Path:
    path = Path(__file__).parents[2].parent / "shared" / "traces"
    if not path.is_dir():
        pytest.skip(f"real traces not found at {path} (they live in shared/traces beside the repo)")
    return path


def write(tmp_path: Path, *lines, name: str = "t.jsonl") -> Path:
    path = tmp_path / name
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return path


def moon(ts, input_length, hash_ids, output_length=3, **extra):
    return {"timestamp": ts, "input_length": input_length, "output_length": output_length, "hash_ids": hash_ids, **extra}


# -- format detection ---------------------------------------------------------------


def test_detects_mooncake(tmp_path):
    path = write(tmp_path, moon(0, 5, [0, 1]), "", moon(10, 4, [0]))
    trace = read_trace(path, block_size=4)
    assert trace.format == "mooncake" and trace.block_size == 4
    assert [r.rid for r in trace.requests] == ["1", "3"]  # rids are line numbers; blank lines skipped
    assert [r.arrival_ms for r in trace.requests] == [0.0, 10.0]
    assert trace.has_timestamps
    assert trace.requests[0].hash_ids == (0, 1)


def test_detects_memcli(tmp_path):
    path = write(tmp_path, {"input_ids": [1, 2, 3], "output_len": 2}, {"rid": "b", "input_len": 4, "output_len": 1})
    trace = read_trace(path)
    assert trace.format == "memcli"
    assert [r.rid for r in trace.requests] == ["1", "b"]
    assert trace.requests[0].input_ids().tolist() == [1, 2, 3]
    assert trace.input_tokens == 7 and trace.output_tokens == 3
    assert not trace.has_timestamps


def test_forcing_the_format(tmp_path):
    memcli_file = write(tmp_path, {"input_ids": [1], "output_len": 2}, name="m.jsonl")
    mooncake_file = write(tmp_path, moon(0, 5, [0]), name="k.jsonl")
    assert read_trace(memcli_file, format="memcli").format == "memcli"
    assert read_trace(mooncake_file, format="mooncake").format == "mooncake"
    with pytest.raises(TraceError, match='unknown keys "hash_ids"') as exc:
        read_trace(mooncake_file, format="memcli")
    assert "k.jsonl:1:" in exc.value.message and "--format mooncake" in exc.value.hint
    with pytest.raises(TraceError, match='"input_ids" is a memcli key') as exc:
        read_trace(memcli_file, format="mooncake")
    assert "m.jsonl:1:" in exc.value.message and "--format memcli" in exc.value.hint


def test_qwen_bailian_fields_and_unknown_fields(tmp_path):
    bailian = moon(0, 20, [4, 5], chat_id=3, parent_chat_id=-1, turn=1, type="text")
    path = write(tmp_path, bailian, moon(1, 16, [4], session="x", delay=0))
    trace = read_trace(path, block_size=16)
    assert trace.num_requests == 2
    assert trace.ignored_fields == ("delay", "session")
    assert read_trace(write(tmp_path, bailian, name="b.jsonl"), block_size=16).ignored_fields == ()


def test_timestamps_are_optional_and_may_be_null(tmp_path):
    line = {"input_length": 3, "output_length": 1, "hash_ids": [0]}
    trace = read_trace(write(tmp_path, line, {**line, "timestamp": None}))
    assert not trace.has_timestamps and trace.requests[1].arrival_ms is None


# -- bad input: every error names FILE:LINE and carries a hint -------------------------

GOOD_MOON = moon(0, 5, [0, 1])
NO_TS_MOON = {"input_length": 5, "output_length": 1, "hash_ids": [0, 1]}
GOOD_MEM = {"rid": "a", "input_ids": [1, 2, 3], "output_len": 2}

BAD = {
    "not json": (GOOD_MOON, '{"timestamp": 0, "input_length": 5', "not valid JSON"),
    "not an object": (GOOD_MOON, "[1, 2]", "expected a JSON object, got array"),
    "moon missing field": (GOOD_MOON, {"timestamp": 1, "input_length": 5, "hash_ids": [0, 1]}, 'missing field "output_length"'),
    "moon wrong type": (GOOD_MOON, moon(1, "5", [0, 1]), '"input_length" must be an integer, got string'),
    "moon bool length": (GOOD_MOON, moon(1, True, [0]), "must be an integer, got boolean"),
    "moon float length": (GOOD_MOON, moon(1, 5.0, [0, 1]), "must be an integer, got number"),
    "moon negative output": (GOOD_MOON, moon(1, 5, [0, 1], output_length=-1), '"output_length" is -1, must be >= 0'),
    "moon negative input": (GOOD_MOON, moon(1, -5, []), '"input_length" is -5'),
    "moon zero input": (GOOD_MOON, moon(1, 0, []), "at least one input token"),
    "moon hash count": (GOOD_MOON, moon(1, 9, [0, 1]), "hash_ids has 2 entries but input_length 9 needs ceil(9 / 4) = 3"),
    "moon hash type": (GOOD_MOON, moon(1, 5, [0, "1"]), '"hash_ids" must be a list of integers'),
    "moon negative hash": (GOOD_MOON, moon(1, 5, [0, -1]), "negative value -1"),
    "moon timestamp type": (GOOD_MOON, moon("1", 5, [0, 1]), '"timestamp" must be a number'),
    "moon timestamp nan": (GOOD_MOON, '{"timestamp": NaN, "input_length": 5, "output_length": 1, "hash_ids": [0, 1]}', "must be a number"),
    "moon negative timestamp": (moon(-1, 5, [0, 1]), GOOD_MOON, '"timestamp" is -1'),
    "moon typo": (NO_TS_MOON, {**NO_TS_MOON, "timestmap": 1}, 'unknown field "timestmap": did you mean "timestamp"?'),
    "moon backwards": (moon(3600050, 5, [0, 1]), moon(3600020, 5, [0, 1]), '"timestamp" 3600020 is earlier than 3600050 on line 1'),
    "moon mixed timestamps": (GOOD_MOON, {"input_length": 5, "output_length": 1, "hash_ids": [0, 1]}, 'has no "timestamp" while line 1 does'),
    "mem unknown key": (GOOD_MEM, {"input_ids": [1], "output_len": 1, "max_tokens": 5}, 'unknown key "max_tokens"'),
    "mem unknown keys": (GOOD_MEM, {"input_ids": [1], "output_len": 1, "max_tokens": 5, "id": "x"}, 'unknown keys "id", "max_tokens"'),
    "mem missing output": (GOOD_MEM, {"input_ids": [1]}, 'missing field "output_len"'),
    "mem missing input": (GOOD_MEM, {"output_len": 1}, 'missing field "input_ids" or "input_len"'),
    "mem both inputs": (GOOD_MEM, {"input_ids": [1], "input_len": 1, "output_len": 1}, "not both"),
    "mem zero input_len": (GOOD_MEM, {"input_len": 0, "output_len": 1}, "at least one input token"),
    "mem empty input_ids": (GOOD_MEM, {"input_ids": [], "output_len": 1}, "at least one input token"),
    "mem ids wrong type": (GOOD_MEM, {"input_ids": [1, 2.5], "output_len": 1}, '"input_ids" must be a list of integers'),
    "mem ids not a list": (GOOD_MEM, {"input_ids": "1 2", "output_len": 1}, "got string"),
    "mem negative id": (GOOD_MEM, {"input_ids": [1, -2], "output_len": 1}, "negative value -2"),
    "mem id too large": (GOOD_MEM, {"input_ids": [2**31], "output_len": 1}, "must be < 2147483648"),
    "mem negative output": (GOOD_MEM, {"input_len": 3, "output_len": -2}, '"output_len" is -2'),
    "mem duplicate rid": (GOOD_MEM, {"rid": "a", "input_len": 3, "output_len": 1}, 'duplicate rid "a" (first used on line 1)'),
    "mem rid not string": (GOOD_MEM, {"rid": 7, "input_len": 3, "output_len": 1}, '"rid" must be a string'),
    "mem extra_key type": (GOOD_MEM, {"input_len": 3, "output_len": 1, "extra_key": 3}, '"extra_key" must be a string'),
    "mem priority type": (GOOD_MEM, {"input_len": 3, "output_len": 1, "priority": "high"}, '"priority" must be an integer'),
    "moon priority type": (GOOD_MOON, moon(1, 5, [0, 1], priority=1.5), '"priority" must be an integer'),
    "mem max_new_tokens short": (GOOD_MEM, {"input_len": 3, "output_len": 5, "max_new_tokens": 4}, '"max_new_tokens" 4 is below output_len 5'),
    "mem eos and ignore_eos": (GOOD_MEM, {"input_len": 3, "output_len": 5, "max_new_tokens": 6, "ignore_eos": True}, "on an ignore_eos request"),
    "mem ignore_eos type": (GOOD_MEM, {"input_len": 3, "output_len": 1, "ignore_eos": 1}, '"ignore_eos" must be true or false'),
    "mem prefix unknown rid": (GOOD_MEM, {"input_len": 5, "output_len": 1, "prefix": {"rid": "zz", "len": 2}}, 'prefix rid "zz" is not an earlier request'),
    "mem prefix too long": (GOOD_MEM, {"input_len": 5, "output_len": 1, "prefix": {"rid": "a", "len": 4}}, "prefix len 4 is longer"),
    "mem prefix over input": (GOOD_MEM, {"input_len": 1, "output_len": 1, "prefix": {"rid": "a", "len": 2}}, "prefix len 2 is longer"),
    "mem prefix shape": (GOOD_MEM, {"input_len": 5, "output_len": 1, "prefix": {"rid": "a"}}, '"prefix" must be an object with keys rid and len'),
    "mem prefix zero": (GOOD_MEM, {"input_len": 5, "output_len": 1, "prefix": {"rid": "a", "len": 0}}, "positive integer len"),
    "mem prefix with ids": (GOOD_MEM, {"input_ids": [1], "output_len": 1, "prefix": {"rid": "a", "len": 1}}, "prefix combines with input_len"),
    "mem backwards": ({**GOOD_MEM, "arrival_ms": 5.5}, {"input_len": 2, "output_len": 1, "arrival_ms": 5.25}, '"arrival_ms" 5.25 is earlier than 5.5 on line 1'),
    "mem mixed arrivals": (GOOD_MEM, {"input_len": 2, "output_len": 1, "arrival_ms": 3}, 'has "arrival_ms" while line 1 does not'),
    "mem arrival type": (GOOD_MEM, {"input_len": 2, "output_len": 1, "arrival_ms": "3"}, '"arrival_ms" must be a number'),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_input_names_file_and_line(tmp_path, case):
    first, second, expected = BAD[case]
    path = write(tmp_path, first, second, name=f"bad-{case.replace(' ', '-')}.jsonl")
    line = 1 if "negative timestamp" in case else 2
    with pytest.raises(TraceError) as exc:
        read_trace(path, block_size=4)
    assert exc.value.message.startswith(f"{path}:{line}: "), exc.value.message
    assert expected in exc.value.message
    assert exc.value.hint


def test_unknown_memcli_key_hint_lists_the_valid_keys(tmp_path):
    path = write(tmp_path, {"input_ids": [1], "output_len": 1, "max_tokens": 5})
    with pytest.raises(TraceError) as exc:
        read_trace(path)
    assert all(key in exc.value.hint for key in MEMCLI_KEYS)


def test_hash_count_hint_suggests_block_sizes(tmp_path):
    path = write(tmp_path, moon(0, 6955, [1, 2, 3, 4, 5]))
    with pytest.raises(TraceError) as exc:
        read_trace(path)
    assert "ceil(6955 / 512) = 14" in exc.value.message
    assert "1391..1738" in exc.value.hint


@pytest.mark.parametrize("content", ["", "\n\n  \n"])
def test_empty_file(tmp_path, content):
    path = tmp_path / "empty.jsonl"
    path.write_text(content)
    with pytest.raises(TraceError, match="no requests") as exc:
        read_trace(path)
    assert exc.value.message.startswith(f"{path}:1: ")


def test_undetectable_format(tmp_path):
    path = write(tmp_path, "", {"prompt": "hi", "max_tokens": 3})
    with pytest.raises(TraceError, match="cannot tell the trace format") as exc:
        read_trace(path)
    assert exc.value.message.startswith(f"{path}:2: ")
    assert "--format" in exc.value.hint


def test_not_utf8(tmp_path):
    path = tmp_path / "bin.jsonl"
    path.write_bytes(json.dumps(GOOD_MEM).encode() + b"\n\xff\xfe\n")
    with pytest.raises(TraceError, match=r"bin.jsonl:2: not valid JSON"):
        read_trace(path)


def test_missing_file(tmp_path):
    with pytest.raises(TraceError, match="cannot read") as exc:
        read_trace(tmp_path / "nope.jsonl")
    assert "nope.jsonl" in exc.value.message and exc.value.hint


@pytest.mark.parametrize(
    "kwargs, expected",
    [({"format": "csv"}, 'unknown trace format "csv"'), ({"block_size": 0}, "block size"), ({"limit": 0}, "limit")],
)
def test_bad_arguments(tmp_path, kwargs, expected):
    path = write(tmp_path, GOOD_MEM)
    with pytest.raises(MemcliError, match=expected) as exc:
        read_trace(path, **kwargs)
    assert exc.value.hint


def test_equal_timestamps_are_fine(tmp_path):
    trace = read_trace(write(tmp_path, moon(0, 5, [0, 1]), moon(0, 5, [0, 1]), moon(7.5, 5, [0, 1])), block_size=4)
    assert [r.arrival_ms for r in trace.requests] == [0.0, 0.0, 7.5]


# -- limit ----------------------------------------------------------------------------


def test_limit_stops_reading_early(tmp_path):
    path = write(tmp_path, moon(0, 5, [0, 1]), moon(1, 5, [0, 2]), "this line is never read")
    trace = read_trace(path, block_size=4, limit=2)
    assert [r.rid for r in trace.requests] == ["1", "2"]
    with pytest.raises(TraceError, match=":3: not valid JSON"):
        read_trace(path, block_size=4)


def test_limit_larger_than_the_file(tmp_path):
    assert read_trace(write(tmp_path, GOOD_MEM), limit=10).num_requests == 1


# -- memcli token synthesis -------------------------------------------------------------


def test_input_len_tokens_are_unique_per_request(tmp_path):
    path = write(
        tmp_path,
        {"rid": "x", "input_ids": [5, 6, 7, 8], "output_len": 1},
        {"rid": "a", "input_len": 6, "output_len": 1},
        {"rid": "b", "input_len": 3, "output_len": 1},
    )
    x, a, b = read_trace(path).requests
    assert a.input_ids().tolist() == list(range(SYNTHETIC_TOKEN_BASE, SYNTHETIC_TOKEN_BASE + 6))
    assert b.input_ids().tolist() == list(range(SYNTHETIC_TOKEN_BASE + 6, SYNTHETIC_TOKEN_BASE + 9))
    assert not set(x.input_ids().tolist()) & set(a.input_ids().tolist())


def test_prefix_reuses_an_earlier_requests_tokens(tmp_path):
    path = write(
        tmp_path,
        {"rid": "sys", "input_ids": [10, 11, 12, 13], "output_len": 1},
        {"rid": "t1", "input_len": 7, "output_len": 1, "prefix": {"rid": "sys", "len": 4}},
        {"rid": "t2", "input_len": 9, "output_len": 1, "prefix": {"rid": "t1", "len": 6}},
        {"rid": "u", "input_len": 2, "output_len": 1, "prefix": {"rid": "sys", "len": 2}},
        {"rid": "same", "input_len": 7, "output_len": 1, "prefix": {"rid": "t1", "len": 7}},
    )
    trace = read_trace(path)
    sys_, t1, t2, u, same = (r.input_ids().tolist() for r in trace.requests)
    base = SYNTHETIC_TOKEN_BASE
    assert t1 == [10, 11, 12, 13, base, base + 1, base + 2]
    assert t2 == t1[:6] + [base + 3, base + 4, base + 5]
    assert u == [10, 11]
    assert same == t1
    assert [r.input_len for r in trace.requests] == [4, 7, 9, 2, 7]
    assert output_token_base(trace) == base + 6


def test_reading_twice_and_limits_give_the_same_tokens(tmp_path):
    lines = [{"rid": f"r{i}", "input_len": 5 + i, "output_len": 1} for i in range(6)]
    path = write(tmp_path, *lines)
    full = read_trace(path)
    again = read_trace(path)
    part = read_trace(path, limit=3)
    for a, b, c in zip(full.requests, again.requests, part.requests):
        assert np.array_equal(a.input_ids(), b.input_ids()) and np.array_equal(a.input_ids(), c.input_ids())


def test_memcli_fields_are_kept(tmp_path):
    path = write(tmp_path, {"rid": "q", "input_ids": [1, 2], "output_len": 0, "arrival_ms": 2, "extra_key": "lora-a"})
    (spec,) = read_trace(path, block_size=16).requests
    assert (spec.rid, spec.output_len, spec.arrival_ms, spec.extra_key, spec.block_size) == ("q", 0, 2.0, "lora-a", 16)
    assert not spec.ignore_eos


def test_ignore_eos_is_read(tmp_path):
    path = write(tmp_path, {"input_len": 2, "output_len": 1, "ignore_eos": True},
                 {"input_len": 2, "output_len": 1, "ignore_eos": None})
    assert [spec.ignore_eos for spec in read_trace(path).requests] == [True, False]


def test_max_new_tokens_sets_the_eos_position(tmp_path):
    path = write(tmp_path, {"input_len": 2, "output_len": 3, "max_new_tokens": 9},
                 {"input_len": 2, "output_len": 3, "max_new_tokens": 3}, {"input_len": 2, "output_len": 3})
    specs = read_trace(path).requests
    assert [(s.sampling_limit, s.eos_len) for s in specs] == [(9, 3), (3, None), (3, None)]


def test_priority_is_read_and_defaults_to_zero(tmp_path):
    path = write(tmp_path, {"input_ids": [1, 2], "output_len": 0, "priority": -3}, {"input_len": 2, "output_len": 0},
                 {"input_len": 2, "output_len": 0, "priority": None})
    assert [s.priority for s in read_trace(path).requests] == [-3, 0, 0]
    moon_path = write(tmp_path, moon(0, 5, [0, 1], priority=2), moon(1, 5, [0, 1]), name="m.jsonl")
    trace = read_trace(moon_path, block_size=4)
    assert [s.priority for s in trace.requests] == [2, 0] and trace.ignored_fields == ()


# -- real traces ------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["conversation_trace.jsonl", "synthetic_trace.jsonl"])
def test_first_200_requests_of_real_traces(traces_dir, name):
    path = traces_dir / name
    trace = read_trace(path, limit=200)
    assert trace.format == "mooncake" and trace.num_requests == 200 and trace.has_timestamps
    with path.open() as fh:
        rows = [json.loads(next(fh)) for _ in range(200)]
    for spec, row in zip(trace.requests, rows):
        assert spec.input_len == row["input_length"] and spec.output_len == row["output_length"]
        assert spec.hash_ids == tuple(row["hash_ids"]) and spec.arrival_ms == row["timestamp"]
    top = output_token_base(trace)
    for a, b in zip(trace.requests, trace.requests[1:40]):
        ids_a, ids_b = a.input_ids(), b.input_ids()
        assert len(ids_a) == a.input_len and ids_a.max() < top
        shared_blocks = next((i for i, (x, y) in enumerate(zip(a.hash_ids, b.hash_ids)) if x != y), min(a.num_blocks, b.num_blocks))
        n = min(len(ids_a), len(ids_b), shared_blocks * 512)
        assert np.array_equal(ids_a[:n], ids_b[:n])


def test_whole_conversation_trace(traces_dir):
    trace = read_trace(traces_dir / "conversation_trace.jsonl")
    assert trace.num_requests == 12031
    assert round(trace.input_tokens / trace.num_requests) == 12035
    assert round(trace.output_tokens / trace.num_requests) == 343


def test_a_token_count_beyond_any_request_is_a_trace_error(tmp_path):
    # Found by `python -m tests.fuzz`: range(10**30) raised OverflowError.
    path = tmp_path / "huge.jsonl"
    path.write_text('{"rid": "a", "input_len": 1000000000000000000000000000000, "output_len": 1}\n')
    with pytest.raises(TraceError, match=r'huge\.jsonl:1: "input_len" is 10+, must be <= 2147483647'):
        read_trace(path)
