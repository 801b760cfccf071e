"""Rich trees of the prefix caches: readable without colour."""

from pathlib import Path

from rich.console import Console

import memcli.mem_cache
from memcli.mem_cache.base_prefix_cache import RadixKey
from memcli.mem_cache.chunk_cache import ChunkCache
from memcli.mem_cache.null_cache import NullCache
from memcli.mem_cache.radix_cache import RadixCache
from memcli.report.trees import cache_tree
from tests.mem_cache.fakes import Harness


def test_radix_tree_renders_without_colour():
    cache = RadixCache(None, None, page_size=1)
    cache.insert(RadixKey(list(range(12))), None)
    cache.insert(RadixKey([0, 1, 99], "lora"))
    node = cache.match_prefix(RadixKey(list(range(12)))).last_node
    cache.inc_lock_ref(node)
    console = Console(no_color=True, width=120, record=True, file=open("/dev/null", "w"))
    console.print(cache_tree(cache))
    text = console.export_text()
    assert "radix cache  page_size=1  total=15  evictable=3  protected=12  nodes=2" in text
    assert "12 tokens [0, 1, 2, 3, 4, 5, 6, 7, 8, 9]... lock_ref=1 hits=1" in text
    assert "extra_key='lora'" in text
    small = Console(no_color=True, width=120, record=True, file=open("/dev/null", "w"))
    small.print(cache_tree(cache, max_nodes=1))
    assert "... 1 more nodes" in small.export_text()


def test_chunk_cache_tree():
    h = Harness(ChunkCache, page_size=4)
    console = Console(no_color=True, record=True, width=100, file=open("/dev/null", "w"))
    console.print(cache_tree(h.cache))
    assert "chunk cache (no prefix sharing)  page_size=4" in console.export_text()


def test_null_cache_tree_renders_without_colour():
    cache = Harness(NullCache, page_size=8).cache
    console = Console(no_color=True, record=True, width=100, file=open("/dev/null", "w"))
    console.print(cache_tree(cache))
    assert "null cache (caches nothing)  page_size=8" in console.export_text()


def test_mem_cache_renders_nothing():
    """Rendering lives in memcli/report: no module of memcli.mem_cache imports rich."""
    root = Path(memcli.mem_cache.__file__).parent
    for path in root.rglob("*.py"):
        text = path.read_text()
        assert "import rich" not in text and "from rich" not in text, path
