"""Rich trees of a prefix cache's contents, for people (readable without colour).

Each function takes a cache and returns a renderable; none mutates the cache.
"""

from __future__ import annotations

from typing import Any

from rich.text import Text
from rich.tree import Tree

from memcli.mem_cache.chunk_cache import ChunkCache
from memcli.mem_cache.null_cache import NullCache
from memcli.mem_cache.radix_cache import RadixCache, TreeNode


def cache_tree(cache: Any, max_nodes: int = 200) -> Tree:
    """The tree of whichever prefix cache `cache` is (radix, chunk or null)."""
    if isinstance(cache, RadixCache):
        return radix_tree(cache, max_nodes)
    if isinstance(cache, NullCache):
        return null_cache_tree(cache)
    if isinstance(cache, ChunkCache):
        return chunk_cache_tree(cache)
    raise TypeError(f"no tree rendering for {type(cache).__name__}")


def radix_tree(cache: RadixCache, max_nodes: int = 200) -> Tree:
    """One line per node (tokens, first ids, lock, hits), depth first, at most `max_nodes`."""
    title = Text(
        f"radix cache  page_size={cache.page_size}  total={cache.total_size()}  "
        f"evictable={cache.evictable_size()}  protected={cache.protected_size()}  nodes={cache.num_nodes}"
    )
    tree = Tree(title)
    shown = 0
    stack = [(child, tree) for child in reversed(list(cache.root.children.values()))]
    while stack and shown < max_nodes:
        node, branch = stack.pop()
        sub = branch.add(Text(node_label(node)))
        shown += 1
        stack.extend((child, sub) for child in reversed(list(node.children.values())))
    if cache.num_nodes > shown:
        tree.add(Text(f"... {cache.num_nodes - shown} more nodes"))
    return tree


def node_label(node: TreeNode) -> str:
    ids = node.key[:10].tolist()
    more = "..." if len(node.key) > 10 else ""
    namespace = f" extra_key={node.extra_key!r}" if node.extra_key is not None else ""
    return f"{len(node.key)} tokens {ids}{more} lock_ref={node.lock_ref} hits={node.hit_count}{namespace}"


def chunk_cache_tree(cache: ChunkCache) -> Tree:
    return Tree(Text(f"chunk cache (no prefix sharing)  page_size={cache.page_size}"))


def null_cache_tree(cache: NullCache) -> Tree:
    return Tree(Text(f"null cache (caches nothing)  page_size={cache.page_size}"))
