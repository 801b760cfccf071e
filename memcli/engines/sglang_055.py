"""Engine `sglang-0.5.5`: SGLang 0.5.5's memory stack and scheduler, step for step.

Memory: the stack builder (`memcli.stack`) behind the memory manager; scheduling: `memcli.sched`
(`PrefillAdder`, retraction, both event loops); semantics: every key of `semantics.*`, with the
`sglang-0.5.5` profile as the engine's own values and `memcli` as memcli's improvements on top;
reference: SGLang 0.5.5's own code from its wheel (`memcli.reference`); limits: SGLang's
max_req_len (a too long prompt aborted at arrival, an output clipped to what is left;
`memcli.capacity.max_req_len_cuts`).
"""

from __future__ import annotations

from typing import Any

from memcli.capacity import max_req_len_cuts
from memcli.config import PROFILE_CHOICES, Config
from memcli.engines import register
from memcli.engines.base import Engine
from memcli.sched.batch import ScheduleBatch
from memcli.sched.req import Req
from memcli.sched.scheduler import Scheduler
from memcli.stack import build_stack, eviction_order
from memcli.steps import SchedulerHooks

NAME = "sglang-0.5.5"


def _scheduler(memory: Any, config: Config, hooks: SchedulerHooks) -> Scheduler:
    return Scheduler(memory, config, hooks)


def _batch(reqs: list, memory: Any, config: Config) -> ScheduleBatch:
    return ScheduleBatch(reqs, memory, config.behaviour.event_loop == "overlap")


def _reference(config: Config, requests: list, arrivals: str, output_token_base: int, max_steps=None, on_step=None):
    from memcli.reference.observe import run_side_by_side

    return run_side_by_side(config, requests, arrivals, output_token_base, max_steps, on_step=on_step)


ENGINE = register(Engine(
    name=NAME,
    summary="SGLang 0.5.5 (radix, hiradix and chunk caches; normal and overlap loops)",
    build_stack=build_stack,
    scheduler=_scheduler,
    profile="sglang-0.5.5",
    semantics=tuple(PROFILE_CHOICES),
    make_req=Req,
    make_batch=_batch,
    reference=_reference,
    reference_steps=True,
    limits=max_req_len_cuts,  # SGLang's request limits; under request_limits: row, none (refused)
    eviction_order=eviction_order,  # lfu is lru where the tree counts no hits
))
