"""Whether every request of a run can ever run whole, checked before anything runs
(`check_fits`, called by every command that replays requests: replay and its study,
check-page-size on a trace, reference diff).

A request fits when it runs whole in one request row (`memory.max_context_len`, with the two
tokens more that SGLang's request limits need under `semantics.request_limits: max_req_len`)
and an empty pool both admits and holds it (`pool_need`). The first request that does not is
a `CapacityError` (exit 2) naming it, with a hint whose settings hold every request given, or
the number of requests before it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from memcli.config import REQ_INPUT_MARGIN, Config
from memcli.errors import CapacityError
from memcli.mem_cache.pages import align_up
from memcli.workload.spec import RequestSpec


def check_fits(config: Config, requests: Sequence[RequestSpec], source: str | Path,
               fewer_flag: str = "--limit") -> None:
    """Raise `CapacityError` for the first request that can never run whole: longer than a
    request row (`memory.max_context_len`), than SGLang's request limits allow under
    `semantics.request_limits: max_req_len` (which would clip its output or abort it), or more
    than an empty pool admits or holds. `source` names where the requests come from (a trace
    path) in the message; `fewer_flag` is the command's option for replaying fewer requests.
    The hint's values hold every request given (the largest need), so that following it is
    enough."""
    ps, pool, context = config.page_size, config.pool_size, config.memory.max_context_len
    sglang = config.behaviour.request_limits in ("max_req_len", "memory_clip")
    for index, spec in enumerate(requests):
        need = spec.input_len + spec.output_len
        whole = config.context_need(spec.input_len, spec.output_len)
        where = f"{source}:{spec.line}: request {spec.rid} (#{index + 1})" if spec.line else \
            f"{source}: request {spec.rid} (#{index + 1})"
        if whole > context:
            what = f", more than memory.max_context_len {context}"
            if sglang:
                what += (f" holds under SGLang 0.5.5's request limits: it runs whole only with max_context_len >= {whole}"
                         f" (the longest request, max_req_len, is one token under the context; an output is clipped"
                         f" to max_req_len - input - 1 and a prompt of max_req_len - {REQ_INPUT_MARGIN} tokens or"
                         f" more is aborted; semantics.request_limits, which the memcli profile sets to row:"
                         f" input + output)")
            raise CapacityError(f"{where} needs {need} tokens (input {spec.input_len} + output {spec.output_len}){what}",
                                _fit_hint(config, requests, index, fewer_flag))
        if pool_need(config, spec.input_len, spec.output_len) > pool:
            raise CapacityError(
                f"{where} needs {align_up(need, ps)} tokens ({need} rounded to pages of {ps}) but the pool holds {pool}",
                _fit_hint(config, requests, index, fewer_flag))


def pool_need(config: Config, input_len: int, output_len: int) -> int:
    """The smallest pool (tokens, whole pages) that admits and holds one request alone. (SGLang's
    request limits also bound a request by the pool, but the context, which the config keeps
    within the pool, is the tighter bound: `check_fits` tests it first.)"""
    ps, clip = config.page_size, config.scheduler.max_new_tokens_clip
    return max(align_up(input_len + output_len, ps), align_up(input_len + min(output_len, clip) + 1, ps))


def _fit_hint(config: Config, requests: Sequence[RequestSpec], index: int, fewer_flag: str) -> str:
    """Settings that hold the largest request given, or fewer requests."""
    mem = config.memory
    context = max(max(config.context_need(s.input_len, s.output_len) for s in requests), mem.max_context_len)
    pool = max(max(pool_need(config, s.input_len, s.output_len) for s in requests),
               align_up(context, config.page_size), config.pool_size)
    settings = []
    if context > mem.max_context_len:
        settings.append(f"--set memory.max_context_len={context}")
    if pool > config.pool_size:
        settings.append(f"--set memory.max_total_tokens={pool}"
                        + (" --set memory.kv_budget_gib=null" if mem.kv_budget_gib is not None else ""))
    fewer = f"replay fewer requests ({fewer_flag} {index}), or " if index else ""
    return f"{fewer}hold every request of the trace: {' '.join(settings)}"
