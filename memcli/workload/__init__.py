"""Workloads: trace readers (`readers`) and the generator (`generate`). Pure data in, request
specs out.

The names below are imported on first use (PEP 562), so that the CLI can read the defaults
for its --help without importing numpy.
"""

from __future__ import annotations

import importlib
from typing import Any

FORMATS = ("auto", "memcli", "mooncake")
DEFAULT_MAX_TOKENS = 50_000_000  # gen-trace --max-tokens: about 300 MB of JSON and a few GB while generating

_LAZY = {
    "RequestSpec": "spec", "Trace": "spec", "output_token_base": "spec",
    "TraceSummary": "generate", "generate_trace": "generate", "prefix_reuse_tokens": "generate",
    "summarize_records": "generate", "write_trace": "generate",
    "read_trace": "readers",
}
__all__ = ["FORMATS", "DEFAULT_MAX_TOKENS", *_LAZY]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(f"memcli.workload.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'memcli.workload' has no attribute {name!r}")
