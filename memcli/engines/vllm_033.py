"""Engine `vllm-0.33`: vLLM 0.33.0's KV-cache manager (one full-attention group) and v1
scheduler, step for step.

Config in vLLM's vocabulary: `memory.page_size` is vLLM's `block_size` (memcli's default 1,
token granularity, which vLLM lacks, is read as vLLM's default 16 when the config is loaded), `memory.max_total_tokens`
is `num_gpu_blocks x block_size` (the null block included), `memory.max_context_len` is
`max_model_len`; `scheduler.max_num_batched_tokens` (default 2048), `scheduler.max_num_seqs`
(default 128) and `scheduler.long_prefill_token_threshold` (default 0, off) under their vLLM
names; `cache.kind=none` is `enable_prefix_caching=False`; `semantics.event_loop` is `async`
(the default of `vllm serve` in 0.33) or `sync` (`--no-async-scheduling`); `scheduler.policy` is
`fcfs` or `priority` (`--scheduling-policy`; a request's priority is the trace's `priority`
field, 0 by default). Keys vLLM lacks are refused.
"""

from __future__ import annotations

from typing import Any

from memcli.capacity import max_model_len_cuts
from memcli.config import Config
from memcli.engines import register
from memcli.engines.base import Engine
from memcli.engines.vllm_033_bench import make_static_batch
from memcli.errors import ConfigError
from memcli.mem_cache.block_manager import BlockManager
from memcli.steps import SchedulerHooks
from memcli.vllm_sched.scheduler import POLICIES, VllmScheduler, VllmSchedulerConfig

NAME = "vllm-0.33"
DEFAULT_BLOCK_SIZE = 16  # vLLM's CacheConfig.DEFAULT_BLOCK_SIZE
DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048  # vLLM's SchedulerConfig class defaults
DEFAULT_MAX_NUM_SEQS = 128


def block_size(config: Config) -> int:
    ps = config.memory.page_size
    return DEFAULT_BLOCK_SIZE if ps == 1 else ps


def check_config(config: Config) -> None:
    """Refuse what vLLM 0.33 lacks or does not allow (exit 2, with a hint)."""
    bs, cache = block_size(config), config.cache
    if bs % 16:
        raise ConfigError(f"memory.page_size: vLLM 0.33's attention backends take block sizes that are multiples of 16,"
                          f" not {bs}", hint="use --set memory.page_size=16 (vLLM's default), 32 or 64")
    if cache.kind in ("hiradix", "chunk"):
        what = "host tier (hiradix)" if cache.kind == "hiradix" else "chunk cache (SGLang's)"
        raise ConfigError(f"cache.kind: vLLM 0.33 has no {what}",
                          hint="use cache.kind=radix (prefix caching on) or cache.kind=none (enable_prefix_caching=False)")
    if cache.eviction_policy != "lru":
        raise ConfigError(f"cache.eviction_policy: vLLM 0.33 evicts from its free-block queue only, not by {cache.eviction_policy}",
                          hint="leave cache.eviction_policy at lru with --engine vllm-0.33")
    if config.scheduler.policy not in POLICIES:
        raise ConfigError(f"scheduler.policy: vLLM 0.33 has no {config.scheduler.policy} policy (SGLang's)",
                          hint="vLLM's policies are fcfs (its default) and priority (--scheduling-policy priority)")
    loop = config.semantics.event_loop
    if loop in ("overlap", "normal"):
        raise ConfigError(f"semantics.event_loop: {loop} is SGLang's loop", hint="vLLM's loops are async and sync")
    num_blocks = config.requested_total_tokens // bs
    if num_blocks < 2:
        raise ConfigError(f"memory.max_total_tokens: {config.requested_total_tokens} tokens give {num_blocks} blocks of {bs};"
                          " vLLM needs the null block and one more", hint=f"raise memory.max_total_tokens to at least {2 * bs}")


def settings(config: Config) -> VllmSchedulerConfig:
    s = config.scheduler
    return VllmSchedulerConfig(
        max_num_batched_tokens=s.max_num_batched_tokens or DEFAULT_MAX_NUM_BATCHED_TOKENS,
        max_num_seqs=s.max_num_seqs or DEFAULT_MAX_NUM_SEQS,
        max_model_len=config.memory.max_context_len,
        long_prefill_token_threshold=s.long_prefill_token_threshold or 0,
        policy=config.scheduler.policy, async_scheduling=config.semantics.event_loop != "sync")


GPU_MEMORY_UTILIZATION = 0.92  # vLLM 0.33's CacheConfig default


def describe(config: Config) -> tuple[dict, dict]:
    """show-config: vLLM's settings in force, and its block counts and KV-cache size."""
    check_config(config)
    bs, s = block_size(config), settings(config)
    num_blocks = config.requested_total_tokens // bs
    behaviours = {"event_loop": "async" if s.async_scheduling else "sync", "policy": s.policy,
                  "enable_prefix_caching": str(config.cache.kind != "none").lower(),
                  "enable_chunked_prefill": "true", "scheduler_reserve_full_isl": "true", "watermark": "0.0",
                  "prefix_caching_hash_algo": "sha256"}
    sizes = {"block_size": bs, "num_gpu_blocks": num_blocks, "usable_blocks": num_blocks - 1,
             "pool_size": (num_blocks - 1) * bs, "kv_cache_tokens": num_blocks * bs,
             "bytes_per_token": config.model.bytes_per_token,
             # vLLM's sizing (kv_cache_planning.py): num_blocks = available_memory // bytes_per_block,
             # the available memory being `--kv-cache-memory-bytes` when given, else the GPU's
             # memory x gpu_memory_utilization less the weights and the profiled activations
             "bytes_per_block": bs * config.model.bytes_per_token,
             "kv_cache_bytes": num_blocks * bs * config.model.bytes_per_token,
             "gpu_memory_utilization": GPU_MEMORY_UTILIZATION,
             "gpu_gib_for_this_kv_cache": round(num_blocks * bs * config.model.bytes_per_token
                                                / GPU_MEMORY_UTILIZATION / 2**30, 3),
             "max_num_batched_tokens": s.max_num_batched_tokens, "max_num_seqs": s.max_num_seqs,
             "max_model_len": s.max_model_len, "long_prefill_token_threshold": s.long_prefill_token_threshold}
    return behaviours, sizes


# The holders of vLLM's block size for one full-attention group (check-page-size's components).
BLOCK_SIZE_HOLDERS = {
    "cache_config": ("CacheConfig.block_size", "the one block size every component is given"),
    "kv_cache_spec": ("FullAttentionSpec.block_size", "the model runner's slot of position p: block_table[p // bs] * bs + p % bs"),
    "block_pool": ("KVCacheManager / BlockPool", "blocks per request: cdiv(tokens, block_size); the hit length"),
    "block_hasher": ("get_request_block_hasher(hash_block_size)", "one chained hash per full block of tokens"),
    "kv_events": ("BlockStored.block_size", "what the events tell a consumer: token_ids = block_size x hashes"),
    "router": ("a KV-aware router's block size", "chunks each BlockStored's token_ids, one chunk per block hash"),
}


def build_stack(config: Config, *, future=None, page_size_overrides=None, cache_kind=None) -> Any:
    """The block manager (its `.stack`); `page_size_overrides` gives a holder of
    `BLOCK_SIZE_HOLDERS` another block size (check-page-size's injections), listed with every
    holder's size in `stack.block_sizes` (and the injected ones in `stack.injected`)."""
    check_config(config)
    bs = block_size(config)
    sizes = {name: bs for name in BLOCK_SIZE_HOLDERS}
    sizes.update(page_size_overrides or {})
    pool_bs = sizes["block_pool"]
    memory = BlockManager(config.requested_total_tokens // pool_bs, pool_bs, config.memory.max_context_len,
                          enable_caching=(cache_kind or config.cache.kind) != "none",
                          record_events=config.cache.kv_events,
                          max_running=settings(config).max_num_seqs, config=config)
    memory.hash_block_size, memory.event_block_size = sizes["block_hasher"], sizes["kv_events"]
    memory.stack.block_sizes, memory.stack.injected = sizes, set(page_size_overrides or ())
    memory.stack.block_size_holders = BLOCK_SIZE_HOLDERS
    return memory.stack


def _scheduler(memory: BlockManager, config: Config, hooks: SchedulerHooks) -> VllmScheduler:
    return VllmScheduler(memory, settings(config), config.sim, hooks)


def _reference(config: Config, requests: list, arrivals: str, output_token_base: int, max_steps=None):
    from memcli.errors import MemcliError
    from memcli.reference.vllm033.steps import run_vllm_side_by_side

    check_config(config)
    if arrivals not in ("burst", "timestamp"):
        raise MemcliError(f"--arrivals {arrivals}: vLLM's side-by-side run takes burst or timestamp arrivals",
                          "use --arrivals burst or --arrivals timestamp")
    bs = block_size(config)
    return run_vllm_side_by_side(settings(config), bs, config.requested_total_tokens // bs, requests, arrivals,
                                 config.sim, output_token_base, max_steps)


ENGINE = register(Engine(
    name=NAME,
    summary="vLLM 0.33.0 (block pool with prefix caching, v1 scheduler; async and sync loops)",
    build_stack=build_stack,
    scheduler=_scheduler,
    profile="sglang-0.5.5",
    semantics=("event_loop",),
    describe=describe,
    static_batch=make_static_batch,
    reference=_reference,
    limits=max_model_len_cuts,  # vLLM rejects a prompt of max_model_len tokens or more
    tracks_uses=False,  # a block pool, no radix tree: its evicted blocks name no uses
    check=check_config,
))
