"""Where the prefill and free memory paths spend their time, on the device at hand.

    python docs/measurements/profile_memory_path.py OUT.json [--engine sglang-0.5.5]

For page sizes 1 and 16, batch sizes 1 and 32 (input 1536, no prefix, the H200 config with
`memory.kv_pool: indices`), the bench's own case is started and prefilled once; then:

* `latency_us`: the phase timed as `bench-one-batch` times it (`memcli.timing.time_call`);
* `host_us`: the host's part alone, `perf_counter_ns` around the call, the device idle before;
* `parts_us`: each step of the path called alone in a loop, median per call (the
  allocation of the output, the plan arena, the launch, the views, the row, ...);
* `profile`: torch.profiler's CPU table over 200 calls (the CUDA runtime and driver calls
  and the aten operators each call makes, with their host time).

The one-kernel graph replay (the launch floor) is timed the same ways. Prints one JSON
document; writes it to OUT.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from memcli import engines, kernels
from memcli.config import load_config
from memcli.tools.bench_one_batch.cases import Case
from memcli.tools.bench_one_batch.rounds import GraphFloor, case_configs
from memcli.tools.bench_one_batch.runner import CaseRunner
from memcli.timing import time_call

LOOPS = 2000


def per_call_us(fn, setup=None, loops: int = LOOPS) -> float:
    """Median host time of `fn` in µs (after `setup`, untimed, and the device idle)."""
    samples = []
    for _ in range(loops):
        if setup is not None:
            setup()
        torch.cuda.synchronize()
        t0 = time.perf_counter_ns()
        fn()
        samples.append(time.perf_counter_ns() - t0)
    return statistics.median(samples) / 1e3


def tight_us(fn, loops: int = LOOPS) -> float:
    """Host time per call of `fn` called back to back (no setup, no sync in between)."""
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter_ns()
    for _ in range(loops):
        fn()
    elapsed = time.perf_counter_ns() - t0
    torch.cuda.synchronize()
    return elapsed / loops / 1e3


def profile_table(fn, setup, calls: int = 200) -> str:
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            setup()
            torch.cuda.synchronize()
            fn()
            torch.cuda.synchronize()
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25)


def prefill_parts(runner: CaseRunner) -> dict:
    """Each step of the triton prefill memory path called alone."""
    memory = runner.memory
    alloc = memory.allocator
    plan = runner.batch.extend_plan
    table = memory.req_to_token_pool.req_to_token
    device = table.device
    bs, n = len(plan.rows), plan.extend_num_tokens
    buf = torch.empty(3 * bs + n, dtype=torch.int64, device=device)
    rows = list(range(1, bs + 1))
    arena = kernels.alloc._plan_arena
    host_plan = plan.host_plan

    def launch():
        p, address = arena.take(6 * bs, device)
        p[:] = host_plan
        p[2 * bs: 3 * bs] = rows
        kernels.alloc._alloc_extend_write_launch(
            (bs,), address, table, alloc._buf, buf, bs, alloc._head, alloc._buf.shape[0], plan.num_pages,
            table.stride(0), n, alloc.page_size, kernels.alloc._EXTEND_BLOCK)

    def plan_copy():
        p, _ = arena.take(6 * bs, device)
        p[:] = host_plan
        p[2 * bs: 3 * bs] = rows

    pool = memory.req_to_token_pool

    def row_take():
        got = pool.alloc(bs)
        pool.free(got)

    parts = graph_parts(alloc, plan, table, rows) if alloc.extend_graphs is not None else {}
    return parts | {
        "torch_empty": tight_us(lambda: torch.empty(3 * bs + n, dtype=torch.int64, device=device)),
        "arena_take": tight_us(lambda: arena.take(6 * bs, device)),
        "plan_copy_and_rows": tight_us(plan_copy),
        "launch_extend_kernel (arena, plan copy, launcher)": tight_us(launch),
        "split_with_sizes": tight_us(lambda: buf.split_with_sizes((bs, bs, bs, n))),
        "row_alloc_and_free": tight_us(row_take),
        "available_size": tight_us(alloc.available_size),
    }


def graph_parts(alloc, plan, table, rows) -> dict:
    """The extend as a graph replay (`ExtendGraphs`), whole and in parts; the free list is
    read, never advanced, so the calls can repeat."""
    graphs = alloc.extend_graphs
    args = (table, rows, plan.prefix_lens_cpu, plan.seq_lens_cpu, plan.prefix_tensors, alloc._head,
            plan.num_pages, plan.extend_num_tokens, plan.host_plan)
    graphs.write(*args)
    torch.cuda.synchronize()
    graph = next(iter(graphs._graphs.values()))
    bs, n = len(rows), plan.extend_num_tokens
    out = kernels.extend_output(bs, n, table.device)
    block = graphs._args[: graphs._stride]
    grid = kernels.alloc.next_power_of_2(bs)
    return {
        "extend_graph_write (whole)": tight_us(lambda: graphs.write(*args)),
        "extend_graph_fill_args": tight_us(lambda: kernels.fill_extend_args(
            block, grid, rows, plan.prefix_lens_cpu, plan.seq_lens_cpu, plan.prefix_tensors, alloc.page_size, out,
            n, alloc._head, plan.num_pages, 0, plan.host_plan)),
        "extend_graph_views": tight_us(lambda: kernels.extend_views(out, bs, n)),
        "graph_replay_alone": tight_us(graph.replay),
        "extend_graph_waits_so_far": graphs.waits,
    }


def free_parts(runner: CaseRunner) -> dict:
    memory = runner.memory
    alloc = memory.allocator
    table = memory.req_to_token_pool.req_to_token
    bs, length = runner.case.batch_size, runner.reqs[0].kv.kv_allocated_len
    ps = alloc.page_size
    scratch = torch.empty_like(alloc._buf)

    def launch():
        kernels.free_rows_triton(table, 1, None, bs, length, scratch, 0, ps, ps > 1)

    return {"launch_free_rows_kernel": tight_us(launch)}


def phase(runner: CaseRunner, fn, setup, device) -> dict:
    t = time_call(fn, device, repeat=200, warmup=20, setup=setup)
    return {"latency_us": t.median_us, "device_us": t.device_us, "host_us": per_call_us(fn, setup),
            "profile": profile_table(fn, setup)}


def floor_figures(device) -> dict:
    floor = GraphFloor(device)
    t = time_call(floor.replay, device, repeat=200, warmup=20)
    x = torch.zeros(1, dtype=torch.int64, device=device)
    return {"latency_us": t.median_us, "host_us": per_call_us(floor.replay),
            "graph_replay_tight_us": tight_us(floor.replay), "aten_add_tight_us": tight_us(lambda: x.add_(1)),
            "python_call_ns": python_call_ns()}


def python_call_ns() -> float:
    """A plain Python function call, to compare this host's interpreter with another's."""
    def f(a, b):
        return a
    t0 = time.perf_counter_ns()
    for i in range(200000):
        f(i, i)
    return (time.perf_counter_ns() - t0) / 200000


def profile_case(config, bs: int, ps: int, device) -> dict:
    case = Case(batch_size=bs, input_len=1536, output_len=4, prefix_len=0, page_size=ps)
    cfg = case_configs(config, [case], "none")[ps]
    stack = engines.get(cfg).build_stack(cfg)
    runner = CaseRunner(stack, case)
    runner.start()
    runner.prefill()
    out = {"prefill_memory": phase(runner, runner.prefill_memory, runner.restore_prefill, device)}
    out["prefill_parts_us"] = prefill_parts(runner)
    runner.restore_prefill()
    runner.prefill()
    for _ in range(runner.decode_steps):
        runner.decode_step()
    out["free"] = phase(runner, runner.finish, runner.before_finish, device)
    out["free_parts_us"] = free_parts(runner)
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--engine", default="sglang-0.5.5")
    args = parser.parse_args(argv)
    config = load_config("configs/llama3-8b-h200.yaml", ["memory.kv_pool=indices", f"semantics.engine={args.engine}"])
    device = torch.device("cuda")
    doc = {"device": torch.cuda.get_device_name(device), "torch": torch.__version__,
           "floor": floor_figures(device), "cases": {}}
    for ps in (1, 16):
        for bs in (1, 32):
            doc["cases"][f"page {ps}, bs {bs}"] = profile_case(config, bs, ps, device)
    with open(args.out, "w") as fh:
        json.dump(doc, fh, indent=1)
    for name, case in doc["cases"].items():
        print(f"== {name}")
        for ph in ("prefill_memory", "free"):
            c = case[ph]
            print(f"{ph}: latency {c['latency_us']:.1f} device {c['device_us']} host {c['host_us']:.1f}")
        print(json.dumps(case["prefill_parts_us"]), json.dumps(case["free_parts_us"]))
    print(json.dumps(doc["floor"]))
    print(doc["cases"]["page 1, bs 1"]["prefill_memory"]["profile"])
    print(doc["cases"]["page 1, bs 1"]["free"]["profile"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
