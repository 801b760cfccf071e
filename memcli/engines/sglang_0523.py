"""Engine `sglang-0.5.23`: SGLang 0.5.23's memory stack and scheduler.

The code is 0.5.5's (`memcli.stack`, `memcli.sched`) wherever the versions agree; where
0.5.23 differs, the difference is a semantics key with one value per profile, and this
engine's profile, `sglang-0.5.23`, holds 0.5.23's values (`memcli.config.SGLANG_0523_CHOICES`;
docs/FIDELITY.md lists them beside 0.5.5's). Reference: SGLang 0.5.23's own code from its
wheel, run in a worker process (`memcli.reference.v0523`).
"""

from __future__ import annotations

from memcli.capacity import max_req_len_cuts
from memcli.config import PROFILE_CHOICES
from memcli.engines import register
from memcli.engines.base import Engine
from memcli.engines.sglang_055 import _batch, _scheduler
from memcli.sched.req import Req
from memcli.stack import build_stack, eviction_order

NAME = "sglang-0.5.23"


def _reference(config, requests: list, arrivals: str, output_token_base: int, max_steps=None, on_step=None):
    from memcli.reference.v0523.diff import run_side_by_side_0523

    return run_side_by_side_0523(config, requests, arrivals, output_token_base, max_steps, on_step=on_step)


ENGINE = register(Engine(
    name=NAME,
    summary="SGLang 0.5.23 (unified radix tree with prompt split, PrefillBudget admission; normal and overlap loops)",
    build_stack=build_stack,
    scheduler=_scheduler,
    profile=NAME,
    semantics=tuple(PROFILE_CHOICES),
    make_req=Req,
    make_batch=_batch,
    reference=_reference,
    reference_steps=True,
    limits=max_req_len_cuts,  # SGLang's request limits, with 0.5.23's memory clip
    baseline="sglang-0.5.5",
    eviction_order=eviction_order,  # lfu is lru where the tree counts no hits
))
