"""check-page-size on a block manager (vLLM's): the block size every holder agrees on, and a
checked run of the workload.

Holders (the engine's `stack.block_sizes`, with their roles in `stack.block_size_holders`):
the cache config, the KV-cache spec (the model runner's slot arithmetic), the block pool, the
block hasher, the KV events' `block_size`, and a KV-aware router's block size. Static checks:
they agree; the size is one vLLM's attention backends take (a multiple of 16); the pool is
whole blocks; a `max_model_len` request fits. After every step of the workload:

    block_pool       the manager's own check (reference counts, free queue, cached map)
    blocks_cover     each running request holds cdiv(computed tokens, block size) blocks at least
    slot_mapping     the spec's slot of every block's first and last position lies in that block
    block_hashes     one hash per full block of the config's size; a new request's chain recomputed
    kv_events        every BlockStored carries block_size x (its hashes) token ids, at the config's size
    router           the router's chunks of every BlockStored's token ids: one full chunk per hash
    idle             at the end: nothing held, every block free or cached
"""

from __future__ import annotations

import time
from typing import Any, Optional

from memcli import engines
from memcli.check_result import CheckResult, failed, passed
from memcli.config import Config
from memcli.errors import IntegrityError
from memcli.mem_cache.block_manager import block_hashes, cdiv
from memcli.steps import SchedulerHooks
from memcli.tools.check_page_size.dynamic import CheckRow, PhaseResult
from memcli.tools.check_page_size.results import PageSizeRun
from memcli.tools.check_page_size.static import Component, StaticResult, page_cost
from memcli.tools.check_page_size.workload import Workload, builtin_workload, with_changes

BLOCK_CHECKS = ("no_exception", "block_pool", "blocks_cover", "slot_mapping", "block_hashes", "kv_events", "router",
                "idle", "completion")
POOL_TOKENS = 8192
# The holders a block manager's --inject may name (its engine lists them in `stack.block_size_holders`).
BLOCK_HOLDERS = ("cache_config", "kv_cache_spec", "block_pool", "block_hasher", "kv_events", "router")


def block_components(stack: Any) -> list[Component]:
    want = stack.block_sizes["cache_config"]
    return [Component(name, stack.block_size_holders[name][0], size, stack.block_size_holders[name][1],
                      name in stack.injected, size == want) for name, size in stack.block_sizes.items()]


def block_static_checks(stack: Any, config: Config) -> StaticResult:
    comps = block_components(stack)
    want = stack.block_sizes["cache_config"]
    bad = [c for c in comps if not c.agrees]
    agree = (failed("block sizes agree", ", ".join(f"{c.name} holds {c.page_size}" for c in bad)
                    + f"; cache_config.block_size is {want}") if bad
             else passed("block sizes agree", f"all {len(comps)} holders hold {want}"))
    odd = [c for c in comps if c.page_size % 16]
    allowed = (failed("block size a multiple of 16", ", ".join(f"{c.name} holds {c.page_size}" for c in odd)) if odd
               else passed("block size a multiple of 16", "vLLM 0.33's attention backends take multiples of 16"))
    tokens = config.requested_total_tokens
    whole = CheckResult("pool whole blocks", tokens % want == 0,
                        f"{tokens} tokens = {tokens // want} blocks of {want} (the null block included)")
    context, usable = config.memory.max_context_len, tokens // want - 1
    fits = CheckResult("pool holds a max_model_len request", cdiv(context, want) <= usable,
                       f"max_model_len {context} takes {cdiv(context, want)} blocks; {usable} usable blocks")
    return StaticResult(comps, [agree, allowed, whole, fits])


def builtin_block_config(config: Config):
    why = "the built-in workload runs on a small pool to force eviction and preemption"
    return with_changes(config, {"memory.kv_budget_gib": (None, why), "memory.max_total_tokens": (POOL_TOKENS, why),
                                 "memory.max_context_len": (min(config.memory.max_context_len, 2048),
                                                            "fits the built-in workload's longest request")})


class BlockPhase:
    """One run of `workload` on the engine's scheduler over `stack`, checked after every step."""

    def __init__(self, stack: Any, config: Config, workload: Workload):
        self.stack, self.memory, self.config = stack, stack.memory, config
        self.sizes = stack.block_sizes
        self.sched = engines.get(config).scheduler(self.memory, config, SchedulerHooks(
            output_token_base=workload.output_token_base))
        self.reqs = []
        for spec in workload.requests:
            req = self.sched.new_req(spec.rid, spec.input_ids(), spec.output_len, spec.extra_key,
                                     spec.arrival_ms or 0.0)
            self.sched.add_request(req)
            self.reqs.append(req)
        self.results: dict[str, CheckResult] = {}
        self.seen: set[str] = set()
        self.events = 0

    def run(self, steps: int) -> Optional[CheckResult]:
        sched = self.sched
        while not sched.is_done() and sched.step_count < steps:
            step = sched.step_count
            try:
                sched.step()
                bad = self._check()
            except Exception as exc:  # noqa: BLE001 - any failure inside the stack is the finding
                bad = failed("no_exception", f"{type(exc).__name__} at step {step}: {exc}")
                self.results["no_exception"] = bad
            if bad is not None:
                return bad.at_step(step)
        idle = self.memory.idle_state()
        self._keep(CheckResult("idle", bool(idle["ok"]) or not sched.is_done(),
                               f"available {idle['available']} + evictable {idle['evictable']} vs size {idle['size']}"))
        done = sum(1 for r in self.reqs if r.finished)
        self._keep(CheckResult("completion", done == len(self.reqs) or not sched.is_done(),
                               f"{done} of {len(self.reqs)} requests finished"))
        return next((r for r in self.results.values() if not r.ok), None)

    def _keep(self, result: CheckResult) -> Optional[CheckResult]:
        kept = self.results.get(result.name)
        if kept is None or kept.ok:  # a failure is kept for good, else the latest numbers
            self.results[result.name] = result
        return None if result.ok else result

    def _check(self) -> Optional[CheckResult]:
        active = self.sched.memory_holders()
        try:
            self.memory.check(active)
        except IntegrityError as exc:
            return self._keep(failed("block_pool", str(exc)))
        self._keep(passed("block_pool", f"{len(active)} requests holding blocks"))
        events = self.memory.take_events()
        self.events += len(events)
        for check in (self._cover(active), self._slots(active), self._hashes(active), self._events(events),
                      self._router(events)):
            bad = self._keep(check)
            if bad is not None:
                return bad
        return None

    def _cover(self, active: list) -> CheckResult:
        bs = self.sizes["cache_config"]
        for req in active:
            held, need = len(self.memory.block_ids(req)), cdiv(req.num_computed_tokens, bs)
            if held < need:
                return failed("blocks_cover", f"request {req.request_id} holds {held} blocks for"
                              f" {req.num_computed_tokens} computed tokens, which take {need} blocks of {bs}",
                              req.request_id)
        return passed("blocks_cover", f"{len(active)} requests hold blocks for their computed tokens")

    def _slots(self, active: list) -> CheckResult:
        bs, spec = self.sizes["cache_config"], self.sizes["kv_cache_spec"]
        for req in active:
            ids = self.memory.block_ids(req)
            for i, block_id in enumerate(ids[: cdiv(req.num_computed_tokens, bs)]):
                for p in (i * bs, min(i * bs + bs, req.num_computed_tokens) - 1):
                    k = p // spec
                    slot = ids[k] * spec + p % spec if k < len(ids) else None
                    if slot is None or not block_id * bs <= slot < block_id * bs + bs:
                        return failed("slot_mapping", f"request {req.request_id}: position {p} maps to slot {slot}"
                                      f" with the spec's block size {spec}, outside its block {block_id}"
                                      f" (slots {block_id * bs}..{block_id * bs + bs - 1})", req.request_id, (p,))
        return passed("slot_mapping", f"every computed block of {len(active)} requests maps into itself")

    def _hashes(self, active: list) -> CheckResult:
        bs, memory = self.sizes["cache_config"], self.memory
        for req in active:
            want = req.num_tokens // bs
            if len(req.block_hashes) != want:
                return failed("block_hashes", f"request {req.request_id}: {len(req.block_hashes)} block hashes for"
                              f" {req.num_tokens} tokens, which make {want} full blocks of {bs}", req.request_id)
            if req.request_id not in self.seen:
                self.seen.add(req.request_id)
                chain = block_hashes(req.all_token_ids, bs, 0, None, req.extra_keys, memory.root_hash)
                if chain != req.block_hashes:
                    return failed("block_hashes", f"request {req.request_id}: its block hashes differ from the"
                                  f" chain over blocks of {bs}", req.request_id)
        return passed("block_hashes", f"{len(self.seen)} requests' chains recomputed over blocks of {bs}")

    def _events(self, events: list) -> CheckResult:
        bs = self.sizes["cache_config"]
        for event in events:
            hashes = getattr(event, "block_hashes", None)
            if not hasattr(event, "token_ids"):
                continue
            if event.block_size != bs or len(event.token_ids) != event.block_size * len(hashes):
                return failed("kv_events", f"BlockStored of {len(hashes)} hashes and {len(event.token_ids)} token ids"
                              f" says block_size {event.block_size}; the cache's block size is {bs}")
        return passed("kv_events", f"{self.events} events, every BlockStored in blocks of {bs}")

    def _router(self, events: list) -> CheckResult:
        rbs = self.sizes["router"]
        for event in events:
            if not hasattr(event, "token_ids"):
                continue
            chunks, rest = divmod(len(event.token_ids), rbs)
            if chunks != len(event.block_hashes) or rest:
                return failed("router", f"a router with block size {rbs} cuts the {len(event.token_ids)} token ids"
                              f" of a BlockStored into {chunks} chunks (+{rest} tokens) for its"
                              f" {len(event.block_hashes)} block hashes: its prompt hashes never match the engine's")
        return passed("router", f"router block size {rbs}: one chunk per stored block hash")

    def rows(self) -> list[CheckRow]:
        rows = []
        for name in BLOCK_CHECKS:
            r = self.results.get(name)
            if name == "no_exception" and r is None:
                rows.append(CheckRow(name, "pass", f"{self.sched.step_count} steps ran"))
            elif r is None:
                rows.append(CheckRow(name, "skipped", f"not reached: the run stopped at step {self.sched.step_count}"))
            else:
                rows.append(CheckRow(name, "pass" if r.ok else "fail", r.detail))
        return rows


    def coverage(self) -> dict[str, int]:
        """What the run exercised, in vLLM's terms (the counts an SGLang run has and vLLM has
        not, such as chunk-cache or abort counts, are left out: their rows are not shown)."""
        stats = self.sched.stats
        hits = [r.first_cached_tokens for r in self.reqs if r.first_cached_tokens]
        return {"requests": len(self.reqs), "finished": sum(1 for r in self.reqs if r.finished),
                "prefill_batches": stats.prefill_batches, "decode_steps": stats.decode_steps,
                "radix_hits": len(hits), "cached_tokens": stats.admission_hits, "kv_events": self.events,
                "evicted_blocks": self.memory.evicted_tokens_total // self.memory.block_size,
                "evicted_tokens": self.memory.evicted_tokens_total,
                "preemptions": stats.retractions, "retracted_requests": stats.retracted_requests}


def run_block_page_size(config: Config, injections: dict, trace: Optional[Workload], steps: int) -> PageSizeRun:
    """Everything checked at `config`'s block size (`injections`: holders given another)."""
    config, _ = with_changes(config, {"cache.kv_events": (True, "the events' block size is checked")})
    engine = engines.get(config)
    stack = engine.build_stack(config, page_size_overrides=injections)
    static = block_static_checks(stack, config)
    dyn_config, adjustments = (config, []) if trace is not None else builtin_block_config(config)
    workload = trace if trace is not None else builtin_workload(config.runtime.seed)
    phases, loop = [], engine.describe(config)[0]["event_loop"]
    if steps > 0:
        start = time.perf_counter()
        phase = BlockPhase(engine.build_stack(dyn_config, page_size_overrides=injections), dyn_config, workload)
        violation = phase.run(steps)
        bs = stack.block_sizes["cache_config"]
        phases.append(PhaseResult(
            f"workload (block manager, {loop} loop)", "BlockManager",
            workload.description, phase.memory.size, bs, phase.sched.step_count, time.perf_counter() - start,
            phase.rows(), phase.coverage(),
            violation, [], loop))
    notes = [f"injected (debugging only): {', '.join(f'{k}.page_size={v}' for k, v in injections.items())}"] \
        if injections else []
    budget = engine.describe(config)[1]["max_num_batched_tokens"]
    return PageSizeRun(stack.block_sizes["cache_config"], static, page_cost(config), [], adjustments, phases, notes,
                       workload.steps_one_by_one(budget))
