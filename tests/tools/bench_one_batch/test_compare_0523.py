"""`bench-one-batch --compare sglang-0.5.23`: SGLang 0.5.23's `allocation.py` paths timed beside
memcli's, its slots checked against memcli's per case (skipped with the reason when the wheel
or msgspec is not available). The bench runs in its own process: 0.5.23 never shares one with
the 0.5.5 reference."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from dataclasses import dataclass

import pytest
import torch

from memcli.errors import IntegrityError
from memcli.reference.fetch import SGLANG_0523, unavailable_reason
from memcli.tools.bench_one_batch.cases import Case
from memcli.tools.bench_one_batch.sglang_0523_side import Figures, Sglang0523Comparison

QUICK = ["--repeat", "1", "--warmup", "0", "--rounds", "1"]


def _reason():
    if importlib.util.find_spec("msgspec") is None:
        return "msgspec is not installed"
    reason = unavailable_reason(wheel=SGLANG_0523)
    return reason if reason is not None and "index unreachable" in reason else None


def bench(*args) -> dict:
    reason = _reason()
    if reason is not None:
        pytest.skip(reason)
    cmd = [sys.executable, "-m", "memcli", "bench-one-batch", "--engine", "sglang-0.5.23", "--set",
           "runtime.device=cpu", "--compare", "sglang-0.5.23", "--json", *QUICK, *map(str, args)]
    done = subprocess.run(cmd, capture_output=True, text=True, env={**__import__("os").environ, "NO_COLOR": "1"})
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout)


@pytest.mark.parametrize("tree_cache", ["none", "radix"])
def test_sglang_0523_is_timed_beside_memcli_with_the_same_slots(tree_cache):
    doc = bench("-b", 2, "--input-len", 40, "--output-len", 3, "--prefix-len", 0, 16, "--page-size", 1, 4,
                "--tree-cache", tree_cache)
    compare = doc["compare"]
    assert compare["name"] == "sglang-0.5.23" and compare["attention_backend"] == "torch_native"
    assert "allocation.py" in compare["setup"] and "Python tree core" in compare["setup"]
    phases = {(row["case"], row["phase"]) for row in compare["rows"]}
    assert len(phases) == 4 * 3  # four cases, prefill / decode / free each
    for row in compare["rows"]:
        assert row["reference"]["median_us"] > 0 and row["memcli"]["median_us"] > 0
    prefix_case = next(c for c in doc["cases"] if c["prefix_len"] == 16 and c["page_size"] == 4)
    # 24 new tokens a request: 6 pages of 4 each, as 0.5.23's paged allocator took them (checked per case)
    assert prefix_case["prefill_allocated_tokens"] == 2 * 24


def test_a_figure_off_memcli_fails_the_check():
    comparison = Sglang0523Comparison(None, torch.device("cpu"))
    case = Case(2, 40, 3, 0, 1)

    @dataclass
    class Mine:
        prefill_allocated_tokens: int = 80
        decode_allocated_tokens: int = 4
        freed_tokens: int = 84

    comparison.figures[case] = Figures(80, 4, 84, 2)
    comparison.check_case(case, Mine())
    comparison.figures[case] = Figures(80, 4, 83, 2)
    with pytest.raises(IntegrityError, match="freed_tokens 83"):
        comparison.check_case(case, Mine())
