"""KV cache events, one per page, for routers that mirror what a cache holds.

A page's hash covers its tokens, the namespace (`extra_key`) and the hash of the page
before it in the sequence (also across tree nodes), so equal pages at different
positions or after different prefixes get different hashes. Hashes are stable across
processes (blake2b, not Python's salted `hash`). Splitting a tree node changes no page,
so it emits nothing.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Optional, Union

import numpy as np


@dataclass(frozen=True)
class BlockStored:
    """One page entered the cache. `parent_block_hash` is None for a sequence's first page."""

    block_hashes: tuple[int, ...]
    parent_block_hash: Optional[int]
    token_ids: tuple[int, ...]
    block_size: int
    extra_key: Optional[str] = None


@dataclass(frozen=True)
class BlockRemoved:
    """Pages left the cache (evicted)."""

    block_hashes: tuple[int, ...]


@dataclass(frozen=True)
class AllBlocksCleared:
    """The cache was reset: every page is gone."""


@dataclass(frozen=True)
class VllmBlockStored:
    """vLLM's `BlockStored`: full blocks entered the cache (hashes: vLLM's 32-byte block hashes)."""

    block_hashes: list
    parent_block_hash: Optional[bytes]
    token_ids: list
    block_size: int
    medium: Optional[str]
    extra_keys: Optional[list] = None


@dataclass(frozen=True)
class VllmBlockRemoved:
    """vLLM's `BlockRemoved`: a cached block was evicted when its block was reused."""

    block_hashes: list
    medium: Optional[str]


@dataclass(frozen=True)
class VllmAllBlocksCleared:
    """vLLM's `AllBlocksCleared` (`reset_prefix_cache`)."""


KVEvent = Union[BlockStored, BlockRemoved, AllBlocksCleared, VllmBlockStored, VllmBlockRemoved, VllmAllBlocksCleared]


def page_hash(parent_hash: Optional[int], extra_key: Optional[str], page_tokens: np.ndarray) -> int:
    """Unsigned 64-bit hash of one page chained to the page before it."""
    digest = hashlib.blake2b(digest_size=8)
    digest.update(b"\x00" if parent_hash is None else b"\x01" + parent_hash.to_bytes(8, "little"))
    if extra_key is not None:
        namespace = extra_key.encode()
        digest.update(len(namespace).to_bytes(4, "little") + namespace)
    digest.update(np.ascontiguousarray(page_tokens, dtype=np.int64).tobytes())
    return int.from_bytes(digest.digest(), "little")


def chain_page_hashes(
    parent_hash: Optional[int], extra_key: Optional[str], tokens: np.ndarray, page_size: int
) -> list[int]:
    """Hashes of the consecutive pages of `tokens`, the first chained to `parent_hash`."""
    hashes = []
    for start in range(0, len(tokens), page_size):
        parent_hash = page_hash(parent_hash, extra_key, tokens[start : start + page_size])
        hashes.append(parent_hash)
    return hashes


def stored_events(
    parent_hash: Optional[int], extra_key: Optional[str], tokens: np.ndarray, hashes: list[int], page_size: int
) -> list[BlockStored]:
    """One `BlockStored` per page of `tokens` (whose hashes are `hashes`)."""
    events = []
    for i, block_hash in enumerate(hashes):
        page = tokens[i * page_size : (i + 1) * page_size]
        events.append(BlockStored((block_hash,), parent_hash, tuple(page.tolist()), len(page), extra_key))
        parent_hash = block_hash
    return events
