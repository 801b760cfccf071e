"""Operation-level differential against SGLang 0.5.23's UnifiedRadixCache, on both tree cores:
memcli's radix cache under the sglang-0.5.23 profile gives the same results, frees, sizes,
free lists (and, on the Python core, the same tree and leaf order) after every operation."""

import pytest

from memcli.config import SemanticsConfig
from memcli.reference.ops import generate_ops
from memcli.reference.v0523.diffops import find_divergence_0523, run_ops_0523


@pytest.mark.parametrize("core", ["rust", "python"])
@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_random_operations_match(worker0523, core, page_size, policy):
    for seed in range(6):
        divergence = find_divergence_0523(worker0523, seed, page_size, policy, 60, core)
        assert divergence is None, f"seed {seed}: {divergence}"


@pytest.mark.parametrize("override, policy", [
    ({"tree_stamps": "radix"}, "lfu"),  # 0.5.5's split: a new upper node without the hits
    ({"lfu_hits": "never"}, "lfu"),  # 0.5.5's never-counted hits
    ({"lfu_hits": "count"}, "lfu"),  # memcli's per-match count
    ({"free_order": "sorted"}, "lru"),  # 0.5.5's sorted paged frees
])
def test_each_tree_key_is_needed(worker0523, override, policy):
    semantics = SemanticsConfig(engine="sglang-0.5.23", profile="sglang-0.5.23", **override)
    found = [run_ops_0523(worker0523, generate_ops(seed, page_size, 60), page_size, policy, "python",
                          semantics=semantics) for page_size in (1, 4) for seed in range(10)]
    assert any(d is not None for d in found), f"{override}: no sequence tells it from 0.5.23"
