"""`memcli bench-one-batch` through the CLI, plus the runner and the batched release it uses.

Small cases (a few requests, tens of tokens, one timed call) keep the whole file fast. Every
stack is built on the CPU.
"""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from memcli.tools.bench_one_batch.cases import Case, check_capacity
from memcli.tools.bench_one_batch.runner import CaseRunner
from memcli.cli.app import app
from memcli.cli.bench_one_batch import LIST_FLAGS
from memcli.cli.options import expand_list_flags
from memcli.config import load_config, replace
from memcli.errors import CapacityError
from memcli.mem_cache.null_cache import NullCache
from memcli.stack import build_stack

runner = CliRunner()
QUICK = ["--repeat", "1", "--warmup", "0", "--rounds", "1", "--output-len", "3"]


def invoke(*args):
    """Runs on the CPU also where a GPU is visible, so the figures checked here are the same."""
    return runner.invoke(app, ["bench-one-batch", "--set", "runtime.device=cpu", *map(str, args)],
                         env={"NO_COLOR": "1"})


def bench_json(*args) -> dict:
    result = invoke(*args, "--json")
    assert result.exit_code == 0, result.stderr
    return json.loads(result.stdout)  # the whole of stdout is one document


def cdiv(a, b):
    return -(-a // b)


def test_default_run():
    result = invoke("--progress")
    assert result.exit_code == 0, result.stderr
    out = result.stdout
    assert "bs=1 input=512 output=16 prefix=0 page_size=1" in out
    assert "bs=8 input=512 output=16 prefix=0 page_size=1" in out
    assert "synchronized wall clock" in out and "n/a (no device)" in out
    assert "decode memory path" in out and "free on finish" in out and "idle check ok" in out
    assert "round 7/7 over 2 case(s)" in result.stderr


@pytest.mark.parametrize("profile, steps", [("sglang-0.5.5", 2), ("memcli", 3)])
def test_decode_steps_follow_the_profile(profile, steps):
    doc = bench_json("-b", 2, "--input-len", 40, *QUICK, "--engine", "sglang-0.5.5",
                     "--set", f"semantics.profile={profile}")
    (case,) = doc["cases"]
    assert case["output_len"] == 3 and len(case["decode_step_us"]) == steps
    assert doc["profile"] == profile


def test_json_is_one_document_with_every_figure():
    doc = bench_json("-b", 2, "--input-len", 40, *QUICK)
    assert doc["command"] == "bench-one-batch" and doc["timing_method"] == "wall-clock (cpu)"
    assert doc["config"]["memory"]["page_size"] == 1 and doc["config"]["cache"]["kind"] == "none"
    assert doc["options"]["repeat"] == 1
    (case,) = doc["cases"]
    reference = ("run_name", "batch_size", "input_len", "output_len", "prefill_latency", "prefill_throughput",
                 "median_decode_latency", "median_decode_throughput", "total_latency", "overall_throughput")
    memcli = ("prefix_len", "page_size", "device", "timing_method", "prefill_memory_us", "decode_memory_us",
              "free_us", "syncs", "phases", "kv_store_prefill", "page_sizes", "idle")
    for key in reference + memcli:
        assert key in case, key
    assert case["batch_size"] == 2 and case["input_len"] == 40 and case["output_len"] == 3
    assert case["prefill_throughput"] == pytest.approx(2 * 40 / case["prefill_latency"])
    assert case["total_latency"] == pytest.approx(case["prefill_latency"] + sum(case["decode_step_us"]) / 1e6)
    assert len(case["decode_step_us"]) == 2  # sglang-0.5.5: output_len - 1 (the prefill samples the first)
    for name in ("prefill", "prefill_memory", "decode_step", "decode_memory", "free", "kv_store_prefill",
                 "copy_prefill", "kv_store_decode"):
        phase = case["phases"][name]
        assert phase["median_us"] > 0 and phase["first_call_ms"] > 0 and phase["syncs"] is None, name
        assert phase["device_us"] is None, name  # no device time on a CPU
    assert set(case["syncs"]) == set(case["phases"]) == set(case["device_us"])
    kv = case["kv_store_prefill"]
    assert kv["tokens"] == 80 and kv["bytes"] == 80 * 4 * 2 * 64 * 2 * 2 and kv["copy_ratio"] > 0
    assert case["prefill_allocated_tokens"] == 80 and case["decode_allocated_tokens"] == 2 * 2
    assert case["freed_tokens"] == 84 and case["idle"]["ok"]


def test_several_page_sizes_give_a_comparison_table():
    result = invoke("-b", "1,2", "--input-len", 40, "--page-size", 1, 16, *QUICK, "--progress")
    assert result.exit_code == 0, result.stderr
    assert "page sizes compared" in result.stdout
    assert "page_size=1" in result.stdout and "page_size=16" in result.stdout
    assert "round 1/1 over 4 case(s)" in result.stderr
    assert invoke("-b", "1", "--input-len", 40, *QUICK).stderr == ""  # no --progress, no terminal: silent


def test_list_options_accept_spaces_commas_and_repeated_flags():
    doc = bench_json("-b", 1, 2, "--batch-size", "3,4", "--input-len=40", 48, *QUICK)
    shapes = [(c["batch_size"], c["input_len"]) for c in doc["cases"]]
    assert shapes == [(bs, il) for bs in (1, 2, 3, 4) for il in (40, 48)]


def test_expand_list_flags():
    assert expand_list_flags(["-b", "1", "8", "--json", "--input-len=4", "5"], LIST_FLAGS) == [
        "-b", "1", "-b", "8", "--json", "--input-len=4", "--input-len", "5"]
    assert expand_list_flags(["--set", "a.b=1", "--repeat", "3"], LIST_FLAGS) == ["--set", "a.b=1", "--repeat", "3"]


@pytest.mark.parametrize("tree_cache, page_size, cached", [("radix", 16, 96), ("radix", 1, 100),
                                                             ("none", 16, 100), ("chunk", 4, 100)])
def test_prefix_is_reused(tree_cache, page_size, cached):
    bs, input_len, prefix = 3, 160, 100
    doc = bench_json("-b", bs, "--input-len", input_len, "--prefix-len", prefix, "--page-size", page_size,
                     "--tree-cache", tree_cache, *QUICK)
    (case,) = doc["cases"]
    assert case["cached_prefix_len"] == cached
    assert case["prefill_new_tokens"] == bs * (input_len - cached)
    # New pages only: the prefix's last page is continued, the rest are fresh pages.
    new_pages = cdiv(input_len, page_size) - cdiv(cached, page_size)
    assert case["prefill_allocated_tokens"] == bs * new_pages * page_size < bs * input_len
    assert case["idle"]["ok"], case["idle"]


def test_result_file_gets_one_line_per_case(tmp_path):
    path = tmp_path / "results.jsonl"
    args = ("-b", "1,2", "--input-len", 32, "--run-name", "nightly", "--result-file", path, *QUICK)
    assert invoke(*args).exit_code == 0
    assert len(path.read_text().splitlines()) == 2
    assert invoke(*args).exit_code == 0
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(lines) == 4
    assert [line["batch_size"] for line in lines] == [1, 2, 1, 2]
    assert all(line["run_name"] == "nightly" and line["page_size"] == 1 for line in lines)


def test_null_cache_takes_the_config_page_size():
    doc = bench_json("-b", 3, "--input-len", 40, "--page-size", 16, *QUICK)
    (case,) = doc["cases"]
    assert set(case["page_sizes"].values()) == {16}
    assert case["prefill_allocated_tokens"] == 3 * 48

    cfg = replace(load_config(None, ["runtime.device=cpu"]), memory={"page_size": 16}, cache={"kind": "none"})
    stack = build_stack(cfg)
    assert isinstance(stack.tree_cache, NullCache) and stack.tree_cache.page_size == 16
    case_runner = CaseRunner(stack, Case(batch_size=3, input_len=40, output_len=2, prefix_len=0, page_size=16))
    case_runner.start()
    case_runner.prefill()
    table = stack.req_to_token_pool.req_to_token
    for req in case_runner.reqs:
        slots = table[req.req_pool_idx, :40].to(torch.int64)
        assert slots[0] % 16 == 0, "each request starts on a fresh page"
        assert torch.equal(slots % 16, torch.arange(40) % 16), "position t sits at offset t % 16"
        assert torch.equal(slots[1:16] - slots[:15], torch.ones(15, dtype=torch.int64))
    assert stack.allocator.in_use_tokens == 3 * 48


@pytest.mark.parametrize("with_index", [True, False])
@pytest.mark.parametrize("page_size, rows", [(1, None), (4, None), (4, [5, 2, 9])])
def test_batched_release_frees_what_per_request_release_frees(page_size, rows, with_index):
    """The one-gather release of the null cache leaves the same free list as cache_finished_req
    (rows [5, 2, 9]: out of order, so the release gathers instead of slicing, by the batch's
    device rows or by rows it builds itself)."""
    free_lists = []
    for batched in (True, False):
        # SGLang 0.5.5's rows (FIFO from row 0); 0.5.23 hands them out from the tail.
        cfg = replace(load_config(None, ["runtime.device=cpu", "semantics.engine=sglang-0.5.5"]),
                      memory={"page_size": page_size},
                      cache={"kind": "none"})
        stack = build_stack(cfg)
        pool = stack.req_to_token_pool
        case_runner = CaseRunner(stack, Case(batch_size=3, input_len=30, output_len=3, prefix_len=7,
                                             page_size=page_size))
        case_runner.start()
        others = []
        if rows is not None:
            others = [r for r in pool.alloc(pool.size) if r not in rows]
            pool.free(rows)
        case_runner.batch.prepare_for_extend()
        assert [r.req_pool_idx for r in case_runner.reqs] == (rows or [0, 1, 2])
        for _ in range(3):
            case_runner.batch.prepare_for_decode()
        case_runner.ready_to_finish()
        if batched:
            index = case_runner.batch.req_pool_indices if with_index else None
            stack.memory.release_all(case_runner.reqs, index)
            assert all(r.kv_freed for r in case_runner.reqs)
        else:
            with stack.memory.free_group():
                for req in case_runner.reqs:
                    stack.memory.release(req)
        if others:
            pool.free(others)
        assert stack.allocator.available_size() == stack.allocator.size
        assert pool.available_size() == pool.size
        free_lists.append(stack.allocator.free_page_ids().tolist())
    assert free_lists[0] == free_lists[1]


def test_impossible_batch_says_what_fits():
    result = invoke("-b", 32, "--input-len", 1024)
    assert result.exit_code == 2
    assert result.stderr.startswith("error: ") and "does not fit" in result.stderr
    assert "hint: largest batch size that fits: 15" in result.stderr
    assert "memory.max_total_tokens=33280" in result.stderr
    assert result.stdout == "" and "Traceback" not in result.stderr


def test_capacity_counts_whole_pages():
    # 1,030 + 1 tokens: 15 requests fit 16,384 slots token by token, but a request takes two
    # pages of 1,024, so only 8 fit at page size 1,024.
    config = load_config(None, ["runtime.device=cpu"])
    check_capacity(Case(15, 1030, 1, 0, 1), config)
    paged = replace(config, memory={"page_size": 1024})
    check_capacity(Case(8, 1030, 1, 0, 1024), paged)
    with pytest.raises(CapacityError) as err:
        check_capacity(Case(9, 1030, 1, 0, 1024), paged)
    assert "18,432 KV tokens" in err.value.message and "largest batch size that fits: 8" in err.value.hint
    result = invoke("-b", 9, "--input-len", 1030, "--output-len", 1, "--page-size", 1024)
    assert result.exit_code == 2 and "largest batch size that fits: 8" in result.stderr


def test_too_many_requests_for_the_request_table():
    result = invoke("-b", 65, "--input-len", 8, "--output-len", 1)
    assert result.exit_code == 2
    assert "request table 64 rows" in result.stderr and "memory.max_running_requests=65" in result.stderr


@pytest.mark.parametrize("args, words", [
    (("--input-len", 5000), "max_context_len"),
    (("--prefix-len", 512), "not shorter than --input-len"),
    (("-b", "x"), "not an integer"),
    (("--page-size", 3), "not a power of two"),
    (("--tree-cache", "lru"), "--tree-cache"),
    (("-b", 0), "at least 1"),
    (("--repeat", 0), "--repeat"),
    (("--set", "memory.page_size=3"), "memory.page_size"),
])
def test_bad_input_exits_2_with_error_and_hint(args, words):
    result = invoke(*args)
    assert result.exit_code == 2, result.stdout
    lines = result.stderr.splitlines()
    assert lines[0].startswith("error: ") and words in result.stderr
    assert any(line.startswith("hint: ") for line in lines)
    assert "Traceback" not in result.stderr and result.stdout == ""


def test_result_file_in_a_missing_folder(tmp_path):
    result = invoke("--result-file", tmp_path / "no" / "r.jsonl")
    assert result.exit_code == 2 and "error: --result-file" in result.stderr


def test_header_explains_the_device_column_only_on_a_gpu():
    from types import SimpleNamespace

    from memcli.tools.bench_one_batch.report import header_line

    def header(method):
        return header_line(SimpleNamespace(options={"repeat": 3, "warmup": 1, "tree_cache": "none"},
                                           timing_method=method, device="cuda (H200)", semantics="memcli"))

    assert "queued behind a busy stream" in header("cuda-events")
    assert "queued" not in header("wall-clock (cpu)") and "synchronized wall clock" in header("wall-clock (cpu)")


def test_first_prefill_of_a_case_is_the_prefix_warm_up_when_there_is_one():
    from memcli.tools.bench_one_batch.cases import Case
    from memcli.tools.bench_one_batch.runner import CaseRunner
    from memcli.config import load_config
    from memcli.stack import build_stack

    stack = build_stack(load_config(None))
    with_prefix = CaseRunner(stack, Case(2, 64, 2, 32, stack.allocator.page_size))
    with_prefix.start()
    assert with_prefix.warm_prefill_s is not None and with_prefix.warm_prefill_s > 0
    without = CaseRunner(stack, Case(2, 64, 2, 0, stack.allocator.page_size))
    without.start()
    assert without.warm_prefill_s is None
