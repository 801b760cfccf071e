"""vLLM's real KV-cache manager loads from the wheel behind stand-ins that fail loudly."""

import pytest

from memcli.reference.fetch import VLLM, VLLM_EXTRACT
from memcli.reference.vllm033.standins import VllmStandInUsed, placeholder


def test_the_real_modules_come_from_the_wheel(vllm_ref):
    manager = vllm_ref.kv_cache_manager
    assert manager.__file__.startswith(str(vllm_ref.root)) and "vllm-0.33.0" in manager.__file__
    assert vllm_ref.block_pool.BlockPool.__module__ == "vllm.v1.core.block_pool"
    # the stand-ins replaced what the reference page lists, and nothing on the memory path itself
    assert "vllm.config" in vllm_ref.standins and "vllm.distributed.kv_events" in vllm_ref.standins
    assert not any(name.startswith("vllm.v1.core") for name in vllm_ref.standins)


def test_an_unknown_vllm_module_is_refused_by_name(vllm_ref):
    import importlib
    with pytest.raises(ModuleNotFoundError, match="vllm.model_executor is neither extracted from the vllm 0.33.0 wheel"):
        importlib.import_module("vllm.model_executor.models.llama")


def test_a_placeholder_refuses_to_be_used():
    cls = placeholder("VllmConfig")
    with pytest.raises(VllmStandInUsed, match="VllmConfig"):
        cls()


def test_the_wheel_spec_names_vllm_0_33():
    assert VLLM.requirement == "vllm==0.33.0" and "vllm/v1/core/" in VLLM_EXTRACT
