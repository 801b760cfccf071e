"""Operation-level differential harness: SGLang's real RadixCache + allocator vs memcli's.

`generate_ops(seed, page_size, policy, num_ops)` draws a random operation sequence;
`run_ops(ops, page_size, policy)` applies it to both stacks and compares, after every
operation, what each side returns and its whole state; `find_divergence` does both, and
`shrink` removes operations while the same divergence remains (a minimal repro).

Operations (`Op.kind`, `Op.arg`):

    insert  tokens   alloc len(tokens) slots, insert(key, slots), free the duplicate prefix
    match   tokens   match_prefix(key); the result node becomes handle number <op index>
    lock    handle   inc_lock_ref(node of that match)
    unlock  handle   dec_lock_ref(node of that match)
    evict   tokens   evict(tokens)

Every sequence (including any subsequence of one) is valid: an operation that would be
illegal on the reference (unlock without lock, lock of an evicted node, an insert that
does not fit) is skipped on both sides and observed as skipped. Both sides run on logical
clocks, so access times never tie and runs are reproducible.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Optional

import torch

from memcli.config import SemanticsConfig
from memcli.mem_cache.allocator import make_allocator
from memcli.mem_cache.base_prefix_cache import RadixKey as MemcliKey
from memcli.mem_cache.clock import LogicalClock
from memcli.mem_cache.pages import align_down, whole_pages
from memcli.mem_cache.radix_cache import RadixCache as MemcliRadixCache
from memcli.reference.loader import Reference, load_reference
from memcli.stack import radix_semantics


def record_frees(allocator: Any, freed: list) -> None:
    """Wrap `allocator.free` so that every non-empty free appends its slots (a list) to `freed`."""
    real_free = allocator.free

    def free(indices, *args, **kwargs):
        if indices.numel():
            freed.append(indices.reshape(-1).tolist())
        return real_free(indices, *args, **kwargs)

    allocator.free = free


OBSERVED = ("result", "tree", "free_list", "sizes", "leaf_order")


class Op(NamedTuple):
    kind: str
    arg: Any  # tokens (tuple of ints), a handle (op index) or a token count

    def __repr__(self) -> str:
        return f"{self.kind}({list(self.arg) if isinstance(self.arg, tuple) else self.arg})"


class Divergence(NamedTuple):
    """The first operation after which the two sides differ."""

    index: int
    op: Op
    field: str  # one of OBSERVED
    reference: Any  # SGLang's observation of `field`
    memcli: Any

    def __str__(self) -> str:
        return (f"op {self.index} {self.op!r}: {self.field} differs\n"
                f"  sglang: {self.reference}\n  memcli: {self.memcli}")


# -- one side ---------------------------------------------------------------------------------

@dataclass
class _Side:
    """One stack (SGLang's or memcli's) behind the same small interface."""

    tree: Any
    allocator: Any
    make_key: Any
    priority: Any  # node -> eviction priority
    root: Any
    freed: list = field(default_factory=list)  # slot lists of every allocator.free, in order
    handles: dict = field(default_factory=dict)  # op index -> node

    def record_frees(self) -> None:
        record_frees(self.allocator, self.freed)

    def observe_state(self) -> dict:
        return {"tree": _shape(self.root), "free_list": self.free_list(), "sizes": self.sizes(),
                "leaf_order": self.leaf_order()}

    def sizes(self) -> tuple[int, int, int, int]:
        """(available, evictable, protected, total) tokens."""
        return (self.allocator.available_size(), self.tree.evictable_size(), self.tree.protected_size(),
                int(self.tree.total_size()))

    def free_list(self) -> list[int]:
        if hasattr(self.allocator, "free_page_ids"):
            return self.allocator.free_page_ids().tolist()
        return torch.cat([self.allocator.free_pages, self.allocator.release_pages]).tolist()

    def leaf_order(self) -> list[tuple[int, ...]]:
        """Unlocked leaves (as full token paths), in the order the policy would evict them."""
        leaves = [n for n in _iter_nodes(self.root) if not n.children and n.lock_ref == 0]
        leaves.sort(key=lambda n: (self.priority(n), _path(n)))
        return [_path(n) for n in leaves]


def _tokens(node: Any) -> tuple[int, ...]:
    key = node.key
    ids = key.token_ids if hasattr(key, "token_ids") else key
    return tuple(int(t) for t in (ids.tolist() if hasattr(ids, "tolist") else ids))


def _iter_nodes(root: Any):
    stack = list(root.children.values())
    while stack:
        node = stack.pop()
        yield node
        stack.extend(node.children.values())


def _path(node: Any) -> tuple[int, ...]:
    parts = []
    while node.parent is not None:
        parts.append(_tokens(node))
        node = node.parent
    return tuple(t for part in reversed(parts) for t in part)


def _shape(node: Any) -> list:
    """Canonical tree: [(key, value, lock_ref, children)] sorted by key."""
    return sorted((_tokens(c), tuple(c.value.tolist()), c.lock_ref, _shape(c)) for c in node.children.values())


def _in_tree(node: Any, root: Any) -> bool:
    while node is not root:
        parent = node.parent
        if parent is None or all(child is not node for child in parent.children.values()):
            return False
        node = parent
    return True


def _sglang_side(ref: Reference, size: int, page_size: int, policy: str) -> _Side:
    kv_pool = ref.tiny_kv_pool(size, page_size)
    if page_size == 1:
        allocator = ref.TokenToKVPoolAllocator(size, torch.int64, ref.device, kv_pool, False)
    else:
        allocator = ref.PagedTokenToKVPoolAllocator(size, page_size, torch.int64, ref.device, kv_pool, False)
    tree = ref.RadixCache(None, allocator, page_size, eviction_policy=policy)
    side = _Side(tree, allocator, lambda t: ref.RadixKey(list(t)), tree.eviction_strategy.get_priority,
                 tree.root_node)
    side.record_frees()
    return side


def _memcli_side(size: int, page_size: int, policy: str, profile: str | SemanticsConfig) -> _Side:
    """memcli's cache under `profile` (a profile name, or a semantics section with overrides)."""
    allocator = make_allocator(size, page_size, torch.device("cpu"), "torch")
    if isinstance(profile, str):
        profile = SemanticsConfig(profile=profile)
    semantics = radix_semantics(profile.resolved())
    tree = MemcliRadixCache(None, allocator, page_size, eviction_policy=policy, **semantics)
    tree.clock = LogicalClock()
    side = _Side(tree, allocator, lambda t: MemcliKey(list(t)), tree.priority, tree.root)
    side.record_frees()
    return side


# -- applying operations ----------------------------------------------------------------------

def _skip_reason(op: Op, ref_side: _Side, locks: dict[int, int]) -> Optional[str]:
    """Why `op` is illegal on the reference's current state (None: run it on both sides)."""
    if op.kind == "insert" and ref_side.allocator.available_size() < len(op.arg):
        return "skipped: no room"
    if op.kind in ("lock", "unlock"):
        node = ref_side.handles.get(op.arg)
        if node is None or not _in_tree(node, ref_side.root):
            return "skipped: no such node"
        if op.kind == "unlock" and locks.get(op.arg, 0) == 0:
            return "skipped: not locked"
    return None


def _apply(side: _Side, index: int, op: Op) -> Any:
    """Run `op` on `side` (the caller checked it is legal); return its observable result."""
    if op.kind == "insert":
        value = side.allocator.alloc(len(op.arg))
        if value is None:
            return "alloc returned None"
        prefix_len = side.tree.insert(side.make_key(op.arg), value.clone())
        side.allocator.free(value[:prefix_len])
        return ("prefix_len", int(prefix_len), "slots", value.tolist())
    if op.kind == "match":
        result = side.tree.match_prefix(side.make_key(op.arg))
        side.handles[index] = result[1]
        return ("len", len(result[0]), "indices", result[0].tolist())
    if op.kind == "lock":
        return ("delta", side.tree.inc_lock_ref(side.handles[op.arg]))
    if op.kind == "unlock":
        return ("delta", side.tree.dec_lock_ref(side.handles[op.arg]))
    if op.kind == "evict":
        side.freed.clear()
        side.tree.evict(op.arg)
        return ("freed", list(side.freed))
    raise ValueError(f"unknown op kind {op.kind!r}")


def _count_lock(op: Op, result: Any, locks: dict[int, int]) -> None:
    if isinstance(result, tuple) and op.kind in ("lock", "unlock"):
        locks[op.arg] = locks.get(op.arg, 0) + (1 if op.kind == "lock" else -1)


def run_ops(ops: list[Op], page_size: int, policy: str = "lru", size: Optional[int] = None,
            ref: Optional[Reference] = None, fields: tuple[str, ...] = OBSERVED,
            profile: str | SemanticsConfig = "sglang-0.5.5") -> Optional[Divergence]:
    """Apply `ops` to both stacks (pools of `size` tokens, default 16 pages; memcli's radix
    cache built with `profile`'s behaviours); return the first divergence in `fields` (a
    subset of OBSERVED) or None. Installs a logical clock in SGLang's radix module for the
    run and restores the previous one after it."""
    ref = ref or load_reference()
    size = size or 16 * page_size
    ref.use_clock(LogicalClock())
    try:
        sgl, mem = _sglang_side(ref, size, page_size, policy), _memcli_side(size, page_size, policy, profile)
        first = _compare(-1, Op("start", None), {"result": None, **sgl.observe_state()},
                         {"result": None, **mem.observe_state()}, fields)
        if first is not None:
            return first
        locks: dict[int, int] = {}
        for index, op in enumerate(ops):
            skip = _skip_reason(op, sgl, locks)
            ref_result = skip or _apply(sgl, index, op)
            mem_result = skip or _apply(mem, index, op)
            _count_lock(op, ref_result, locks)
            found = _compare(index, op, {"result": ref_result, **sgl.observe_state()},
                             {"result": mem_result, **mem.observe_state()}, fields)
            if found is not None:
                return found
        return None
    finally:
        ref.restore_clock()


def _compare(index: int, op: Op, ref_obs: dict, mem_obs: dict, fields: tuple[str, ...]) -> Optional[Divergence]:
    for name in fields:
        if ref_obs[name] != mem_obs[name]:
            return Divergence(index, op, name, ref_obs[name], mem_obs[name])
    return None


# -- generating and shrinking -----------------------------------------------------------------

def _random_key(rng: random.Random, page_size: int, known: list[tuple[int, ...]], aligned: bool) -> tuple[int, ...]:
    """Tokens built from a few distinct pages, often extending or diverging from a known key."""
    num_pages = rng.randint(1, 4)
    pages = [tuple([rng.randint(0, 2)] + [7] * (page_size - 1)) for _ in range(num_pages)]
    tokens = tuple(t for page in pages for t in page)
    if known and rng.random() < 0.7:
        base = rng.choice(known)
        cut = rng.randint(1, whole_pages(len(base), page_size)) * page_size
        tokens = base[:cut] + tokens[: rng.randint(0, 2) * page_size]
        if page_size > 1 and rng.random() < 0.3:  # differ inside a page: paged match floors
            pos = rng.randrange(len(tokens))
            tokens = tokens[:pos] + (9,) + tokens[pos + 1:]
    if not aligned and rng.random() < 0.5:
        tokens = tokens + (rng.randint(0, 2),) * rng.randint(1, max(1, page_size - 1))
    return tokens


def generate_ops(seed: int, page_size: int, num_ops: int, policy: str = "lru") -> list[Op]:
    """A random operation sequence (handles refer to earlier match ops). `policy` is not
    used to draw the operations; it is accepted so that a case reads as one tuple."""
    rng = random.Random(seed)
    ops: list[Op] = []
    known: list[tuple[int, ...]] = []
    matches: list[int] = []
    for index in range(num_ops):
        kind = rng.choices(["insert", "match", "lock", "unlock", "evict"], [4, 4, 2, 2, 1])[0]
        if kind in ("lock", "unlock") and matches:
            ops.append(Op(kind, rng.choice(matches[-4:])))
        elif kind == "evict":
            ops.append(Op("evict", rng.randint(1, 3) * page_size))
        elif kind == "match":
            ops.append(Op("match", _random_key(rng, page_size, known, aligned=False)))
            matches.append(index)
        else:
            key = _random_key(rng, page_size, known, aligned=True)
            key = key[: align_down(len(key), page_size)]
            known.append(key)
            ops.append(Op("insert", key))
    return ops


def find_divergence(seed: int, page_size: int, policy: str, num_ops: int,
                    ref: Optional[Reference] = None, profile: str = "sglang-0.5.5") -> Optional[Divergence]:
    """Generate `num_ops` operations from `seed` and run them on both stacks."""
    return run_ops(generate_ops(seed, page_size, num_ops, policy), page_size, policy, ref=ref, profile=profile)


def shrink(ops: list[Op], page_size: int, policy: str, ref: Optional[Reference] = None,
           profile: str = "sglang-0.5.5") -> list[Op]:
    """Greedily drop operations while the run still diverges in the same field. Returns a
    sequence where removing any single operation makes that divergence disappear."""
    first = run_ops(ops, page_size, policy, ref=ref, profile=profile)
    if first is None:
        return ops
    ops = ops[: first.index + 1]
    changed = True
    while changed:
        changed = False
        for i in range(len(ops) - 1, -1, -1):
            trial = _drop(ops, i)
            found = run_ops(trial, page_size, policy, ref=ref, profile=profile)
            if found is not None and found.field == first.field:
                ops, changed = trial[: found.index + 1], True
    return ops


def _drop(ops: list[Op], i: int) -> list[Op]:
    """`ops` without op i; handles (op indices) after it are renumbered, and lock/unlock of
    the dropped match keep pointing at nothing (they are skipped)."""
    out = []
    for j, op in enumerate(ops):
        if j == i:
            continue
        if op.kind in ("lock", "unlock"):
            handle = op.arg if op.arg < i else (op.arg - 1 if op.arg > i else -1)
            op = Op(op.kind, handle)
        out.append(op)
    return out
