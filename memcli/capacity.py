"""Whether every request of a run can ever run whole, checked before anything runs
(`check_fits`, called by every command that replays requests: replay and its study,
check-page-size on a trace, reference diff), and what an engine's own limits do to the
requests that cannot (`cut_requests`).

A request fits when it runs whole in one request row (`memory.max_context_len`, with the two
tokens more that SGLang's request limits need under `semantics.request_limits: max_req_len`)
and an empty pool both admits and holds it (`pool_need`). The first request that does not is
a `CapacityError` (exit 2) naming it, with a hint whose settings hold every request given, or
the number of requests before it.

An engine may cut such requests as it would when serving them (`Engine.limits`, a `LimitRule`):
SGLang aborts a prompt too long for its request limits at arrival and clips an output to what
is left of them (`max_req_len_cuts`). `cut_requests` applies the engine's rule (or, under
`strict`, none) and checks that what is left fits; the cuts are reported, the replay runs.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, NamedTuple, Optional, Sequence

from memcli.config import REQ_INPUT_MARGIN, Config
from memcli.errors import CapacityError
from memcli.mem_cache.pages import align_up, output_room
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


class CutRequest(NamedTuple):
    """One request an engine's limits cut: aborted at arrival, or its output clipped."""

    index: int  # 0-based, in trace order
    rid: str
    line: Optional[int]  # the trace line (1-based), when known
    action: str  # "aborted" or "clipped"
    input_len: int
    output_len: int  # asked for
    kept_output_len: int  # what the engine serves (0: aborted)
    reason: str

    def to_dict(self) -> dict:
        return {"rid": self.rid, "line": self.line, "index": self.index, "action": self.action,
                "input_len": self.input_len, "output_len": self.output_len, "kept_output_len": self.kept_output_len,
                "reason": self.reason}

    def label(self) -> str:
        line = f"line {self.line}" if self.line else f"#{self.index + 1}"
        return f"{self.rid} ({line})"


@dataclass(frozen=True)
class LimitCuts:
    """The requests an engine's limits cut, in trace order (empty: none)."""

    requests: tuple[CutRequest, ...] = ()
    rule: str = ""  # the limits, in words (`max_req_len 59999 = min(context, pool) - 1`)

    @property
    def aborted(self) -> tuple[CutRequest, ...]:
        return tuple(r for r in self.requests if r.action == "aborted")

    @property
    def clipped(self) -> tuple[CutRequest, ...]:
        return tuple(r for r in self.requests if r.action == "clipped")

    def __bool__(self) -> bool:
        return bool(self.requests)

    def summary(self) -> str:
        """`2 requests aborted at arrival, 1 with its output clipped (max_req_len 59999 ...)`."""
        parts = []
        if self.aborted:
            parts.append(f"{len(self.aborted)} request{'s' * (len(self.aborted) != 1)} aborted at arrival")
        if self.clipped:
            parts.append(f"{len(self.clipped)} with {'its output' if len(self.clipped) == 1 else 'their outputs'}"
                         f" clipped")
        return ", ".join(parts) + (f" by the engine's limits ({self.rule})" if self.rule else "")

    def to_dict(self) -> dict:
        return {"rule": self.rule, "aborted": len(self.aborted), "clipped": len(self.clipped),
                "requests": [r.to_dict() for r in self.requests]}


# An engine's limits: the cuts of `requests` under `config`, or None when the engine cuts none
# (a request past its limits is then refused, as `check_fits` does).
LimitRule = Callable[[Config, Sequence[RequestSpec]], Optional[LimitCuts]]


def cut_requests(config: Config, requests: Sequence[RequestSpec], source: str | Path, rule: Optional[LimitRule],
                 strict: bool = False, fewer_flag: str = "--limit") -> LimitCuts:
    """The cuts the engine's `rule` makes (none under `strict` or without a rule), after which
    every request left must fit (`check_fits`, raising `CapacityError`: exit 2)."""
    if strict and rule is not None:
        try:
            check_fits(config, requests, source, fewer_flag)
        except CapacityError as exc:
            if not rule(config, requests):
                raise
            raise CapacityError(exc.message, f"{exc.hint} (or drop --strict-limits: the engine aborts or clips such"
                                             " requests, as it does serving them)") from None
        return LimitCuts()
    cuts = None if strict or rule is None else rule(config, requests)
    if not cuts:
        check_fits(config, requests, source, fewer_flag)
        return LimitCuts()
    check_fits(config, _served(requests, cuts), source, fewer_flag)
    return cuts


def _served(requests: Sequence[RequestSpec], cuts: LimitCuts) -> list[RequestSpec]:
    """The requests as the engine serves them: the aborted left out, the clipped clipped."""
    by_index = {cut.index: cut for cut in cuts.requests}
    served = []
    for index, spec in enumerate(requests):
        cut = by_index.get(index)
        if cut is None:
            served.append(spec)
        elif cut.action == "clipped":
            served.append(dataclasses.replace(spec, output_len=cut.kept_output_len))
    return served


def max_req_len_cuts(config: Config, requests: Sequence[RequestSpec]) -> Optional[LimitCuts]:
    """SGLang's request limits (`semantics.request_limits: max_req_len`; None otherwise):
    max_req_len = min(context_len, max_total_num_tokens) - 1; at arrival a prompt of
    max_req_len - 5 tokens or more is aborted, and max_new_tokens is clipped to
    max_req_len - input - 1. A prompt larger than the pool is thus aborted too."""
    limit = config.max_req_len
    if limit is None:
        return None
    max_input = limit - REQ_INPUT_MARGIN
    cuts = []
    for index, spec in enumerate(requests):
        if spec.input_len >= max_input:
            cuts.append(CutRequest(index, spec.rid, spec.line, "aborted", spec.input_len, spec.output_len, 0,
                                   f"prompt of {spec.input_len} tokens >= max_req_input_len {max_input}"))
        else:
            kept, why = _kept_output(config, limit, spec.input_len)
            if spec.output_len > kept:
                cuts.append(CutRequest(index, spec.rid, spec.line, "clipped", spec.input_len, spec.output_len, kept,
                                       f"max_new_tokens {spec.output_len} clipped to {why} = {kept}"))
    rule = (f"max_req_len {limit} = min(memory.max_context_len {config.memory.max_context_len},"
            f" pool {config.pool_size}) - 1; max_req_input_len {max_input}")
    if config.behaviour.request_limits == "memory_clip":
        rule += "; max_new_tokens also clipped to pool - prompt pages - one page - 1 (memory_clip)"
    return LimitCuts(tuple(cuts), rule)


def _kept_output(config: Config, limit: int, input_len: int) -> tuple[int, str]:
    """The most output tokens SGLang keeps for a prompt of `input_len`, and why: max_req_len -
    input - 1, and under `request_limits: memory_clip` (0.5.23's max_new_tokens_for_memory) no
    more than the pool holds beside the prompt's pages and one page, as the scheduler clips."""
    kept, why = limit - input_len - 1, "max_req_len - input - 1"
    if config.behaviour.request_limits == "memory_clip":
        room = output_room(config.pool_size, input_len, config.page_size)
        if room < kept:
            kept, why = room, "pool - prompt pages - one page - 1 (memory_clip)"
    return kept, why


def max_model_len_cuts(config: Config, requests: Sequence[RequestSpec]) -> LimitCuts:
    """vLLM's request limits: its input processor rejects a prompt of `max_model_len` tokens
    or more (`memory.max_context_len`; no room for one output token), and a request stops when
    its tokens reach `max_model_len`, so its output is cut to max_model_len - input."""
    limit = config.memory.max_context_len
    cuts = []
    for index, spec in enumerate(requests):
        if spec.input_len >= limit:
            cuts.append(CutRequest(index, spec.rid, spec.line, "aborted", spec.input_len, spec.output_len, 0,
                                   f"prompt of {spec.input_len} tokens >= max_model_len {limit}"))
        elif spec.input_len + spec.output_len > limit:
            kept = limit - spec.input_len
            cuts.append(CutRequest(index, spec.rid, spec.line, "clipped", spec.input_len, spec.output_len, kept,
                                   f"output stopped at max_model_len {limit}: {kept} tokens"))
    return LimitCuts(tuple(cuts), f"max_model_len {limit} (memory.max_context_len)")
