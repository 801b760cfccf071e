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


def test_the_host_pool_counts_in_host_memory_and_its_hint_fits(available):
    """A hiradix host pool of a billion slots: 17 bytes each on a CPU (ring, its fill or a
    check's copy, a check's mark), counted with the stack; the hint's ratio fits."""
    settings = ["memory.kv_pool=indices", "cache.kind=hiradix", "cache.host_ratio=1000"]
    cfg = load_config(None, settings)
    need = estimate_stack_bytes(cfg)
    # 1,000 device pools and 0.5.23's padding page (the default engine; page size 1)
    assert need.host_pool == (16384 * 1000 + 1) * 17 and need.on_device == need.total - need.host_pool
    assert estimate_stack_bytes(cfg, device_type="cuda").host_pool == need.host_pool  # indices: no K/V on the host
    materialized = load_config(None, ["cache.kind=hiradix"])
    assert estimate_stack_bytes(materialized, device_type="cuda").host_pool == (16384 * 2 + 1) * (17 + 2048)
    available(GIB // 8)
    with pytest.raises(CapacityError) as info:
        check_footprint(cfg, CPU)
    assert "host pool" in info.value.message and "--set cache.host_ratio=" in info.value.hint
    ratio = info.value.hint.split("--set cache.host_ratio=")[1].split()[0]
    check_footprint(load_config(None, [*settings[:2], f"cache.host_ratio={ratio}"]), CPU)
    available(need.on_device * 10 // 9 + 1024)  # room for the stack, none for a host pool above the device pool
    with pytest.raises(CapacityError) as info:
        check_footprint(cfg, CPU)
    assert "lower memory.max_total_tokens" in info.value.hint


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


def test_a_gpu_stacks_host_pool_is_checked_against_host_memory(monkeypatch):
    """On a GPU the host pool (pinned K/V with a materialized pool) lives in host memory: the
    device may have room while the host has not."""
    room = {"cuda": 100 * GIB, "cpu": GIB}
    monkeypatch.setattr(footprint, "available_bytes", lambda device: (room[device.type], device.type))
    cfg = load_config(None, ["cache.kind=hiradix", "cache.host_ratio=64"])  # 1 Mi host slots of 2 KiB
    with pytest.raises(CapacityError) as info:
        check_footprint(cfg, torch.device("cuda"))
    assert info.value.message.startswith("memory: the hiradix host pool needs 2.0 GiB but the host has 1.0 GiB")
    assert "--set cache.host_ratio=" in info.value.hint
    room["cpu"] = 8 * GIB
    assert check_footprint(cfg, torch.device("cuda")).host_pool == (16384 * 64 + 1) * (17 + 2048)  # + padding page
