"""memcli.timing: the one timing helper, the sync counter and its message filter."""

import pytest
import torch

from memcli.timing import Call, count_syncs, is_sync_warning, time_call, time_calls, wall_time

CPU = torch.device("cpu")


def test_sync_warnings_are_told_from_the_prototype_notice():
    assert is_sync_warning("called a synchronizing CUDA operation")
    assert not is_sync_warning("Synchronization debug mode is a prototype feature and does not yet detect all"
                               " synchronizing operations (Triggered internally at Module.cpp:1003.)")
    assert not is_sync_warning("some other warning")


def test_time_call_on_a_cpu_runs_setup_before_every_call():
    order = []
    timing = time_call(lambda: order.append("call"), CPU, repeat=4, warmup=2, setup=lambda: order.append("setup"))
    assert order == ["setup", "call"] * 6
    assert timing.samples == 4 and timing.method == "wall-clock (cpu)"
    assert 0 <= timing.min_us <= timing.median_us
    assert timing.device_us is None  # no device to queue on
    assert count_syncs(lambda: None, CPU) is None
    assert wall_time(lambda: None, CPU) >= 0


def test_time_calls_takes_the_samples_in_turn():
    """Warm-up and timed calls alternate between the functions, each after its own setup,
    so a slow spell of the machine falls on both; each gets its own figures."""
    order = []
    a = Call(lambda: order.append("a"), setup=lambda: order.append("set a"))
    b = Call(lambda: order.append("b"))
    ta, tb = time_calls([a, b], CPU, repeat=3, warmup=1)
    assert order == ["set a", "a", "b"] * 4
    assert ta.samples == tb.samples == 3 and ta.device_us is None and tb.device_us is None


def test_the_garbage_collector_is_paused_while_timing_and_restored_after():
    import gc

    seen = []
    time_call(lambda: seen.append(gc.isenabled()), CPU, repeat=3, warmup=1)
    assert seen == [False] * 4 and gc.isenabled()
    gc.disable()
    try:  # a caller that had paused it keeps it paused
        time_call(lambda: None, CPU, repeat=1, warmup=0)
        assert not gc.isenabled()
    finally:
        gc.enable()


@pytest.mark.gpu
def test_gpu_sync_count_and_device_time():
    cuda = torch.device("cuda")
    x = torch.zeros(1, device=cuda)
    assert count_syncs(lambda: x.add_(1), cuda) == 0  # the prototype notice, if it comes now, is not a sync
    assert count_syncs(lambda: x.item(), cuda) == 1
    assert count_syncs(lambda: x.add_(1), cuda) == 0
    timing = time_call(lambda: x.add_(1), cuda, repeat=5, warmup=1)
    assert timing.method == "cuda-events" and timing.device_us is not None and timing.device_us > 0
