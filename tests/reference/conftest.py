"""The `ref` fixture: SGLang 0.5.5's real modules, or a skip when PyPI cannot be reached.

Only an unreachable package index skips (the reason is printed with `-rs`); any other
failure to fetch or import the reference fails the test.
"""

import pytest

from memcli.reference import load_reference, unavailable_reason


@pytest.fixture(scope="session")
def ref():
    reason = unavailable_reason()
    if reason is not None:
        print(f"\nskipping SGLang reference tests: {reason}")
        pytest.skip(reason)
    return load_reference()


@pytest.fixture(scope="session")
def worker0523():
    """A worker process running SGLang 0.5.23's real code, or a skip saying why it cannot
    (no build of the wheel for this Python, an unreachable index, msgspec missing)."""
    from memcli.reference.v0523.client import Worker0523, unavailable_reason_0523

    reason = unavailable_reason_0523()
    if reason is not None:
        print(f"\nskipping SGLang 0.5.23 reference tests: {reason}")
        pytest.skip(reason)
    with Worker0523() as worker:
        yield worker
