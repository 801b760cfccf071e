"""Operation-level differential: vLLM 0.33's real `KVCacheManager` and memcli's
`BlockManager` driven by the same calls, compared after each one.

    pair = ManagerPair(num_blocks=40, block_size=4)
    pair.admit("r1", tokens)        get_computed_blocks + allocate_slots (+ stats), both sides
    pair.extend("r1", n)            a further chunk or decode tokens
    pair.free("r1")
    pair.compare()                  block ids, hashes, free-queue order, cached map, stats, events

`random_ops(seed, ...)` runs a random sequence over prompts that share prefixes.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from memcli.mem_cache.block_manager import BlockManager
from memcli.reference.vllm033.loader import VllmReference, load_vllm
from memcli.vllm_sched.request import PREEMPTED, RUNNING, WAITING, VllmRequest


def real_manager(ref: VllmReference, num_blocks: int, block_size: int, max_model_len: int,
                 enable_caching: bool = True, events: bool = False, watermark: float = 0.0) -> Any:
    """vLLM's `KVCacheManager` for one full-attention group of `num_blocks` blocks (null included)."""
    kci = ref.kv_cache_interface
    spec = kci.FullAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=1, dtype=torch.float16)
    config = kci.KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[],
                               kv_cache_groups=[kci.KVCacheGroupSpec(["layer.0"], spec)])
    return ref.kv_cache_manager.KVCacheManager(config, max_model_len, scheduler_block_size=block_size,
                                               hash_block_size=block_size, enable_caching=enable_caching,
                                               log_stats=True, enable_kv_cache_events=events, watermark=watermark)


def real_request(ref: VllmReference, rid: str, tokens: list[int], block_size: int, max_tokens: int = 1 << 20,
                 salt: Optional[str] = None, arrival_time: float = 0.0, priority: int = 0) -> Any:
    sampling = ref.request.SamplingParams(max_tokens=max_tokens)
    hasher = ref.kv_cache_utils.get_request_block_hasher(block_size, ref.hashing.sha256)
    return ref.request.Request(rid, list(tokens), sampling, None, arrival_time=arrival_time, block_hasher=hasher,
                               cache_salt=salt, priority=priority)


@dataclass
class ManagerPair:
    num_blocks: int
    block_size: int
    max_model_len: int = 1 << 16
    enable_caching: bool = True
    events: bool = True
    ref: VllmReference = field(default_factory=load_vllm)
    real_reqs: dict = field(default_factory=dict)
    mem_reqs: dict = field(default_factory=dict)
    log: list = field(default_factory=list)

    def __post_init__(self):
        self.real = real_manager(self.ref, self.num_blocks, self.block_size, self.max_model_len,
                                 self.enable_caching, self.events)
        self.mem = BlockManager(self.num_blocks, self.block_size, self.max_model_len,
                                enable_caching=self.enable_caching, record_events=self.events)

    def admit(self, rid: str, tokens: list[int], first_chunk: Optional[int] = None, salt: Optional[str] = None,
              full_sequence_must_fit: bool = True) -> tuple:
        """A waiting request (new, or preempted earlier) looks its prefix up and takes blocks
        for its first chunk; returns (real result, memcli result), each (hit, new block ids)."""
        if rid not in self.real_reqs:
            self.real_reqs[rid] = real_request(self.ref, rid, tokens, self.block_size, salt=salt)
            self.mem_reqs[rid] = VllmRequest(rid, tokens, 1 << 20, salt)
            self.mem.hash_request(self.mem_reqs[rid])
        real, mem = self.real_reqs[rid], self.mem_reqs[rid]
        blocks, hit, _ = self.real.get_computed_blocks(real)
        mblocks, mhit = self.mem.get_computed_blocks(mem)
        n = real.num_tokens - hit if first_chunk is None else max(1, min(first_chunk, real.num_tokens - hit))
        got = self.real.allocate_slots(real, n, num_new_computed_tokens=hit, new_computed_blocks=blocks,
                                       full_sequence_must_fit=full_sequence_must_fit, has_scheduled_reqs=False)
        mgot = self.mem.allocate_slots(mem, n, mhit, mblocks, full_sequence_must_fit=full_sequence_must_fit,
                                       has_scheduled_reqs=False)
        result = ((hit, None if got is None else got.get_block_ids()[0]),
                  (mhit, None if mgot is None else [b.block_id for b in mgot]))
        if got is not None:
            self.real.record_prefix_cache_stats(real, hit)
            real.status = self.ref.request.RequestStatus.RUNNING
            real.num_computed_tokens = hit + n
        if mgot is not None:
            self.mem.record_prefix_cache_stats(mem, mhit)
            mem.status, mem.num_computed_tokens = RUNNING, mhit + n
        self.log.append(("admit", rid, n, result))
        return result

    def extend(self, rid: str, n: int, new_tokens: Optional[list[int]] = None) -> tuple:
        """A running request's next `n` tokens (a prefill chunk; with `new_tokens`, decode
        tokens appended first, as a sampled token is before its step)."""
        real, mem = self.real_reqs[rid], self.mem_reqs[rid]
        for token in new_tokens or ():
            real.append_output_token_ids(token)
            mem.all_token_ids.append(token)
            self.mem.hash_request(mem)
        n = min(n, real.num_tokens - real.num_computed_tokens)
        if n <= 0:
            return (None, None)
        got = self.real.allocate_slots(real, n)
        mgot = self.mem.allocate_slots(mem, n)
        if got is not None:
            real.num_computed_tokens += n
        if mgot is not None:
            mem.num_computed_tokens += n
        result = (None if got is None else got.get_block_ids()[0], None if mgot is None else [b.block_id for b in mgot])
        self.log.append(("extend", rid, n, result))
        return result

    def free(self, rid: str, preempt: bool = False) -> None:
        real, mem = self.real_reqs[rid], self.mem_reqs[rid]
        self.real.free(real)
        self.mem.free(mem)
        if preempt:
            real.status, real.num_computed_tokens = self.ref.request.RequestStatus.PREEMPTED, 0
            real.num_preemptions += 1
            mem.status, mem.num_computed_tokens = PREEMPTED, 0
            mem.num_preemptions += 1
        else:
            del self.real_reqs[rid], self.mem_reqs[rid]
        self.log.append(("free", rid, preempt))

    def compare(self) -> list[str]:
        """What differs between the two managers now (empty: nothing)."""
        diffs = []
        rpool, mpool = self.real.block_pool, self.mem.pool
        rq = _queue_ids(rpool.free_block_queue)
        mq = mpool.free.ids()
        if rq != mq:
            diffs.append(f"free queue: vLLM {rq[:12]}... memcli {mq[:12]}...")
        for rid, real in self.real_reqs.items():
            mem = self.mem_reqs[rid]
            if list(real.block_hashes) != mem.block_hashes:
                diffs.append(f"{rid}: block hashes differ")
            rids = list(self.real.get_block_ids(rid)[0]) if rid in _held(self.real) else []
            if rids != self.mem.block_ids(mem):
                diffs.append(f"{rid}: blocks vLLM {rids} memcli {self.mem.block_ids(mem)}")
        rmap = {(bytes(k[:-4]), b.block_id) for k, v in rpool.cached_block_hash_to_block._cache.items()
                for b in (v.values() if isinstance(v, dict) else [v])}
        mmap = {(k, b.block_id) for k, b in mpool.cached_blocks()}
        if rmap != mmap:
            diffs.append(f"cached map: {len(rmap ^ mmap)} entries differ")
        rref = [b.ref_cnt for b in rpool.blocks[1:]]
        if rref != [b.ref_cnt for b in mpool.blocks[1:]]:
            diffs.append("reference counts differ")
        rs, ms = self.real.prefix_cache_stats, self.mem.stats
        for name in ("requests", "queries", "hits", "preempted_requests", "preempted_queries", "preempted_hits"):
            if getattr(rs, name) != getattr(ms, name):
                diffs.append(f"stats.{name}: vLLM {getattr(rs, name)} memcli {getattr(ms, name)}")
        if self.events:
            revents = [_event_tuple(e) for e in self.real.take_events()]
            mevents = [_event_tuple(e) for e in self.mem.take_events()]
            if revents != mevents:
                diffs.append(f"events: vLLM {revents[:3]} memcli {mevents[:3]}")
        return diffs


def _held(manager: Any) -> set:
    return set(manager.coordinator.single_type_managers[0].req_to_blocks)


def _queue_ids(queue: Any) -> list[int]:
    out, block = [], queue.fake_free_list_head.next_free_block
    while block is not None and block is not queue.fake_free_list_tail:
        out.append(block.block_id)
        block = block.next_free_block
    return out


def _event_tuple(event: Any) -> tuple:
    kind = type(event).__name__.replace("Vllm", "")
    if kind == "BlockStored":
        return (kind, tuple(event.block_hashes), event.parent_block_hash, tuple(event.token_ids), event.block_size,
                event.medium, None if event.extra_keys is None else tuple(event.extra_keys))
    if kind == "BlockRemoved":
        return (kind, tuple(event.block_hashes), event.medium)
    return (kind,)


def random_prompts(rng: random.Random, count: int, block_size: int, vocab: int = 3) -> list[list[int]]:
    """Prompts built from a few shared stems, so that prefixes, partial blocks and exact
    block boundaries all occur."""
    stems = [[rng.randrange(vocab) for _ in range(rng.randrange(1, 4 * block_size))] for _ in range(3)]
    out = []
    for _ in range(count):
        stem = rng.choice(stems)[: rng.randrange(0, 4 * block_size)]
        out.append(stem + [rng.randrange(vocab) for _ in range(rng.randrange(1, 3 * block_size))])
    return out


def random_ops(seed: int, steps: int = 200, num_blocks: int = 24, block_size: int = 4,
               enable_caching: bool = True) -> ManagerPair:
    """A random sequence of admissions (whole or chunked), chunks, decode tokens, frees and
    preemptions; raises AssertionError at the first operation after which the managers differ."""
    rng = random.Random(seed)
    pair = ManagerPair(num_blocks, block_size, enable_caching=enable_caching)
    prompts = random_prompts(rng, steps, block_size)
    waiting = {}
    for step in range(steps):
        running = [rid for rid, r in pair.mem_reqs.items() if r.status == RUNNING]
        op = rng.random()
        if op < 0.4 or not running:
            rid = f"r{step}"
            if waiting and rng.random() < 0.3:
                rid = rng.choice(sorted(waiting))
            tokens = waiting.pop(rid, prompts[step])
            chunk = None if rng.random() < 0.5 else rng.randrange(1, 3 * block_size)
            real, mem = pair.admit(rid, tokens, chunk, full_sequence_must_fit=rng.random() < 0.7)
            if real[1] is None and rid in pair.mem_reqs and pair.mem_reqs[rid].status == WAITING:
                pair.free(rid)
        elif op < 0.7:
            rid = rng.choice(running)
            req = pair.mem_reqs[rid]
            if req.num_computed_tokens < req.num_tokens:
                pair.extend(rid, rng.randrange(1, 3 * block_size))
            else:
                pair.extend(rid, 1, [rng.randrange(3)])
        elif op < 0.9:
            pair.free(rng.choice(running))
        else:
            rid = rng.choice(running)
            pair.free(rid, preempt=True)
            waiting[rid] = pair.mem_reqs[rid].all_token_ids
        diffs = pair.compare()
        if diffs:
            raise AssertionError(f"seed {seed}, operation {step} {pair.log[-1]}: " + "; ".join(diffs))
    return pair
