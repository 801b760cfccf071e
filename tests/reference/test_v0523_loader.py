"""SGLang 0.5.23's real modules load on CPU behind the documented stand-ins, with both tree cores."""

from memcli.reference.v0523.standins import STANDINS
from memcli.reference.v0523.loader import AUTO_STUBS


def test_memory_stack_modules_import_for_real(worker0523):
    info = worker0523.call("info")
    assert info["classes"] == {
        "UnifiedRadixCache": "sglang.srt.mem_cache.unified_radix_cache",
        "TokenToKVPoolAllocator": "sglang.srt.mem_cache.allocator.token",
        "PagedTokenToKVPoolAllocator": "sglang.srt.mem_cache.allocator.paged",
        "ReqToTokenPool": "sglang.srt.mem_cache.memory_pool",
        "Req": "sglang.srt.managers.schedule_batch",
        "ScheduleBatch": "sglang.srt.managers.schedule_batch",
        "PrefillAdder": "sglang.srt.managers.schedule_policy",
    }
    assert info["allocation"] == "sglang.srt.mem_cache.allocation"
    # only the listed modules are replaced, and only missing third-party packages are stubbed
    assert set(info["standins"]) <= set(STANDINS) and set(info["stubbed"]) <= set(AUTO_STUBS)


def test_both_tree_cores_are_built(worker0523):
    assert worker0523.call("info")["cores"] == {"rust": "RustUnifiedTreeCore", "python": "UnifiedTreeCore"}
