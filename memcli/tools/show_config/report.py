"""The resolved config and the pool sizes derived from it."""

from __future__ import annotations

import dataclasses
from typing import Any

from rich.console import Console

from memcli.config import Config, host_pool_size
from memcli.report.envelope import envelope
from memcli.report.tables import kv_table


def derived_sizes(cfg: Config) -> dict[str, int]:
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
    """Every semantics behaviour's value in force: the profile's, or the override."""
    return dataclasses.asdict(cfg.behaviour)


def show_config_document(cfg: Config) -> dict[str, Any]:
    return envelope("show-config", {"semantics_in_force": in_force(cfg), "derived": derived_sizes(cfg)}, cfg)


def render(cfg: Config, console: Console) -> None:
    for section, values in cfg.to_dict().items():
        if section != "semantics":
            console.print(kv_table(section, ((f"{section}.{k}", v) for k, v in values.items())))
    overrides = cfg.semantics.overrides()
    rows = [(f"semantics.{k}", f"{v} (set)" if k in overrides else v) for k, v in in_force(cfg).items()]
    console.print(kv_table(f"semantics in force: {cfg.semantics.label}", rows))
    console.print(kv_table("derived sizes", derived_sizes(cfg).items()))
