"""The decode memory path as a CUDA-graph replay gives exactly the eager path's slots.

GPU only: CUDA graphs need a device. The kernel it replays (`alloc_decode_step`) is tested
on the CPU in tests/kernels/test_kernel_decode_step.py.
"""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from memcli.cli.app import app
from memcli import kernels
from memcli.config import load_config, replace
from memcli.errors import ConfigError
from memcli.mem_cache.decode_graph import DecodeGraphs, _Graph
from memcli.stack import build_stack
from memcli.tools.bench_one_batch.cases import Case
from memcli.tools.bench_one_batch.runner import CaseRunner
from tests.tools.replay.helpers import CONVERSATION

class CpuReplayGraphs(DecodeGraphs):
    """`DecodeGraphs` whose "graph" replays the torch reference of the captured step on the
    CPU, over the same static buffers: the bookkeeping around the replay (the device copy of
    the free list, the lengths kept in place, the rows copied when they change) runs as on a GPU."""

    def _capture(self, bs):
        seq, rows = torch.zeros(bs, dtype=torch.int64), torch.zeros(bs, dtype=torch.int64)
        out = torch.empty(bs, dtype=torch.int64)

        class Replay:
            def replay(_):
                kernels.alloc_decode_step(seq, rows, self.req_to_token, self.free_pages, self.state, self.page_size,
                                          self.ring, out=out, backend="torch", validate=False)

        g = self._graphs[bs] = _Graph(Replay(), seq, rows, out)
        self.captures += 1
        return g


def _cpu_decoded_rows(graphs: bool, page_size: int, steps: int = 12):
    """Decode steps with a free, a filter and a restore between them; every slot written."""
    stack = build_stack(replace(load_config(None, ["runtime.device=cpu"]), memory={"page_size": page_size}))
    allocator = stack.allocator
    if graphs:
        allocator.decode_graphs = CpuReplayGraphs(allocator._buf, stack.req_to_token_pool.req_to_token, page_size,
                                                  ring=page_size == 1)
    runner = CaseRunner(stack, Case(6, 29, steps, 0, page_size))
    runner.start()
    runner.batch.prepare_for_extend()
    outs = []
    for i in range(steps):
        if i == 3:  # a free between steps moves the head on the host
            allocator.free(allocator.alloc(page_size))
        if i == 5:  # new rows: a request leaves the batch
            runner.batch.filter_batch([0, 2, 3, 4, 5])
        if i == 7:  # the bench's restore: the same step twice from one snapshot
            snap = runner.snapshot_decode()
            runner.batch.prepare_for_decode()
            runner.restore_decode(snap)
        runner.batch.prepare_for_decode()
        outs.append(runner.batch.out_cache_loc.clone())
    table = stack.req_to_token_pool.req_to_token
    rows = torch.stack([table[r.req_pool_idx, : 29 + steps] for r in runner.reqs])
    return outs, rows, runner.batch.seq_lens.clone(), allocator.decode_graphs


@pytest.mark.parametrize("page_size", [1, 16])
def test_the_replay_bookkeeping_gives_the_eager_slots_on_a_cpu(page_size):
    on, rows_on, seq_on, graphs = _cpu_decoded_rows(True, page_size)
    off, rows_off, seq_off, _ = _cpu_decoded_rows(False, page_size)
    assert graphs.captures == 2  # six requests, then five
    assert all(torch.equal(a, b) for a, b in zip(on, off))
    assert torch.equal(rows_on, rows_off) and torch.equal(seq_on, seq_off)


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")


def test_on_without_cuda_is_a_config_error():
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(ConfigError, match="runtime.decode_graph"):
        build_stack(load_config(None, ["runtime.device=cpu", "runtime.decode_graph=true"]))


def test_auto_is_off_on_a_cpu():
    stack = build_stack(load_config(None, ["runtime.device=cpu"]))
    assert stack.allocator.decode_graphs is None


def _decoded_rows(mode: str, page_size: int, steps: int):
    cfg = load_config(None, ["runtime.device=cuda", f"runtime.decode_graph={mode}"])
    cfg = replace(cfg, memory={"page_size": page_size})
    stack = build_stack(cfg)
    case = Case(7, 37, steps, 0, page_size)
    runner = CaseRunner(stack, case)
    runner.start()
    runner.batch.prepare_for_extend()
    outs = []
    for i in range(steps):
        runner.batch.prepare_for_decode()
        outs.append(runner.batch.out_cache_loc.clone())
        if i == steps // 2:  # a free between steps moves the head on the host
            stack.allocator.free(stack.allocator.alloc(page_size))
    rows = torch.stack([stack.req_to_token_pool.req_to_token[r.req_pool_idx, : 37 + steps] for r in runner.reqs])
    graphs = stack.allocator.decode_graphs
    return torch.stack(outs).cpu(), rows.cpu(), runner.batch.seq_lens.cpu(), graphs


@cuda
@pytest.mark.parametrize("page_size", [1, 16])
def test_graph_replays_give_the_eager_slots(page_size):
    out_on, rows_on, seq_on, graphs = _decoded_rows("true", page_size, 20)
    out_off, rows_off, seq_off, none = _decoded_rows("false", page_size, 20)
    assert graphs is not None and graphs.captures == 1 and none is None
    assert torch.equal(out_on, out_off) and torch.equal(rows_on, rows_off) and torch.equal(seq_on, seq_off)


@cuda
@pytest.mark.parametrize("page_size", [1, 16])
def test_a_replay_with_graphs_is_the_replay_without(page_size):
    """The scheduler's whole run (admission, eviction, retraction, finish) is unchanged."""
    docs = {}
    for mode in ("true", "false"):
        result = CliRunner().invoke(app, ["replay", str(CONVERSATION), "--limit", "40", "--json",
                                          "--set", "runtime.device=cuda", "--set", f"runtime.decode_graph={mode}",
                                          "--set", f"memory.page_size={page_size}"])
        assert result.exit_code == 0, result.stderr
        doc = json.loads(result.stdout)
        del doc["config"]  # differs in runtime.decode_graph itself
        for section, key in (("summary", "wall_time_s"), ("summary", "steps_per_s"), ("integrity", "check_s")):
            doc.get(section, {}).pop(key, None)
        docs[mode] = doc
    assert docs["true"] == docs["false"]


class _PlacedGraphs:
    """Records where the allocator tells the device copy of its free list to be."""

    req_to_token = None

    def __init__(self):
        self.placed = []

    def place(self, head, num_free):
        self.placed.append((head, num_free))


@pytest.mark.parametrize("page_size", [1, 16])
def test_a_restore_places_the_free_list_for_the_next_replay(page_size):
    """After a restore the device copy is set at once (untimed setup in the bench), so the
    decode step that follows is the graph launch alone, as in a steady decode loop."""
    stack = build_stack(replace(load_config(None, ["runtime.device=cpu"]), memory={"page_size": page_size}))
    allocator = stack.allocator
    state = allocator.backup_state()
    allocator.alloc(3 * page_size)
    graphs = allocator.decode_graphs = _PlacedGraphs()
    allocator.restore_state(state)
    assert graphs.placed == [(allocator._head, allocator._num_free)]
    assert allocator._num_free == allocator.num_pages


def _restored_steps(mode: str, page_size: int, repeats: int):
    """The bench's decode phase: the same step `repeats` times from one snapshot."""
    cfg = load_config(None, ["runtime.device=cuda", f"runtime.decode_graph={mode}"])
    stack = build_stack(replace(cfg, memory={"page_size": page_size}))
    runner = CaseRunner(stack, Case(5, 33, 3, 0, page_size))
    runner.start()
    runner.prefill()
    runner.decode_step()
    snap = runner.snapshot_decode()
    outs = []
    for _ in range(repeats):
        runner.restore_decode(snap)
        runner.decode_memory()
        # Column 34 is the step's slot (the prompt took 33, the first decode step one).
        rows = [r.req_pool_idx for r in runner.reqs]
        outs.append(stack.req_to_token_pool.req_to_token[rows, : 33 + 2].cpu())
    return outs, stack.allocator.decode_graphs


@cuda
@pytest.mark.parametrize("page_size", [1, 16])
def test_replays_after_a_restore_give_the_eager_slots(page_size):
    on, graphs = _restored_steps("true", page_size, 4)
    off, _ = _restored_steps("false", page_size, 4)
    assert graphs is not None and graphs.captures == 1
    assert all(torch.equal(a, on[0]) for a in on) and all(torch.equal(a, b) for a, b in zip(on, off))
