"""Workloads: trace readers and generators. Pure data in, request specs out."""

from memcli.workload.generate import TraceSummary, generate_trace, prefix_reuse_tokens, summarize_records, write_trace
from memcli.workload.readers import read_trace
from memcli.workload.spec import RequestSpec, Trace, output_token_base

__all__ = [
    "RequestSpec",
    "Trace",
    "TraceSummary",
    "generate_trace",
    "output_token_base",
    "prefix_reuse_tokens",
    "read_trace",
    "summarize_records",
    "write_trace",
]
