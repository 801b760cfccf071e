"""`show-config` as a function: the config resolved, its semantics in force and derived sizes."""

from __future__ import annotations

import dataclasses

from memcli.config import Config, engine_reads, host_pool_size
from memcli.tools.show_config.results import ShowConfigResult


def run_show_config(cfg: Config) -> ShowConfigResult:
    """The config as resolved; raises `ConfigError` when it names an unknown engine."""
    from memcli import engines

    engine = engines.get(cfg)
    if engine.describe is not None:
        behaviours, sizes = engine.describe(cfg)
        return ShowConfigResult(cfg, behaviours, sizes, engine.name)
    return ShowConfigResult(cfg, in_force(cfg), derived_sizes(cfg))


def derived_sizes(cfg: Config) -> dict[str, int]:
    """The pool sizes in tokens, pages and bytes (and the host pool's under hiradix)."""
    sizes = {
        "pool_size": cfg.pool_size,
        "requested_total_tokens": cfg.requested_total_tokens,
        "bytes_per_token": cfg.model.bytes_per_token,
        "kv_pool_bytes": (cfg.pool_size + cfg.page_size) * cfg.model.bytes_per_token,
        "num_pages": cfg.pool_size // cfg.page_size,
    }
    if cfg.cache.kind == "hiradix":
        host = host_pool_size(cfg)
        sizes.update(host_pool_size=host, host_pool_bytes=host * cfg.model.bytes_per_token)
    return sizes


def in_force(cfg: Config) -> dict[str, str]:
    """Every semantics behaviour the engine reads, with its value in force: the profile's, or the override."""
    engine = cfg.semantics.engine
    return {k: v for k, v in dataclasses.asdict(cfg.behaviour).items() if engine_reads(k, engine)}
