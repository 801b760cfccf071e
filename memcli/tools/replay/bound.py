"""`--bound belady`: the same replay under Belady's offline eviction, the bound beside it."""

from __future__ import annotations

from memcli.config import Config, replace
from memcli.errors import MemcliError


def bound_config(config: Config) -> Config:
    """`config` under `cache.eviction_policy: belady` (itself when already so); `MemcliError`
    when there is no radix cache to evict from."""
    if config.cache.kind != "radix":
        raise MemcliError(f"--bound belady ranks the radix cache's evictions, but cache.kind is {config.cache.kind}",
                          "use --set cache.kind=radix, or leave out --bound")
    if config.cache.eviction_policy == "belady":
        return config
    return replace(config, cache={"eviction_policy": "belady"})
