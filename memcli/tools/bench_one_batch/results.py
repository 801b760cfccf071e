"""Results of bench-one-batch: one `CaseResult` per case, in the reference's terms and memcli's,
and the outcome of the command (`BenchOutcome`: the memory-path cases, or the host tier's copies).

Reference terms (SGLang's bench_one_batch, seconds and tokens/s):

    prefill_latency          median time of one prefill (prepare_for_extend + KV store)
    prefill_throughput       batch_size * input_len / prefill_latency
    median_decode_latency    median over the decode steps of each step's median time
    median_decode_throughput batch_size / median_decode_latency
    total_latency            prefill_latency + the sum of every decode step's median time
    overall_throughput       batch_size * (input_len + output_len) / total_latency

The reference runs output_len - 1 decode steps (its prefill samples the first token), and so
does the `sglang-0.5.5` profile; the `memcli` profile runs output_len, so that every request
ends with input_len + output_len KV slots (`semantics.bench_decode_steps`).
"""

from __future__ import annotations

import dataclasses
import statistics
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

from memcli.config import Config
from memcli.errors import IntegrityError
from memcli.tools.bench_one_batch.cases import Case
from memcli.tools.bench_one_batch.host_tier_bench import TransferBench
from memcli.tools.bench_one_batch.phases import PhaseTiming, combine_rounds

# Every timed phase, in report order, with what one call of it does.
PHASES = {
    "prefill": "prefill: prepare_for_extend + KV store of the new tokens (store only with real K/V buffers)",
    "decode_step": "decode step: prepare_for_decode + KV store of one token per request (median over steps)",
    "prefill_memory": "prefill memory path: alloc_for_extend (rows, KV slots, write_cache_indices)",
    "decode_memory": "decode memory path: alloc_for_decode (one slot per request + req_to_token write)",
    "free": "free on finish: release of every request",
    "kv_store_prefill": "KV store of the prefill's new tokens, every layer",
    "copy_prefill": "plain device copy of as many bytes, K into V then V into K (bandwidth baseline)",
    "kv_store_decode": "KV store of one decode step, every layer",
    "launch_floor": "launch floor: replay of a one-kernel CUDA graph, timed in turn with the decode memory path",
    "extend_floor": "extend floor: the extend kernel's graph replayed with its arguments in place, into a fresh"
                    " output and its views, timed in turn with the prefill memory path",
}


@dataclass(frozen=True)
class KVStoreFigures:
    """Bytes of K and V written for every layer, and the bandwidth achieved."""

    tokens: int
    bytes: int
    store: PhaseTiming
    copy: Optional[PhaseTiming] = None

    @property
    def gbps(self) -> float:
        return self.bytes / (self.store.median_us * 1e3) if self.store.median_us > 0 else 0.0

    @property
    def copy_gbps(self) -> Optional[float]:
        if self.copy is None or self.copy.median_us <= 0:
            return None
        return self.bytes / (self.copy.median_us * 1e3)

    @property
    def copy_ratio(self) -> Optional[float]:
        """Store bandwidth / copy bandwidth (1.0 = as fast as a plain copy)."""
        copy = self.copy_gbps
        return self.gbps / copy if copy else None

    @staticmethod
    def combine(rounds: Sequence[Optional["KVStoreFigures"]]) -> Optional["KVStoreFigures"]:
        if rounds[0] is None:
            return None
        copies = [r.copy for r in rounds if r.copy is not None]
        return KVStoreFigures(rounds[0].tokens, rounds[0].bytes, combine_rounds([r.store for r in rounds]),
                              combine_rounds(copies) if copies else None)

    def to_dict(self) -> dict[str, Any]:
        return {"tokens": self.tokens, "bytes": self.bytes, "store_us": self.store.median_us, "gbps": self.gbps,
                "copy_us": self.copy.median_us if self.copy else None, "copy_gbps": self.copy_gbps,
                "copy_ratio": self.copy_ratio}


@dataclass(frozen=True)
class CaseResult:
    run_name: str
    case: Case
    tree_cache: str
    device: str
    backend: str
    timing_method: str
    cached_prefix_len: int
    prefill_new_tokens: int
    prefill_allocated_tokens: int
    decode_allocated_tokens: int
    freed_tokens: int
    page_sizes: dict[str, int]
    phases: dict[str, PhaseTiming]
    decode_step_us: list[float] = field(default_factory=list)
    kv_store_prefill: Optional[KVStoreFigures] = None
    kv_store_decode: Optional[KVStoreFigures] = None
    kv_store_note: Optional[str] = None
    idle: dict[str, Any] = field(default_factory=dict)
    blocks: Optional[dict[str, Any]] = None  # a block manager's case: its blocks, expected and measured

    # -- the reference's figures (seconds, tokens/s; None without a `prefill` phase) ----------
    @property
    def prefill_latency(self) -> Optional[float]:
        phase = self.phases.get("prefill")
        return phase.median_us / 1e6 if phase else None

    @property
    def prefill_throughput(self) -> Optional[float]:
        if self.prefill_latency is None:
            return None
        return _per_second(self.case.batch_size * self.case.input_len, self.prefill_latency)

    @property
    def median_decode_latency(self) -> Optional[float]:
        step = self.phases.get("decode_step")
        return step.median_us / 1e6 if step else None

    @property
    def median_decode_throughput(self) -> Optional[float]:
        latency = self.median_decode_latency
        return _per_second(self.case.batch_size, latency) if latency is not None else None

    @property
    def total_latency(self) -> Optional[float]:
        if self.prefill_latency is None:
            return None
        return self.prefill_latency + sum(self.decode_step_us) / 1e6

    @property
    def overall_throughput(self) -> Optional[float]:
        if self.total_latency is None:
            return None
        return _per_second(self.case.batch_size * self.case.seq_len, self.total_latency)

    def decode_over_floor(self) -> Optional[dict[str, Optional[float]]]:
        """The decode memory path over the launch floor timed beside it (a GPU's cases):
        `ratio` of the medians, and `per_round`, the median of the rounds' ratios."""
        memory, floor = self.phases.get("decode_memory"), self.phases.get("launch_floor")
        if memory is None or floor is None or floor.median_us <= 0:
            return None
        return {"ratio": memory.median_us / floor.median_us, "per_round": paired_ratio(memory, floor)}

    def prefill_over_floor(self) -> Optional[dict[str, Optional[float]]]:
        """The prefill memory path over the floors (a GPU's cases), per round (the median of
        the rounds' ratios): `launch` the launch floor (timed in the same round, beside the
        decode path), `extend` the extend floor timed beside it, and `extend_floor_over_launch`
        what the extend's own floor is of the launch floor. None without a launch floor."""
        memory, launch = self.phases.get("prefill_memory"), self.phases.get("launch_floor")
        if memory is None or launch is None or launch.median_us <= 0:
            return None
        extend = self.phases.get("extend_floor")
        return {"launch": paired_ratio(memory, launch),
                "extend": None if extend is None else paired_ratio(memory, extend),
                "extend_floor_over_launch": None if extend is None else paired_ratio(extend, launch)}

    def syncs(self) -> dict[str, Optional[int]]:
        """Host-device syncs per call of each phase (None on a CPU)."""
        return {name: self.phases[name].syncs for name in PHASES if name in self.phases}

    def to_dict(self) -> dict[str, Any]:
        """One flat record (the reference's keys first), as written to --result-file; a block
        manager's case adds `blocks` (and has no prefill or decode-step latency: None)."""
        c = self.case
        out = {
            "run_name": self.run_name, "batch_size": c.batch_size, "input_len": c.input_len,
            "output_len": c.output_len, "prefill_latency": self.prefill_latency,
            "prefill_throughput": self.prefill_throughput, "median_decode_latency": self.median_decode_latency,
            "median_decode_throughput": self.median_decode_throughput, "total_latency": self.total_latency,
            "overall_throughput": self.overall_throughput,
            "prefix_len": c.prefix_len, "page_size": c.page_size, "tree_cache": self.tree_cache,
            "device": self.device, "backend": self.backend, "timing_method": self.timing_method,
            "cached_prefix_len": self.cached_prefix_len, "prefill_new_tokens": self.prefill_new_tokens,
            "prefill_allocated_tokens": self.prefill_allocated_tokens,
            "decode_allocated_tokens": self.decode_allocated_tokens, "freed_tokens": self.freed_tokens,
            "kv_tokens_needed": c.kv_tokens_needed,
            "prefill_memory_us": self.phases["prefill_memory"].median_us,
            "decode_memory_us": _median_us(self.phases.get("decode_memory")),
            "decode_over_floor": self.decode_over_floor(),
            "prefill_over_floor": self.prefill_over_floor(),
            "free_us": self.phases["free"].median_us,
            "device_us": {name: self.phases[name].device_us for name in PHASES if name in self.phases},
            "syncs": self.syncs(),
            "phases": {name: self.phases[name].to_dict() for name in PHASES if name in self.phases},
            "decode_step_us": self.decode_step_us,
            "kv_store_prefill": self.kv_store_prefill.to_dict() if self.kv_store_prefill else None,
            "kv_store_decode": self.kv_store_decode.to_dict() if self.kv_store_decode else None,
            "kv_store_note": self.kv_store_note,
            "page_sizes": self.page_sizes,
            "idle": self.idle,
        }
        if self.blocks is not None:
            out["blocks"] = self.blocks
        return out


# What every round of a case must reproduce exactly: the bench is deterministic.
_SAME_EVERY_ROUND = ("cached_prefix_len", "prefill_new_tokens", "prefill_allocated_tokens",
                     "decode_allocated_tokens", "freed_tokens", "blocks")


def combine_case_rounds(rounds: Sequence[CaseResult]) -> CaseResult:
    """One result from the rounds of one case: every phase by `combine_rounds`, each decode
    step's time as the median over rounds, and the idle check ok only if every round's was.
    Raises IntegrityError when two rounds allocated or freed different token counts."""
    first = rounds[0]
    for r in rounds[1:]:
        for name in _SAME_EVERY_ROUND:
            if getattr(r, name) != getattr(first, name):
                raise IntegrityError(f"{first.case.label}: {name} differs between rounds"
                                     f" ({getattr(first, name)} then {getattr(r, name)})")
    phases = {name: combine_rounds([r.phases[name] for r in rounds]) for name in first.phases}
    steps = [statistics.median(step) for step in zip(*(r.decode_step_us for r in rounds))]
    bad_idle = next((r.idle for r in rounds if not r.idle.get("ok")), None)
    return dataclasses.replace(
        first, phases=phases, decode_step_us=steps,
        kv_store_prefill=KVStoreFigures.combine([r.kv_store_prefill for r in rounds]),
        kv_store_decode=KVStoreFigures.combine([r.kv_store_decode for r in rounds]),
        idle=bad_idle if bad_idle is not None else first.idle)


# The phases timed on both sides by `--compare`: the memory path alone.
COMPARED_PHASES = ("prefill_memory", "decode_memory", "free")


@dataclass(frozen=True)
class ReferenceResult:
    """The compared implementation's timings: one dict of phases per case, in case order."""

    name: str
    phases: list[dict[str, PhaseTiming]]
    attention_backend: str = ""  # the server argument the reference ran with
    backend_label: str = ""  # the same, and why (SGLang's default on the device, or asked for)
    setup: str = ""  # what runs, where no attention backend names it (vLLM's host-side manager)

    def rows(self, cases: Sequence[CaseResult]) -> list[tuple[CaseResult, str, PhaseTiming, PhaseTiming]]:
        """(case, phase, memcli's timing, the reference's) for every phase timed on both sides."""
        return [(case, name, case.phases[name], ref[name])
                for case, ref in zip(cases, self.phases) for name in COMPARED_PHASES
                if name in ref and name in case.phases]

    def to_dict(self, cases: Sequence[CaseResult]) -> dict[str, Any]:
        head = {"name": self.name, "attention_backend": self.attention_backend, "backend": self.backend_label}
        if self.setup and self.attention_backend:  # both: the backend it runs with, and what runs
            head["setup"] = self.setup
        elif self.setup:
            head = {"name": self.name, "attention_backend": None, "setup": self.setup}
        return {**head, "rows": [
            {"case": case.case.label, "phase": name, "memcli": mine.to_dict(), "reference": ref.to_dict(),
             "speedup": speedup(mine, ref), "paired_speedup": paired_speedup(mine, ref)}
            for case, name, mine, ref in self.rows(cases)]}


def speedup(mine: PhaseTiming, reference: PhaseTiming) -> Optional[float]:
    """The reference's median over memcli's (above 1: memcli is faster)."""
    return reference.median_us / mine.median_us if mine.median_us > 0 else None


def paired_speedup(mine: PhaseTiming, reference: PhaseTiming) -> Optional[float]:
    """The median over rounds of the reference's round median over memcli's in the same round
    (None without matching rounds). The two sides of a round run seconds apart, so a slow
    spell of the machine divides out of each round's ratio."""
    return paired_ratio(reference, mine)


def paired_ratio(numerator: PhaseTiming, denominator: PhaseTiming) -> Optional[float]:
    """The median over rounds of `numerator`'s round median over `denominator`'s (None when
    the rounds do not pair)."""
    pairs = [a / b for a, b in zip(numerator.round_medians, denominator.round_medians) if b > 0]
    if not pairs or len(numerator.round_medians) != len(denominator.round_medians):
        return None
    return statistics.median(pairs)


@dataclass(frozen=True)
class BenchResult:
    """Every case of one invocation, with the config and options used."""

    config: Config  # the config the cases ran with (`--tree-cache` as cache.kind)
    options: dict[str, Any]
    device: str
    timing_method: str
    cases: list[CaseResult]
    reference: Optional[ReferenceResult] = None  # `--compare`: the other implementation's timings
    floor: Optional[PhaseTiming] = None  # on a GPU: replay of a one-kernel CUDA graph, the launch floor

    @property
    def semantics(self) -> str:
        """The profile and its overrides (`SemanticsConfig.label`)."""
        return self.config.semantics.label

    @property
    def page_sizes(self) -> list[int]:
        return list(dict.fromkeys(r.case.page_size for r in self.cases))

    def to_dict(self) -> dict[str, Any]:
        """The fields of the --json document (its envelope carries the config)."""
        return {"device": self.device, "timing_method": self.timing_method, "options": self.options,
                "phase_descriptions": PHASES, "cases": [r.to_dict() for r in self.cases],
                "compare": self.reference.to_dict(self.cases) if self.reference else None,
                "graph_floor": self.floor.to_dict() if self.floor else None}


def _per_second(amount: float, seconds: Optional[float]) -> float:
    return amount / seconds if seconds else 0.0


def _median_us(phase: Optional[PhaseTiming]) -> Optional[float]:
    return phase.median_us if phase else None


@dataclass(frozen=True)
class BenchOutcome:
    """What `memcli bench-one-batch` timed: the memory-path cases (`result`), or with
    `--tree-cache hiradix` the host tier's copies (`transfers`); the other is None."""

    result: Optional[BenchResult] = None
    transfers: Optional[TransferBench] = None

    @property
    def idle_failures(self) -> list[str]:
        """The cases after which the idle stack did not account for every slot."""
        if self.result is None:
            return []
        return [r.case.label for r in self.result.cases if not r.idle.get("ok")]
