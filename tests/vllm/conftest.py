"""vLLM 0.33.0's real code, fetched from its wheel once; every test here skips (with the
reason) when the package index cannot be reached and the wheel is not cached."""

import pytest

from memcli.reference.vllm033.loader import vllm_unavailable_reason


@pytest.fixture(scope="session")
def vllm_ref():
    reason = vllm_unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    from memcli.reference.vllm033.loader import load_vllm
    return load_vllm()
