"""Static page-size checks: what every built component holds, the divisibility and fit rules,
and what a page size costs.

Nothing runs here: the stack is built and inspected. The components and what reads their
page size follow the reference's table of page-size holders (memstack section 1.2).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from memcli.mem_cache.pages import cdiv, whole_pages
from memcli.mem_cache.integrity import CheckResult, failed, passed

ROLES = {
    "config": ("memory.page_size", "the single page size every component receives"),
    "kv_pool": ("KVPool", "KV buffer rows = size + page_size (page 0 is padding)"),
    "allocator": (None, "free list of pages; alloc_extend / alloc_decode page arithmetic"),
    "tree_cache": (None, "match granularity, page-aligned inserts; picks the alloc path"),
    "scheduler": ("PrefillAdder", "prefill budget rounding (pages.align_up), chunk truncation"),
    "null_cache": ("NullCache", "the bench path's tree cache; picks the alloc path"),
    "host_pool": ("HostKVPool", "hiradix host tier: backups and load-backs move whole pages"),
}


@dataclass(frozen=True)
class Component:
    """One holder of a page size in the built stack."""

    name: str
    holder: str
    page_size: int
    role: str
    injected: bool
    agrees: bool


@dataclass(frozen=True)
class StaticResult:
    components: list[Component]
    checks: list[CheckResult]

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.checks)

    @property
    def mismatched(self) -> list[str]:
        """Components whose page size differs from the config's."""
        return [c.name for c in self.components if not c.agrees]

    def to_dict(self) -> dict:
        return {
            "ok": self.ok,
            "components": [asdict(c) for c in self.components],
            "checks": [{"name": c.name, "ok": c.ok, "detail": c.detail} for c in self.checks],
        }


@dataclass(frozen=True)
class PageCost:
    """What a page size costs, in tokens (expected values for uniformly spread lengths)."""

    page_size: int
    max_running_requests: int
    pool_tokens: int

    @property
    def waste_per_request(self) -> float:
        """Partial-page waste of one running request: its last page is on average half empty."""
        return (self.page_size - 1) / 2

    @property
    def waste_at_max_running(self) -> float:
        return self.waste_per_request * self.max_running_requests

    @property
    def waste_at_max_running_fraction(self) -> float:
        return self.waste_at_max_running / self.pool_tokens if self.pool_tokens else 0.0

    @property
    def shortest_hit(self) -> int:
        """A shared prefix shorter than one page can never hit."""
        return self.page_size

    @property
    def reuse_lost_per_divergence(self) -> float:
        """Where two requests diverge, the shared tokens after the last page boundary are lost."""
        return (self.page_size - 1) / 2

    def to_dict(self) -> dict:
        return {
            "page_size": self.page_size,
            "waste_per_running_request_tokens": self.waste_per_request,
            "waste_at_max_running_tokens": self.waste_at_max_running,
            "waste_at_max_running_fraction": round(self.waste_at_max_running_fraction, 6),
            "max_running_requests": self.max_running_requests,
            "shortest_hit_prefix_tokens": self.shortest_hit,
            "reuse_lost_per_divergence_tokens": self.reuse_lost_per_divergence,
        }


def components(stack) -> list[Component]:
    """Every page-size holder of `stack`, in the order of `stack.page_sizes()`."""
    sizes = stack.page_sizes()
    classes = {"allocator": type(stack.allocator).__name__, "tree_cache": type(stack.tree_cache).__name__}
    want = stack.config.page_size
    out = []
    for name, page_size in sizes.items():
        holder, role = ROLES[name]
        out.append(Component(name, holder or classes[name], page_size, role, name in stack.injected,
                             page_size == want))
    return out


def static_checks(stack) -> StaticResult:
    """Build the component list and run the divisibility and fit rules against it."""
    comps = components(stack)
    sizes = sorted({c.page_size for c in comps})
    checks = [
        _agree(comps, stack.config.page_size),
        _power_of_two(comps),
        _pool_multiple(stack, sizes),
        _chunk_multiple(stack, sizes),
        _kv_rows(stack),
        _fits_max_request(stack),
    ]
    return StaticResult(comps, checks)


def page_cost(config, page_size: int | None = None) -> PageCost:
    ps = page_size or config.page_size
    return PageCost(ps, config.memory.max_running_requests, config.pool_size)


def _agree(comps: list[Component], want: int) -> CheckResult:
    bad = [c for c in comps if not c.agrees]
    if not bad:
        return passed("page sizes agree", f"all {len(comps)} components hold {want}")
    listed = ", ".join(f"{c.name} holds {c.page_size}" for c in bad)
    return failed("page sizes agree", f"{listed}; config memory.page_size is {want}")


def _power_of_two(comps: list[Component]) -> CheckResult:
    bad = [c for c in comps if c.page_size < 1 or c.page_size & (c.page_size - 1)]
    if bad:
        return failed("page size a power of two", ", ".join(f"{c.name} holds {c.page_size}" for c in bad))
    sizes = sorted({c.page_size for c in comps})
    return passed("page size a power of two", "page sizes " + ", ".join(map(str, sizes)))


def _pool_multiple(stack, sizes: list[int]) -> CheckResult:
    size = stack.kv_pool.size
    bad = [ps for ps in sizes if size % ps or stack.allocator.size % ps]
    detail = f"pool {size} tokens, allocator {stack.allocator.size} tokens"
    if bad:
        return failed("pool size a multiple of page size", detail + " not multiples of " + ", ".join(map(str, bad)))
    ps = stack.allocator.page_size
    return passed("pool size a multiple of page size", f"{detail} = {whole_pages(stack.allocator.size, ps)} pages of {ps}")


def _chunk_multiple(stack, sizes: list[int]) -> CheckResult:
    chunk = stack.config.scheduler.chunked_prefill_size
    if chunk is None:
        return passed("chunked prefill a multiple of page size", "chunked prefill disabled")
    bad = [ps for ps in sizes if chunk % ps]
    if bad:
        return failed("chunked prefill a multiple of page size",
                      f"chunked_prefill_size {chunk} is not a multiple of " + ", ".join(map(str, bad)))
    return passed("chunked prefill a multiple of page size",
                  f"chunked_prefill_size {chunk} = {chunk // max(sizes)} x {max(sizes)}")


def _kv_rows(stack) -> CheckResult:
    alloc = stack.allocator
    want = alloc.size + alloc.page_size
    rows = stack.kv_pool.rows
    detail = f"KV buffer {rows} rows, size {alloc.size} + allocator page size {alloc.page_size} = {want}"
    if rows != want:
        last = f"slots {alloc.num_pages * alloc.page_size}..{want - 1}"
        why = f": the allocator's last page ({last}) runs past the buffer" if rows < want else ": rows wasted"
        return failed("KV rows == size + page size", detail + why)
    return passed("KV rows == size + page size", detail)


def _fits_max_request(stack) -> CheckResult:
    ps, size = stack.allocator.page_size, stack.allocator.size
    context = stack.config.memory.max_context_len
    need = cdiv(context, ps) * ps
    detail = f"max_context_len {context} takes {cdiv(context, ps)} pages ({need} tokens); pool {size} tokens"
    return CheckResult("pool holds a max-length request", need <= size, detail)
