"""bench-one-batch's static batch for `vllm-0.33`: memcli's vLLM manager driven by the calls
vLLM's scheduler makes for a batch admitted at once (a `memcli.engines.base.BlockBatch`).

    start()     a fresh manager; every request's first `prefix_len` tokens admitted, computed
                and freed (their full blocks stay cached); the batch's requests built, their
                block hashes computed (vLLM hashes a prompt when the request is built)
    prefill()   per request: get_computed_blocks, allocate_slots of the rest of the prompt
                (the whole prompt must fit, as `scheduler_reserve_full_isl`), the stats record
    sample()    each request's next output token appended, its newly full blocks hashed
                (vLLM's `update_from_output`, not the memory path)
    decode()    per request: allocate_slots of one token (a new block at a block boundary)
    finish()    per request: free (deepest block first; hashed blocks stay cached)

Nothing here writes a block table: vLLM's scheduler hands the new block ids to the model
runner, which writes its own; the manager's calls are the whole host-side memory path.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from memcli.errors import CapacityError
from memcli.mem_cache.block_manager import cdiv
from memcli.engines.base import BlockFigures
from memcli.vllm_sched.request import FINISHED_LENGTH, RUNNING, VllmRequest


class VllmStaticBatch:
    """One static batch on a fresh `BlockManager` built by `build` (a zero-argument callable)."""

    setup = "memcli BlockManager (vLLM 0.33's rules), host Python"

    def __init__(self, build, prompts: np.ndarray, prefix_len: int, outputs: np.ndarray):
        self.build, self.prefix_len = build, prefix_len
        self.prompts = [row.tolist() for row in prompts]
        self.outputs = [row.tolist() for row in outputs]
        self.memory: Any = None
        self.reqs: list[VllmRequest] = []
        self.tally = BlockFigures()
        self._stats_before = (0, 0)

    def _request(self, rid: str, tokens: list[int]) -> VllmRequest:
        req = VllmRequest(rid, tokens, len(self.outputs[0]))
        self.memory.hash_request(req)
        return req

    def _admit(self, req: VllmRequest, others_running: bool) -> tuple[int, int]:
        """Admit `req` with its whole prompt; (hit tokens, new blocks). Raises when it does not fit."""
        memory = self.memory
        blocks, hit = memory.get_computed_blocks(req)
        new = memory.allocate_slots(req, req.num_tokens - hit, hit, blocks, full_sequence_must_fit=True,
                                    has_scheduled_reqs=others_running)
        if new is None:
            raise CapacityError(f"request {req.request_id}: {req.num_tokens} tokens do not fit the"
                                f" {memory.pool.num_free_blocks} free blocks of {memory.block_size}",
                                hint="raise memory.max_total_tokens or lower --batch-size")
        memory.record_prefix_cache_stats(req, hit)
        req.status, req.num_computed_tokens = RUNNING, req.num_tokens
        return hit, len(new)

    def start(self) -> None:
        self.memory = self.build()
        if self.prefix_len:
            warm = [self._request(f"warm-{i}", p[: self.prefix_len]) for i, p in enumerate(self.prompts)]
            for req in warm:
                self._admit(req, False)
                req.status = FINISHED_LENGTH
                self.memory.free(req)
        self.reqs = [self._request(str(i), p) for i, p in enumerate(self.prompts)]
        self.tally = BlockFigures(free_blocks=self.memory.pool.num_free_blocks)
        self._stats_before = (self.memory.stats.queries, self.memory.stats.hits)

    def prefill(self) -> None:
        hits = new = 0
        for i, req in enumerate(self.reqs):
            hit, blocks = self._admit(req, i > 0)
            hits, new = hits + hit, new + blocks
        self.tally = self.tally._replace(hit_tokens=hits, prefill_blocks=new)

    def sample(self) -> None:
        step = len(self.reqs[0].all_token_ids) - len(self.prompts[0])
        for req, out in zip(self.reqs, self.outputs):
            req.all_token_ids.append(out[step])
            self.memory.hash_request(req)

    def decode(self) -> None:
        memory, new = self.memory, 0
        for req in self.reqs:
            blocks = memory.allocate_slots(req, 1)
            if blocks is None:
                raise CapacityError(f"request {req.request_id}: no free block for its decode",
                                    hint="raise memory.max_total_tokens or lower --batch-size")
            req.num_computed_tokens += 1
            new += len(blocks)
        self.tally = self.tally._replace(decode_blocks=self.tally.decode_blocks + new)

    def finish(self) -> None:
        held = self.held_blocks()
        for req in self.reqs:
            req.status = FINISHED_LENGTH
            self.memory.free(req)
        self.tally = self.tally._replace(freed_blocks=held - self.held_blocks())

    def held_blocks(self) -> int:
        pool = self.memory.pool
        return pool.num_blocks - 1 - pool.num_free_blocks

    def idle(self) -> dict:
        return self.memory.idle_state()

    def expected(self, decode_steps: int) -> BlockFigures:
        return expected_figures(len(self.prompts[0]), len(self.prompts), self.prefix_len, decode_steps,
                                self.memory.block_size, self.memory.enable_caching)

    def figures(self) -> BlockFigures:
        pool = self.memory.pool
        return self.tally._replace(block_size=self.memory.block_size, held_blocks=self.held_blocks(),
                                   cached_blocks=pool.num_cached,
                                   queries=self.memory.stats.queries - self._stats_before[0],
                                   hits=self.memory.stats.hits - self._stats_before[1])


def expected_figures(prompt_len: int, batch_size: int, prefix_len: int, decode_steps: int,
                     block_size: int, caching: bool = True) -> BlockFigures:
    """What vLLM's rules give a static batch of distinct prompts: the prefix's full blocks hit
    (within `prompt_len - 1` tokens), the rest of each prompt in new blocks, a new block per
    boundary crossed by the decode steps, and every held block freed at the finish; the stats count every prompt token as a query and
    the hit as hits; with caching off (`caching` False) nothing hits and no stats are
    recorded. (`held_blocks`, `free_blocks`, `cached_blocks` are left 0: state, not tallies.)"""
    hit = min(prefix_len, prompt_len - 1) // block_size * block_size if caching else 0
    held = cdiv(prompt_len + decode_steps, block_size)
    return BlockFigures(block_size=block_size, hit_tokens=batch_size * hit,
                        queries=batch_size * prompt_len if caching else 0, hits=batch_size * hit,
                        prefill_blocks=batch_size * (cdiv(prompt_len, block_size) - hit // block_size),
                        decode_blocks=batch_size * (held - cdiv(prompt_len, block_size)),
                        freed_blocks=batch_size * held)


def make_static_batch(config, prompts: np.ndarray, prefix_len: int, outputs: np.ndarray) -> VllmStaticBatch:
    from memcli.engines.vllm_033 import build_stack

    return VllmStaticBatch(lambda: build_stack(config).memory, prompts, prefix_len, outputs)

