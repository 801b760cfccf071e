"""`bench-one-batch --compare vllm-0.33`: vLLM 0.33.0's own `KVCacheManager`, timed beside
memcli's `vllm-0.33` manager in the same rounds.

vLLM's real manager (coordinator, single-type manager, `BlockPool`, hashing, `Request`) is
loaded from the cached wheel (`memcli.reference.vllm033.loader`). Both managers are host-side
Python, so both are timed as a server runs them: by the wall clock on the host, in this
process's CPython, with the same calls in the same order (`blocks.time_batch`, the same
prompts, cached prefix and decode steps):

    prefill_memory   per request: get_computed_blocks + allocate_slots + record_prefix_cache_stats
    decode_memory    per request: allocate_slots(request, 1)
    free             per request: free

Setup is vLLM's default for one full-attention group: prefix caching on (or off with
`--tree-cache none`), block hashes by `sha256` (`prefix_caching_hash_algo`'s default: SHA-256
of a pickle; computed when a request is built and when a token is appended, so in neither
side's timed calls), `scheduler_reserve_full_isl` (the whole prompt must fit), watermark 0,
no KV events, stats on (`log_stats=True`). Neither side writes a block table: in vLLM the model
runner does, from the block ids. The blocks of both sides are compared case by case.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from memcli.config import Config
from memcli.engines.base import BlockFigures
from memcli.errors import IntegrityError, MemcliError
from memcli.reference.vllm033.loader import VllmReference
from memcli.reference.vllm033.ops import real_manager, real_request
from memcli.tools.bench_one_batch.blocks import case_batch, decode_steps, time_batch
from memcli.tools.bench_one_batch.cases import Case
from memcli.tools.bench_one_batch.phases import PhaseTiming
from memcli.tools.bench_one_batch.results import CaseResult

NAME = "vllm-0.33"
SETUP = ("vLLM 0.33.0 KVCacheManager (its own code, from the wheel), host Python, one full-attention group,"
         " sha256 block hashes (vLLM's default), whole prompt must fit, watermark 0, no KV events")


class Setup(NamedTuple):
    """What the reference runs (the `backend` slot of a comparison: vLLM has no attention
    backend on this path)."""

    name: str
    label: str


class RealVllmBatch:
    """The static batch of `blocks.time_batch` on vLLM's real `KVCacheManager`, rebuilt fresh by `start`."""

    def __init__(self, ref: VllmReference, config: Config, prompts, prefix_len: int, outputs):
        from memcli import engines

        self.ref, self.prefix_len = ref, prefix_len
        self.block_size = engines.get(config).describe(config)[1]["block_size"]
        self.num_blocks = config.requested_total_tokens // self.block_size
        self.max_model_len, self.caching = config.memory.max_context_len, config.cache.kind != "none"
        self.prompts = [row.tolist() for row in prompts]
        self.outputs = [row.tolist() for row in outputs]
        self.setup = SETUP + (", prefix caching on" if self.caching else ", prefix caching off")
        self.manager: Any = None
        self.reqs: list = []
        self.tally = BlockFigures()
        self._stats_before = (0, 0)

    def _request(self, rid: str, tokens: list[int]) -> Any:
        return real_request(self.ref, rid, tokens, self.block_size, max_tokens=max(len(self.outputs[0]), 1))

    def _admit(self, req: Any, others_running: bool) -> tuple[int, int]:
        manager = self.manager
        blocks, hit, _ = manager.get_computed_blocks(req)
        new = manager.allocate_slots(req, req.num_tokens - hit, num_new_computed_tokens=hit, new_computed_blocks=blocks,
                                     full_sequence_must_fit=True, has_scheduled_reqs=others_running)
        if new is None:
            raise MemcliError(f"vLLM's manager: request {req.request_id} does not fit", hint="lower --batch-size")
        manager.record_prefix_cache_stats(req, hit)
        req.status, req.num_computed_tokens = self.ref.request.RequestStatus.RUNNING, req.num_tokens
        return hit, len(new.get_block_ids()[0])

    def start(self) -> None:
        self.manager = real_manager(self.ref, self.num_blocks, self.block_size, self.max_model_len, self.caching)
        done = self.ref.request.RequestStatus.FINISHED_LENGTH_CAPPED
        if self.prefix_len:
            for i, prompt in enumerate(self.prompts):
                req = self._request(f"warm-{i}", prompt[: self.prefix_len])
                self._admit(req, False)
                req.status = done
                self.manager.free(req)
        self.reqs = [self._request(str(i), p) for i, p in enumerate(self.prompts)]
        stats = self.manager.prefix_cache_stats
        self._stats_before = (stats.queries, stats.hits) if stats is not None else (0, 0)
        self.tally = BlockFigures(free_blocks=self.manager.block_pool.get_num_free_blocks())

    def prefill(self) -> None:
        hits = new = 0
        for i, req in enumerate(self.reqs):
            hit, blocks = self._admit(req, i > 0)
            hits, new = hits + hit, new + blocks
        self.tally = self.tally._replace(hit_tokens=hits, prefill_blocks=new)

    def sample(self) -> None:
        step = self.reqs[0].num_tokens - len(self.prompts[0])
        for req, out in zip(self.reqs, self.outputs):
            req.append_output_token_ids(out[step])

    def decode(self) -> None:
        manager, new = self.manager, 0
        for req in self.reqs:
            blocks = manager.allocate_slots(req, 1)
            if blocks is None:
                raise MemcliError(f"vLLM's manager: no free block for request {req.request_id}",
                                  hint="lower --batch-size")
            req.num_computed_tokens += 1
            new += len(blocks.get_block_ids()[0])
        self.tally = self.tally._replace(decode_blocks=self.tally.decode_blocks + new)

    def finish(self) -> None:
        held = self._held()
        done = self.ref.request.RequestStatus.FINISHED_LENGTH_CAPPED
        for req in self.reqs:
            req.status = done
            self.manager.free(req)
        self.tally = self.tally._replace(freed_blocks=held - self._held())

    def _held(self) -> int:
        return self.num_blocks - 1 - self.manager.block_pool.get_num_free_blocks()

    def figures(self) -> BlockFigures:
        stats = self.manager.prefix_cache_stats
        cached = self.manager.block_pool.cached_block_hash_to_block._cache.values()
        return self.tally._replace(
            block_size=self.block_size, held_blocks=self._held(),
            cached_blocks=sum(len(v) if isinstance(v, dict) else 1 for v in cached),
            queries=(stats.queries - self._stats_before[0]) if stats else 0,
            hits=(stats.hits - self._stats_before[1]) if stats else 0)


class VllmComparison:
    """A `rounds.Comparison`: vLLM's real manager on each case; raises `IntegrityError` when
    its blocks differ from memcli's (the two managers must do the same work to be compared)."""

    name = NAME

    def __init__(self, ref: VllmReference, caching: bool = True):
        self.ref = ref
        self.backend = Setup("", SETUP)
        self.setup = (SETUP + (", prefix caching on" if caching else ", prefix caching off")
                      + "; blocks equal to memcli's, checked per case and round")
        self.figures: dict[Case, BlockFigures] = {}

    def slow_start_notes(self, cases: list[Case]) -> list[str]:
        return []

    def run_case(self, case: Case, config: Config, options, floor=None) -> dict[str, PhaseTiming]:
        batch = case_batch(lambda cfg, p, n, o: RealVllmBatch(self.ref, cfg, p, n, o), case, config, options.seed)
        phases, _, figures = time_batch(batch, decode_steps(case, config), options.repeat, options.warmup)
        self.figures[case] = figures
        return phases

    def check_case(self, case: Case, mine: CaseResult) -> None:
        """Raise `IntegrityError` unless the last run of `case` took, hit, cached and freed the
        blocks memcli's did."""
        theirs = self.figures[case]._asdict()
        if mine.blocks is None or mine.blocks["measured"] != theirs:
            raise IntegrityError(f"{case.label}: vLLM's manager and memcli's did different work"
                                 f" (vLLM {theirs}, memcli {mine.blocks and mine.blocks['measured']})")
