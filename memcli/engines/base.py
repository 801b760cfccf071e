"""What an engine is: a memory stack, a scheduling policy, its semantics, and its reference.

Tools take an `Engine` from the registry (`memcli.engines.get`) by the config's
`semantics.engine` and build everything through it; they never branch on its name.

A scheduler an engine builds offers what the tools drive and read (`Scheduler` is the
protocol): requests in (`new_req`, `add_request`), one `step()` at a time until `is_done()`,
and what happened out (`records`, `stats`, `finished`, `events`, `checker`, ...), in the shared
types of `memcli.steps`. The step log and the timeline need each record's `batch`
(`hooks.record_batches`) and the `finish`, `abort`, `retract` and `evict` events.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, NamedTuple, Optional, Protocol

from memcli.config import Config
from memcli.steps import SchedulerHooks, SchedulerStats, StepRecord


class Scheduler(Protocol):
    memory: Any  # the engine's memory manager
    clock_ms: float
    step_count: int
    waiting: list
    finished: list  # requests finished (or aborted) since the caller last cleared it
    records: list[StepRecord]
    events: list  # `memcli.steps.Event`s since the caller last cleared it (when hooks.record_events)
    stats: SchedulerStats
    checker: Any  # the after-step integrity checks (`memory.checker(...)`)

    def new_req(self, rid: str, input_ids, max_new_tokens: int, extra_key: Optional[str] = None,
                arrival_ms: float = 0.0, priority: int = 0) -> Any: ...  # priority: given only when non-zero

    def add_request(self, req: Any) -> None: ...

    def step(self) -> StepRecord: ...

    def is_done(self) -> bool: ...

    def active_reqs(self) -> list: ...

    def memory_holders(self) -> list: ...


class BlockFigures(NamedTuple):
    """A static batch's blocks (bench-one-batch on a block manager): tokens hit at admission,
    blocks taken from the free queue by the prefill and by the decode steps, blocks freed by
    the finish; and now: blocks held, blocks cached (hashed, held or free), the stats' queries
    and hits."""

    block_size: int = 0
    hit_tokens: int = 0
    prefill_blocks: int = 0
    decode_blocks: int = 0
    freed_blocks: int = 0
    held_blocks: int = 0
    free_blocks: int = 0
    cached_blocks: int = 0
    queries: int = 0
    hits: int = 0


class BlockBatch(Protocol):
    """bench-one-batch's static batch on an engine whose memory is a block manager driven by
    its scheduler's verbs (vLLM's). Each phase runs from the state the one before left:
    `start` (fresh memory, the prefix warmed, requests built) -> `prefill` (every request
    admitted) -> (`sample` (next output tokens appended, untimed), `decode` (one slot each)) x
    steps -> `finish` (every request freed). `figures` reads the blocks now, `expected` what
    the engine's rules give after `decode_steps` steps (the fields `figures` tallies)."""

    setup: str  # what runs, in words (tables and JSON)

    def start(self) -> None: ...

    def prefill(self) -> None: ...

    def sample(self) -> None: ...

    def decode(self) -> None: ...

    def finish(self) -> None: ...

    def figures(self) -> BlockFigures: ...

    def expected(self, decode_steps: int) -> BlockFigures: ...

    def idle(self) -> dict: ...  # the memory's idle check after `finish` (`ok` and its numbers)


@dataclass(frozen=True)
class Engine:
    """One engine, registered by name.

    `build_stack(config, *, future=None, page_size_overrides=None, cache_kind=None)` builds its
    memory (the value has `.memory`, the engine's memory manager, and the components that
    check-page-size inspects); `scheduler(memory, config, hooks)` its scheduling policy over
    that memory. `make_req` / `make_batch` build a request and a static batch (bench-one-batch;
    None when the engine has none). `static_batch(config, prompts, prefix_len, outputs)` builds
    bench-one-batch's static batch for an engine without `make_batch`, driven by the verbs of
    the engine's own scheduler (a `BlockBatch`; `prompts` and `outputs` are token arrays, one
    row per request). `reference` runs the engine's real code beside memcli
    step by step (`reference diff`; None without one); when `reference_steps`, its
    `on_step(reference, memcli)` keyword receives both sides' observations of every step (the
    step logs of `reference diff`). `profile`
    is the semantics profile that reproduces the engine, `semantics` the keys of `semantics.*` it
    reads. `limits` is what the engine does with requests past its limits
    (`memcli.capacity.LimitRule`: the requests it aborts at arrival or clips, as it would serving
    them); None: such a trace is refused. `describe` gives show-config the engine's own view
    (behaviours in force, derived sizes), when it has one (None: the profile's behaviours and
    memcli's sizes). `baseline` names the engine this one is a later release of (show-config
    prints, beside each behaviour in force, the baseline's value where it differs).
    `tracks_uses`: the engine's radix cache reads the trace's future (`build_stack`'s
    `future`), and its evictions carry the last and next use of what they evicted; a replay
    builds that future only for such an engine (the eviction report's reuse distances).
    `eviction_order(config)` names the eviction policy whose order the engine's tree follows
    under `config` (a study replays two points that differ only in policies of one order
    once); None: every policy is its own. `check(config)` refuses (`ConfigError`) a config the
    engine cannot run, building nothing (what `build_stack` would refuse first); None: the
    engine runs every config `load_config` accepts.
    """

    name: str
    summary: str
    build_stack: Callable[..., Any]
    scheduler: Callable[[Any, Config, SchedulerHooks], Scheduler]
    profile: str
    semantics: tuple[str, ...] = ()
    make_req: Optional[Callable[..., Any]] = None
    make_batch: Optional[Callable[..., Any]] = None
    static_batch: Optional[Callable[..., BlockBatch]] = None
    reference: Optional[Callable[..., Any]] = None
    limits: Optional[Callable[..., Any]] = None
    describe: Optional[Callable[[Config], tuple]] = None
    reference_steps: bool = False  # `reference` takes `on_step` (both sides' step observations)
    baseline: Optional[str] = None  # the engine's earlier release (its profile is the baseline's values)
    tracks_uses: bool = True
    eviction_order: Optional[Callable[[Config], str]] = None
    check: Optional[Callable[[Config], None]] = None
