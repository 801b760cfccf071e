"""The floor of a replay's array work (`python -m memcli.tools.replay.floor`)."""

import numpy as np

from memcli.tools.replay.ceiling import shared_prefix_lens
from memcli.tools.replay.floor import array_work, main
from memcli.workload.readers import read_trace
from tests.tools.replay.helpers import CONVERSATION


def test_the_floor_copies_each_new_prompt_token_once_and_prints_its_rounds(capsys):
    assert main([str(CONVERSATION), "--limit", "40", "--rounds", "2"]) == 0
    out = capsys.readouterr().out
    trace = read_trace(CONVERSATION, limit=40)
    new = sum(r.input_len for r in trace.requests) - int(shared_prefix_lens(trace).sum())
    assert f"array work of 40 requests ({new:,} new prompt tokens)" in out and out.count(",") >= 2


def test_the_floor_copies_the_prompt_past_each_shared_prefix():
    trace = read_trace(CONVERSATION, limit=10)
    shared = shared_prefix_lens(trace)
    assert 0 < shared[1:].max() and array_work(trace, shared) > 0  # requests after the first share a prefix
    assert array_work(trace, np.zeros_like(shared)) > 0  # nothing shared: every prompt copied whole


def test_bad_input_exits_2(capsys, tmp_path):
    assert main([str(tmp_path / "missing.jsonl")]) == 2
    assert "error:" in capsys.readouterr().err
    assert main([str(CONVERSATION), "--rounds", "0"]) == 2
    assert main([str(CONVERSATION), "--limit", "-3"]) == 2
    err = capsys.readouterr().err
    assert "error: --limit must be at least 1" in err and "\nhint: " in err
