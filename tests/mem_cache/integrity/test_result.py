"""The result vocabulary: a report of named checks with their numbers."""

import pytest

from memcli.errors import IntegrityError
from memcli.mem_cache.integrity import CheckResult, IntegrityReport


def test_report_value_type():
    report = IntegrityReport("thing", [CheckResult("a", True, "1 == 1"), CheckResult("b", False, "2 != 3")])
    assert not report.ok
    assert [c.name for c in report.failures] == ["b"]
    assert "[FAIL] b: 2 != 3" in str(report)
    assert report.to_dict()["checks"][1] == {"name": "b", "ok": False, "detail": "2 != 3"}
    with pytest.raises(KeyError):
        report.check("c")
    with pytest.raises(IntegrityError, match="thing integrity check failed: b: 2 != 3"):
        report.raise_if_failed()
