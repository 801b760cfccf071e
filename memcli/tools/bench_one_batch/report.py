"""Rich tables for bench-one-batch: one table per case, and a page-size comparison.

Every table reads without colour; times carry their unit, and syncs read "n/a (no device)"
on a CPU.
"""

from __future__ import annotations

from typing import Optional

from rich.table import Table

from memcli.report.envelope import envelope
from memcli.tools.bench_one_batch.host_tier_bench import LABELS as TRANSFER_LABELS
from memcli.tools.bench_one_batch.host_tier_bench import PHASES as TRANSFER_PHASES
from memcli.tools.bench_one_batch.host_tier_bench import TransferBench
from memcli.tools.bench_one_batch.phases import UNSTABLE_SPREAD, PhaseTiming
from memcli.tools.bench_one_batch.results import (BenchOutcome, BenchResult, CaseResult, KVStoreFigures,
                                                  paired_speedup, speedup)


def fmt_us(us: Optional[float]) -> str:
    if us is None:
        return "-"
    if us < 1_000:
        return f"{us:,.1f} µs"
    if us < 1_000_000:
        return f"{us / 1e3:,.2f} ms"
    return f"{us / 1e6:,.3f} s"


def fmt_rate(per_s: Optional[float], unit: str) -> str:
    if per_s is None:
        return "-"
    for scale, prefix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if per_s >= scale:
            return f"{per_s / scale:,.2f} {prefix}{unit}"
    return f"{per_s:,.1f} {unit}"


def fmt_syncs(syncs: Optional[int]) -> str:
    return "n/a (no device)" if syncs is None else str(syncs)


def fmt_spread(t: PhaseTiming) -> str:
    """Largest round median / smallest; `!` marks a figure that moved by more than the limit."""
    return f"{t.spread:.2f}x" + (" !" if t.unstable else "")


def fmt_ratio(ratio: Optional[float]) -> str:
    return "-" if ratio is None else f"{ratio:,.2f}x"


def outcome_document(outcome: BenchOutcome, ignored_keys: list[str]) -> dict:
    """The document `memcli bench-one-batch --json` prints (the cases, or the host copies)."""
    if outcome.transfers is not None:
        return outcome.transfers.to_document(ignored_keys)
    return bench_document(outcome.result, ignored_keys)


def render_outcome(outcome: BenchOutcome, console) -> None:
    """The tables `memcli bench-one-batch` prints."""
    if outcome.transfers is not None:
        render_transfers(outcome.transfers, console)
    else:
        render(outcome.result, console)


def bench_document(result: BenchResult, ignored_keys: list[str]) -> dict:
    """The --json document: the envelope (with the config the cases ran with), then the cases."""
    return envelope("bench-one-batch", {**result.to_dict(), "ignored_keys": ignored_keys}, result.config)


BLOCKS_LINE = ("engine memory: a block manager, host-side Python, timed by the wall clock on the host; memory path ="
               " the manager's calls alone (prefill: get_computed_blocks + allocate_slots + stats record per request;"
               " decode: allocate_slots of one token per request; free: free per request); the model step, its KV"
               " store and the block table belong to the model runner and are not timed.")


def _on_blocks(result: BenchResult) -> bool:
    cases = getattr(result, "cases", None)
    return bool(cases) and cases[0].blocks is not None


def header_line(result: BenchResult) -> str:
    opts = result.options
    how = ("CUDA events" if result.timing_method == "cuda-events"
           else "synchronized wall clock (no device events on a CPU)")
    rounds = opts.get("rounds", 1)
    return (f"bench-one-batch on {result.device}: timing by {how}; {rounds} rounds over every case (interleaved),"
            f" each phase {opts['repeat']} timed calls per round after {opts['warmup']} warm-up calls; median = median"
            f" of the round medians, min = fastest call, spread = largest round median / smallest"
            f" (! above {UNSTABLE_SPREAD:.2f}x); tree cache {opts['tree_cache']}; semantics {result.semantics}.\n"
            + (BLOCKS_LINE if _on_blocks(result) else
            "prefill = prepare_for_extend + KV store of the new tokens; decode step = prepare_for_decode +"
            " KV store of one token per request; memory path = alloc_for_extend / alloc_for_decode alone;"
            " free = release of every request; first call includes compilation.")
            + ("\nmedian/min: the device idle when each call starts, so host work and launch latency count;"
               " device: the same call queued behind a busy stream, so only the GPU's execution counts."
               if result.timing_method == "cuda-events" else ""))


def case_table(r: CaseResult) -> Table:
    c = r.case
    table = Table(title=f"{c.label} tree_cache={r.tree_cache}", title_justify="left",
                  caption=_caption(r), caption_justify="left")
    for name, justify in (("phase", "left"), ("median", "right"), ("min", "right"), ("spread", "right"),
                          ("device", "right"), ("first call", "right"), ("host syncs", "right"), ("rate", "right")):
        table.add_column(name, justify=justify)
    if "prefill" in r.phases:
        _model_step_rows(table, r)
    kind = f"cached prefix {r.cached_prefix_len:,}" if r.cached_prefix_len else "new"
    _row(table, f"prefill memory path ({kind})", r.phases["prefill_memory"],
         fmt_rate(_per_s(r.prefill_new_tokens, r.phases["prefill_memory"]), "tok/s"))
    if "decode_memory" in r.phases:
        _row(table, "decode memory path", r.phases["decode_memory"],
             fmt_rate(_per_s(c.batch_size, r.phases["decode_memory"]), "tok/s"))
    over = r.decode_over_floor()
    if over is not None:
        _row(table, f"launch floor (one-kernel graph replay; the decode path is {fmt_ratio(over['per_round'])} of it"
             f" per round, {fmt_ratio(over['ratio'])} by medians)", r.phases["launch_floor"], "")
    prefill = r.prefill_over_floor()
    if prefill is not None and "extend_floor" in r.phases:
        _row(table, f"extend floor (the extend's graph alone, into a fresh output: the prefill path is"
             f" {fmt_ratio(prefill['extend'])} of it, it is {fmt_ratio(prefill['extend_floor_over_launch'])}"
             f" of the launch floor, per round)", r.phases["extend_floor"], "")
    _row(table, f"free on finish ({_plural(c.batch_size, 'request')})", r.phases["free"], "")
    _kv_rows(table, r)
    return table


def _model_step_rows(table: Table, r: CaseResult) -> None:
    """The prefill and decode step of the stack (absent on a block manager, whose model step
    runs in the model runner)."""
    _row(table, "prefill", r.phases["prefill"], fmt_rate(r.prefill_throughput, "tok/s"))
    step = r.phases.get("decode_step")
    if step is not None:
        _row(table, f"decode step (median of {len(r.decode_step_us)})", step,
             fmt_rate(r.median_decode_throughput, "tok/s"))
    table.add_row(f"total (prefill + {len(r.decode_step_us)} steps)", fmt_us(r.total_latency * 1e6), "", "", "", "",
                  "", fmt_rate(r.overall_throughput, "tok/s"))
    table.add_section()


def _plural(n: int, word: str) -> str:
    return f"{n:,} {word}" + ("" if n == 1 else "s")


def _row(table: Table, label: str, t: PhaseTiming, rate: str) -> None:
    table.add_row(label, fmt_us(t.median_us), fmt_us(t.min_us), fmt_spread(t), fmt_us(t.device_us),
                  fmt_us(t.first_call_ms * 1e3), fmt_syncs(t.syncs), rate)


def _kv_rows(table: Table, r: CaseResult) -> None:
    kv = r.kv_store_prefill
    if kv is None:
        return
    table.add_section()
    ratio = f" ({kv.copy_ratio:.0%} of copy)" if kv.copy_ratio is not None else ""
    _row(table, f"KV store, prefill ({_plural(kv.tokens, 'token')}, {_mb(kv)})", kv.store,
         _bandwidth(kv.gbps) + ratio)
    if kv.copy is not None:
        _row(table, "device copy, same bytes", kv.copy, _bandwidth(kv.copy_gbps))
    if r.kv_store_decode is not None:
        d = r.kv_store_decode
        _row(table, f"KV store, decode ({_plural(d.tokens, 'token')})", d.store, _bandwidth(d.gbps))


def _bandwidth(gbps: Optional[float]) -> str:
    return fmt_rate(gbps * 1e9 if gbps is not None else None, "B/s")


def _mb(kv: KVStoreFigures) -> str:
    return f"{kv.bytes / 1e6:,.1f} MB"


def _per_s(amount: int, t: PhaseTiming) -> Optional[float]:
    return amount / (t.median_us / 1e6) if t.median_us > 0 else None


def _caption(r: CaseResult) -> str:
    if r.blocks is not None:
        return _blocks_caption(r)
    idle = r.idle
    verdict = "ok" if idle.get("ok") else "FAILED"
    lines = [
        f"KV slots: prefill {r.prefill_allocated_tokens:,} for {r.prefill_new_tokens:,} new tokens"
        f" (cached prefix {r.cached_prefix_len:,} per request), decode {r.decode_allocated_tokens:,},"
        f" freed on finish {r.freed_tokens:,}",
        f"idle check {verdict}: available {idle.get('available', 0):,} + evictable {idle.get('evictable', 0):,}"
        f" vs size {idle.get('size', 0):,}, protected {idle.get('protected', 0):,},"
        f" rows free {idle.get('rows_free', 0)}/{idle.get('rows', 0)}",
    ]
    if r.kv_store_note:
        lines.append(r.kv_store_note)
    return "\n".join(lines)


def _blocks_caption(r: CaseResult) -> str:
    """A block manager's case: its blocks beside what the engine's rules give."""
    b, got = r.blocks, r.blocks["measured"]
    verdict = "ok" if r.idle.get("ok") else "FAILED"
    differ = f" (differ: {', '.join(b['differ'])})" if b["differ"] else ""
    idle = r.idle
    return "\n".join([
        f"{b['setup']}; blocks of {got['block_size']} tokens: hit {got['hit_tokens'] // max(got['block_size'], 1):,}"
        f" blocks at admission ({r.cached_prefix_len:,} tokens per request), prefill took {got['prefill_blocks']:,}"
        f" new blocks, decode {got['decode_blocks']:,}, freed on finish {got['freed_blocks']:,};"
        f" {got['cached_blocks']:,} blocks cached after it; stats {got['queries']:,} queries, {got['hits']:,} hits",
        f"blocks check {verdict}: every figure as vLLM's rules give it{differ}; idle: {idle.get('available', 0):,}"
        f" + evictable {idle.get('evictable', 0):,} vs size {idle.get('size', 0):,}",
        f"prefill / decode step / KV store {r.kv_store_note}",
    ])


def _us_of(seconds: Optional[float]) -> Optional[float]:
    return None if seconds is None else seconds * 1e6


COMPARED = (
    ("prefill memory path", lambda r: r.phases["prefill_memory"].median_us),
    ("decode memory path", lambda r: _phase_us(r, "decode_memory")),
    ("free on finish", lambda r: r.phases["free"].median_us),
    ("prefill latency", lambda r: _us_of(r.prefill_latency)),
    ("median decode step", lambda r: _phase_us(r, "decode_step")),
    ("total latency", lambda r: _us_of(r.total_latency)),
)


def _phase_us(r: CaseResult, name: str) -> Optional[float]:
    phase = r.phases.get(name)
    return phase.median_us if phase else None


def comparison_table(result: BenchResult) -> Table:
    """Median times of the same case at every page size (one column per page size)."""
    page_sizes = result.page_sizes
    table = Table(title="page sizes compared (medians)", title_justify="left")
    for name in ("bs", "input", "output", "prefix", "phase"):
        table.add_column(name, justify="left" if name == "phase" else "right")
    for ps in page_sizes:
        table.add_column(f"page_size={ps}", justify="right")
    by_key: dict[tuple, dict[int, CaseResult]] = {}
    for r in result.cases:
        c = r.case
        by_key.setdefault((c.batch_size, c.input_len, c.output_len, c.prefix_len), {})[c.page_size] = r
    for key, row in by_key.items():
        for i, (label, figure) in enumerate(COMPARED):
            head = [f"{v:,}" for v in key] if i == 0 else ["", "", "", ""]
            table.add_row(*head, label, *(fmt_us(figure(row[ps])) if ps in row else "-" for ps in page_sizes))
        table.add_section()
    return table


PHASE_LABELS = {"prefill_memory": "prefill memory path", "decode_memory": "decode memory path",
                "free": "free on finish"}


def reference_table(result: BenchResult) -> Table:
    """memcli's memory path beside the compared implementation's, timed in the same rounds."""
    ref = result.reference
    what = ref.setup or f"attention backend {ref.backend_label}"
    if ref.setup and ref.attention_backend:
        what = f"{ref.setup}; attention backend {ref.backend_label}"
    table = Table(title=f"memcli vs {ref.name}, {what}: the memory path, same cases, same rounds (medians of round"
                        " medians)",
                  title_justify="left", caption=f"speedup = {ref.name} median / memcli median (above 1: memcli is"
                  " faster); per round = the median of the same ratio taken round by round, which a slow spell of"
                  " the machine hits on both sides alike; spread as in the case tables", caption_justify="left")
    for name, justify in (("case", "left"), ("phase", "left"), ("memcli", "right"), ("spread", "right"),
                          (ref.name, "right"), ("spread ", "right"), ("speedup", "right"), ("per round", "right")):
        table.add_column(name, justify=justify)
    last = None
    for case, name, mine, theirs in ref.rows(result.cases):
        label = case.case.label if case is not last else ""
        if case is not last and last is not None:
            table.add_section()
        last = case
        ratios = [fmt_ratio(r) for r in (speedup(mine, theirs), paired_speedup(mine, theirs))]
        table.add_row(label, PHASE_LABELS[name], fmt_us(mine.median_us), fmt_spread(mine), fmt_us(theirs.median_us),
                      fmt_spread(theirs), *ratios)
    return table


def floor_line(result: BenchResult) -> Optional[str]:
    """The launch floor, and the decode memory path of every case against the floor timed
    beside it (median of the per-round ratios)."""
    floor = result.floor
    if floor is None:
        return None
    ratios = [f"{r.case.batch_size}/{r.case.page_size}: {fmt_ratio(over['per_round'])}"
              for r in result.cases if (over := r.decode_over_floor()) is not None]
    line = (f"launch floor (replay of a one-kernel CUDA graph): {fmt_us(floor.median_us)} (spread {fmt_spread(floor)});"
            f" decode memory path / floor, per round, by batch size/page size: {', '.join(ratios) or '-'}")
    prefill = [f"{r.case.batch_size}/{r.case.page_size}/{r.cached_prefix_len}: {fmt_ratio(over['launch'])}"
               + (f" ({fmt_ratio(over['extend'])} of the extend floor)" if over["extend"] is not None else "")
               for r in result.cases if (over := r.prefill_over_floor()) is not None]
    if prefill:
        line += f"; prefill memory path / launch floor, per round, by batch size/page size/prefix: {', '.join(prefill)}"
    return line


def render(result: BenchResult, console) -> None:
    console.print(header_line(result))
    line = floor_line(result)
    if line:
        console.print(line)
    graphs = result.config.runtime.decode_graph is not False
    if result.cases and result.cases[0].backend == "triton" and result.timing_method == "cuda-events":
        console.print("memory paths: " + ("the decode step, the extend and the free of rows as CUDA-graph replays"
                                          " (runtime.decode_graph)" if graphs
                                          else "one kernel launch each (runtime.decode_graph false)"))
    for case in result.cases:
        console.print(case_table(case))
    if len(result.page_sizes) > 1:
        console.print(comparison_table(result))
    if result.reference is not None:
        console.print(reference_table(result))
    unstable = [f"{r.case.label}: {name}" for r in result.cases for name, t in r.phases.items() if t.unstable]
    if unstable:
        console.print(f"unstable (spread above {UNSTABLE_SPREAD:.2f}x, marked !): {len(unstable)} figure(s);"
                      " raise --repeat or --rounds, or quiet the machine")


def render_transfers(bench: TransferBench, console) -> None:
    """The host tier's copies (`--tree-cache hiradix`): GB/s of each case's backup and load-back
    beside plain copies of the same bytes."""
    table = Table(title=f"hiradix copies on {bench.device}: GB/s ({bench.timing}, median of {bench.rounds} rounds;"
                        f" host memory {'pinned' if bench.pinned else 'pageable'})", title_justify="left")
    phases = [TRANSFER_LABELS[p] for p in TRANSFER_PHASES]
    for name in ("case", "tokens", "MB", *phases, "backup / plain", "load / plain"):
        table.add_column(name, justify="left" if name == "case" else "right", no_wrap=name == "case")
    for row in bench.cases:
        c = row.case
        table.add_row(f"bs={c.batch_size} input={c.input_len} ps={c.page_size}", f"{row.tokens:,}",
                      f"{row.num_bytes / 1e6:,.1f}", *(f"{row.gbps(p):,.2f}" for p in TRANSFER_PHASES),
                      f"{row.share('backup', 'plain_d2h'):.0%}", f"{row.share('load_back', 'plain_h2d'):.0%}")
    console.print(table)
    console.print("GB/s = the batch's prompt K and V (every layer) / median time; backup and load-back move them"
                  " between the device pool's slots and the host pool's; the plain copies move the same bytes"
                  " between two contiguous tensors in the same run.")
