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
