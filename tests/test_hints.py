"""Every hint that proposes a value computes it from the whole input, and following it works:
each test below takes the hint's settings and runs the same command again."""

from __future__ import annotations

import json
import re
from pathlib import Path

from typer.testing import CliRunner

from memcli.cli.app import app

TRACE = Path(__file__).parent / "data" / "conversation_head300.jsonl"
CPU = ["--set", "runtime.device=cpu"]


def invoke(*args):
    return CliRunner().invoke(app, [*map(str, args)])


def hint_of(result) -> str:
    assert result.exit_code == 2, result.output
    return next(line for line in result.stderr.splitlines() if line.startswith("hint: "))


def settings(hint: str) -> list[str]:
    """The hint's `--set key=value` pairs, as arguments."""
    return [arg for pair in re.findall(r"--set (\S+)", hint) for arg in ("--set", pair)]


def test_replay_hint_holds_the_longest_request_not_the_first_too_long(tmp_path):
    lines = [{"rid": "a", "input_len": 100, "output_len": 8}, {"rid": "b", "input_len": 3000, "output_len": 8},
             {"rid": "c", "input_len": 200, "output_len": 4}, {"rid": "d", "input_len": 9000, "output_len": 50}]
    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(json.dumps(line) + "\n" for line in lines))
    # --strict-limits: refused, not cut as SGLang would cut b and d (tests/test_capacity.py)
    small = [*CPU, "--strict-limits", "--set", "memory.max_context_len=2048", "--set", "memory.max_total_tokens=4096"]
    hint = hint_of(invoke("replay", trace, *small))
    # request d, not b; 9,000 + 50 and SGLang's two tokens (semantics.request_limits)
    assert "--set memory.max_context_len=9052" in hint and "--limit 1" in hint
    followed = invoke("replay", trace, *small, *settings(hint), "--json")
    assert followed.exit_code == 0, followed.output
    assert json.loads(followed.stdout)["summary"]["finished"] == 4


def test_replay_pool_hint_for_a_pool_too_small(tmp_path):
    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(json.dumps({"input_len": n, "output_len": 16}) + "\n" for n in (500, 1500, 700)))
    base = [*CPU, "--strict-limits", "--set", "memory.max_context_len=1024", "--set", "memory.max_total_tokens=1024",
            "--set", "memory.page_size=16"]
    hint = hint_of(invoke("replay", trace, *base))
    followed = invoke("replay", trace, *base, *settings(hint), "--json")
    assert followed.exit_code == 0, followed.output


def test_bench_one_batch_hint_covers_every_case():
    quick = [*CPU, "--input-len", 512, 1024, "--output-len", 2, "--repeat", 1, "--warmup", 0, "--rounds", 1]
    hint = hint_of(invoke("bench-one-batch", "-b", 8, 32, *quick))
    # bs=32 at input 512 fails first; the pool must hold bs=32 at input 1024 too
    assert "--set memory.max_total_tokens=32832" in hint
    followed = invoke("bench-one-batch", "-b", 8, 32, *quick, *settings(hint), "--json")
    assert followed.exit_code == 0, followed.output
    fits = int(re.search(r"largest batch size that fits: (\d+)", hint).group(1))
    assert invoke("bench-one-batch", "-b", fits, *quick, "--json").exit_code == 0
    assert invoke("bench-one-batch", "-b", fits + 1, *quick, "--json").exit_code == 2  # the largest


def test_bench_one_batch_context_hint_also_sizes_the_pool():
    quick = [*CPU, "--output-len", 2, "--repeat", 1, "--warmup", 0, "--rounds", 1, "-b", 4]
    hint = hint_of(invoke("bench-one-batch", "--input-len", 512, 6000, 5000, *quick))
    assert "--set memory.max_context_len=6002" in hint
    assert invoke("bench-one-batch", "--input-len", 512, 6000, 5000, *quick, *settings(hint)).exit_code == 0


def test_check_page_size_hint_holds_the_longest_request_of_the_workload():
    hint = hint_of(invoke("check-page-size", *CPU, "--workload", TRACE, "--requests", 12))
    followed = invoke("check-page-size", *CPU, "--workload", TRACE, "--requests", 12, *settings(hint),
                      "--steps", 2, "--allow-unfinished", "--json")
    assert followed.exit_code == 0, followed.output
