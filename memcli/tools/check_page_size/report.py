"""Human output of `check-page-size`: tables per page size, cost lines, the first violation,
and a comparison table when several page sizes ran. (JSON: `result.to_dict()`.)

Everything reads without colour: verdicts are the words pass / FAIL / skipped.
"""

from __future__ import annotations

from rich.console import Console
from rich.table import Table
from rich.text import Text

from memcli.report.envelope import envelope
from memcli.report.tables import fmt

COVERAGE_LABELS = {
    "requests": "requests",
    "finished": "finished",
    "prefill_batches": "prefill batches",
    "decode_steps": "decode steps",
    "radix_hits": "requests with a prefix hit at admission",
    "cached_tokens": "prefix tokens reused at admission",
    "prompts_ending_mid_page": "prompts ending mid-page",
    "chunked_requests": "chunked requests",
    "prefill_chunks": "non-final prefill chunks",
    "page_boundary_decodes": "decode steps opening a new page (per request)",
    "evictions": "evictions (tree nodes)",
    "evicted_blocks": "evictions (cached blocks reused)",
    "evicted_tokens": "evicted tokens",
    "pressure_retractions": "retractions under memory pressure",
    "forced_retractions": "forced retractions (retract_every)",
    "preemptions": "preemptions (by recompute)",
    "retracted_requests": "retracted requests",
    "aborts_waiting": "aborted while waiting (workload)",
    "aborts_running": "aborted while running (workload)",
    "aborts_chunked": "aborted while chunked (workload)",
    "scheduler_aborts": "aborted by the scheduler",
    "prefill_ooms": "prefill out-of-memory events",
    "drained": "not finished within --steps (aborted at the limit)",
    "mean_partial_page_waste": "mean partial-page waste per running request (tokens)",
}


def check_document(result, config) -> dict:
    """The --json document: the envelope (the user's config; each run's page size is in `runs`),
    then the result."""
    return envelope("check-page-size", result.to_dict(), config)


def verdict(ok: bool) -> str:
    return "pass" if ok else "FAIL"


def render(result, console: Console) -> None:
    """Print every page size's sections, then the comparison table and the overall verdict."""
    console.print(f"semantics: {result.semantics}", markup=False)
    for run in result.runs:
        render_run(run, console)
    if len(result.runs) > 1:
        console.print(comparison_table(result))
        console.print()
    render_verdict(result, console)


def render_run(run, console: Console) -> None:
    console.print(f"[bold]check-page-size: page size {run.page_size}[/bold]")
    for note in run.notes:
        console.print(f"note: {note}", markup=False)
    for adjustment in run.static_adjustments:
        console.print(f"static stack: {adjustment}", markup=False)
    console.print(components_table(run.static))
    console.print(checks_table("static checks", run.static.checks))
    render_cost(run, console)
    if run.phases:
        console.print(f"dynamic run: {run.phases[0].workload}", markup=False)
        for adjustment in run.dynamic_adjustments:
            console.print(f"  changed for the dynamic run: {adjustment}", markup=False)
        console.print(coverage_table(run.phases))
        for phase in run.phases:
            render_phase(phase, console)
    else:
        console.print("dynamic run: skipped (--steps 0)")
    console.print()


def components_table(static) -> Table:
    table = Table(title="components: the page size each holds or reads", title_justify="left")
    for name, justify in (("component", "left"), ("holder", "left"), ("page size", "right"),
                          ("reads it for", "left"), ("agrees", "left")):
        table.add_column(name, justify=justify)
    for comp in static.components:
        size = f"{comp.page_size} (injected)" if comp.injected else str(comp.page_size)
        table.add_row(comp.name, comp.holder, size, Text(comp.role), "yes" if comp.agrees else "NO")
    return table


def checks_table(title: str, checks) -> Table:
    """Static checks (`CheckResult`) or dynamic ones (`CheckRow`, with a description and "skipped")."""
    dynamic = bool(checks) and hasattr(checks[0], "what")
    table = Table(title=title, title_justify="left")
    table.add_column("check")
    if dynamic:
        table.add_column("invariant", ratio=1)
    table.add_column("result")
    table.add_column("numbers", overflow="fold", ratio=2)
    for check in checks:
        status = check.status if dynamic else verdict(check.ok)
        cells = [check.name, *([Text(check.what)] if dynamic else []), "FAIL" if status == "fail" else status]
        table.add_row(*cells, Text(check.detail))
    return table


def render_cost(run, console: Console) -> None:
    cost = run.cost
    measured = ""
    if run.phases and "mean_partial_page_waste" in run.phases[0].coverage:  # sampled by SGLang's phases
        measured = f"; measured {run.phases[0].coverage['mean_partial_page_waste']:g} in the dynamic run"
    console.print(f"cost of page size {cost.page_size}:")
    console.print(f"  partial-page waste: ({cost.page_size} - 1) / 2 = {cost.waste_per_request:g} tokens per running"
                  f" request on average; {cost.waste_at_max_running:,.0f} tokens at {cost.max_running_requests}"
                  f" running requests ({cost.waste_at_max_running_fraction:.1%} of the {cost.pool_tokens:,}-token"
                  f" pool){measured}")
    console.print(f"  shortest prefix that can ever hit: {cost.shortest_hit} tokens (one page); shorter shared"
                  " prefixes never hit")
    console.print(f"  reuse lost per divergence point: about {cost.reuse_lost_per_divergence:g} tokens (shared"
                  " tokens after the last page boundary before two requests diverge)")


def coverage_table(phases) -> Table:
    table = Table(title="what the workload covered", title_justify="left")
    table.add_column("count")
    for phase in phases:
        table.add_column(phase.name, justify="right")
    for key, label in COVERAGE_LABELS.items():
        if any(key in phase.coverage for phase in phases):  # a count no phase's engine keeps is not shown
            table.add_row(label, *(fmt(phase.coverage.get(key)) for phase in phases))
    return table


def render_phase(phase, console: Console) -> None:
    console.print(f"{phase.name}: {phase.cache_kind}, pool {phase.pool_tokens:,} tokens in pages of"
                  f" {phase.page_size}, {phase.steps} steps, {phase.seconds:.2f} s")
    console.print(checks_table(f"{phase.name}: checks after every step", phase.checks))
    if phase.violation is not None:
        render_violation(phase.violation, phase.also_failed, console)


def render_violation(violation, also_failed, console: Console) -> None:
    console.print(f"first violation: step {violation.step}, check {violation.name}")
    where = []
    if violation.rid is not None:
        where.append(f"request {violation.rid}")
    if violation.positions:
        where.append("positions " + ", ".join(map(str, violation.positions)))
    if violation.slots:
        where.append("slots " + ", ".join(map(str, violation.slots)))
    if where:
        console.print("  " + "; ".join(where), markup=False)
    console.print(f"  {violation.detail}", markup=False)
    if also_failed:
        console.print("  also failing at that step: " + ", ".join(v.name for v in also_failed))


COMPARISON_ROWS = (
    ("static checks", "static_ok"),
    ("dynamic checks", "dynamic_ok"),
    ("steps", "steps"),
    (COVERAGE_LABELS["radix_hits"], "radix_hits"),
    (COVERAGE_LABELS["cached_tokens"], "cached_tokens"),
    (COVERAGE_LABELS["evictions"], "evictions"),
    (COVERAGE_LABELS["pressure_retractions"], "pressure_retractions"),
    (COVERAGE_LABELS["forced_retractions"], "forced_retractions"),
    ("requests not finished within --steps (every phase)", "unfinished"),
    ("partial-page waste per request, expected", "expected_waste_per_request"),
    ("partial-page waste per request, measured", "measured_waste_per_request"),
    ("shortest prefix that can hit", "shortest_hit_prefix"),
    ("reuse lost per divergence point", "reuse_lost_per_divergence"),
    ("first violation", "first_violation"),
)


def comparison_table(result) -> Table:
    """One column per page size, one row per verdict, count or cost (tokens)."""
    rows = result.comparison()
    table = Table(title="page sizes side by side", title_justify="left")
    table.add_column("page size")
    for row in rows:
        table.add_column(str(row["page_size"]), justify="right")
    for label, key in COMPARISON_ROWS:
        cells = []
        for row in rows:
            value = row[key]
            cells.append(verdict(value) if key.endswith("_ok") and value is not None else fmt(value))
        table.add_row(label, *cells)
    return table


def render_verdict(result, console: Console) -> None:
    unfinished = [f"page size {run.page_size} {phase.name}: {phase.unfinished} of {phase.coverage['requests']}"
                  for run in result.runs for phase in run.unfinished_phases]
    if result.ok:
        if not unfinished:
            console.print("result: every page size consistent (exit 0)")
            return
        allowed = result.allow_unfinished
        console.print(f"result: every page size consistent, but {result.unfinished} request(s) did not finish within"
                      f" --steps {result.steps}{' (allowed by --allow-unfinished)' if allowed else ''}"
                      f" (exit {result.exit_code})")
        for line in unfinished:
            console.print(f"  {line} not finished", markup=False)
        return
    problems = []
    for run in result.runs:
        bad = [c.name for c in run.static.checks if not c.ok]
        if bad:
            problems.append(f"page size {run.page_size} static: {', '.join(bad)}")
        for phase in run.phases:
            if phase.violation is not None:
                v = phase.violation
                problems.append(f"page size {run.page_size} {phase.name}: {v.name} at step {v.step}")
    console.print(f"result: {len(problems)} problem(s) found (exit 1)")
    for line in problems:
        console.print(f"  {line}", markup=False)
    for line in unfinished:
        console.print(f"  {line} not finished within --steps {result.steps}", markup=False)


def unfinished_hint(result) -> str:
    """How to finish every request: a --steps computed from the whole workload."""
    return (f"raise the limit: --steps {result.steps_hint} lets every request finish even when they run one"
            " after another (or pass --allow-unfinished to accept the drained requests)")
