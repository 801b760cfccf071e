"""The size check before any allocation: estimate, comparison, message and hint."""

import pytest
import torch
from typer.testing import CliRunner

from memcli import footprint
from memcli.cli.app import app
from memcli.config import load_config
from memcli.errors import CapacityError
from memcli.footprint import check_footprint, estimate_stack_bytes
from memcli.stack import build_stack

CPU = torch.device("cpu")
GIB = 1 << 30


@pytest.fixture
def available(monkeypatch):
    def set_available(num_bytes: int) -> None:
        monkeypatch.setattr(footprint, "available_bytes", lambda device: (num_bytes, "MemAvailable"))
    return set_available


def test_estimate_counts_every_buffer():
    cfg = load_config(None, [])  # 16,384 slots of 2 KiB, 64 rows of 4,100 columns, page size 1, radix
    need = estimate_stack_bytes(cfg)
    assert need.kv_buffers == (16384 + 1) * 2048
    assert need.req_to_token == 64 * 4100 * 4
    assert need.free_lists == (16384 + 1) * 24
    assert need.tree == 16384 * 16
    assert estimate_stack_bytes(cfg, "indices").kv_buffers == 0


def test_materialized_over_the_limit_hints_indices(available):
    available(24 * GIB)
    cfg = load_config("configs/llama3-8b-h200.yaml", ["runtime.device=cpu"])
    with pytest.raises(CapacityError) as info:
        check_footprint(cfg, CPU)
    assert info.value.message.startswith("memory: the stack needs 80.3 GiB (K/V buffers 80.0 GiB, req_to_token 256.0 MiB")
    assert "but the cpu has 24.0 GiB (MemAvailable; 90% usable: 21.6 GiB)" in info.value.message
    assert info.value.hint == "use --set memory.kv_pool=indices (slot bookkeeping only, no K/V buffers)"


def test_indices_over_the_limit_hints_the_largest_pool_that_fits(available):
    available(GIB)
    cfg = load_config(None, ["memory.kv_pool=indices", "memory.max_total_tokens=1000000000000000"])
    with pytest.raises(CapacityError) as info:
        check_footprint(cfg, CPU)
    tokens = int(info.value.hint.rsplit("=", 1)[1])
    fits = load_config(None, ["memory.kv_pool=indices", f"memory.max_total_tokens={tokens}"])
    assert estimate_stack_bytes(fits).total <= 0.9 * GIB < estimate_stack_bytes(
        load_config(None, ["memory.kv_pool=indices", f"memory.max_total_tokens={tokens + 1024}"])).total


def test_build_stack_checks_before_allocating(available, monkeypatch):
    available(1 << 20)
    monkeypatch.setattr(torch, "zeros", lambda *a, **k: pytest.fail("allocated before the check"))
    with pytest.raises(CapacityError):
        build_stack(load_config(None, ["runtime.device=cpu"]))


# check-page-size runs these configs on an indices-only pool of its own (exit 0).
@pytest.mark.parametrize("command", [["bench-one-batch"], ["replay", "tests/data/conversation_head300.jsonl"]])
def test_shipped_gpu_config_on_a_small_cpu_is_exit_2_up_front(available, command):
    available(24 * GIB)
    result = CliRunner().invoke(app, [*command, "--config", "configs/llama3-8b-h200.yaml",
                                      "--set", "runtime.device=cpu"])
    assert result.exit_code == 2, result.output
    errors = [line for line in result.stderr.splitlines() if not line.startswith("note: ")]
    assert errors[0].startswith("error: memory: the stack needs ") and errors[1].startswith("hint: ")
