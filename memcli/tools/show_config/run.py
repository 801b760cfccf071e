"""`show-config` as a function: the config resolved, its semantics in force and derived sizes."""

from __future__ import annotations

import dataclasses

from memcli.config import PROFILE_CHOICES, Config, engine_reads, host_pool_size
from memcli.tools.show_config.results import ShowConfigResult


def run_show_config(cfg: Config) -> ShowConfigResult:
    """The config as resolved; raises `ConfigError` when it names an unknown engine."""
    from memcli import engines

    engine = engines.get(cfg)
    title = f"{engine.name}: {engine.summary}"
    if engine.describe is not None:
        behaviours, sizes = engine.describe(cfg)
        return ShowConfigResult(cfg, behaviours, sizes, engine.name, title)
    behaviours = in_force(cfg)
    if engine.baseline is None:
        return ShowConfigResult(cfg, behaviours, derived_sizes(cfg), engine=title)
    return ShowConfigResult(cfg, behaviours, derived_sizes(cfg), engine=title, baseline=engine.baseline,
                            baseline_differs=differing(behaviours, engines.get(engine.baseline)))


def differing(behaviours: dict[str, str], baseline) -> dict[str, str]:
    """{key: the value under `baseline` (an `Engine`)} for each behaviour whose value in force is
    another: the engine and its profile, and every key where the baseline's profile differs or
    an override moved the value."""
    own = {"engine": baseline.name, "profile": baseline.profile}
    theirs = {key: own.get(key) or PROFILE_CHOICES[key][baseline.profile] for key in behaviours}
    return {key: value for key, value in theirs.items() if value != behaviours[key]}


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
