"""`memcli show-config`: the resolved config and the pool sizes derived from it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import List, Optional


from memcli.cli import command
from memcli.commands.options import ConfigOpt, JsonOpt, SetOpt
from memcli.config import load_config
from memcli.report.console import stdout_console
from memcli.report.tables import config_tables



@command("show-config")
def show_config(
    config: Optional[Path] = ConfigOpt,
    set_: List[str] = SetOpt,
    json_out: bool = JsonOpt,
) -> None:
    """Print the resolved config and the sizes derived from it."""
    cfg = load_config(config, set_)
    derived = {
        "pool_size": cfg.pool_size,
        "requested_total_tokens": cfg.requested_total_tokens,
        "bytes_per_token": cfg.model.bytes_per_token,
        "kv_pool_bytes": (cfg.pool_size + cfg.page_size) * cfg.model.bytes_per_token,
        "num_pages": cfg.pool_size // cfg.page_size,
    }
    if json_out:
        print(json.dumps({"config": cfg.to_dict(), "derived": derived}, indent=2))
        return
    console = stdout_console()
    for table in config_tables(cfg, derived):
        console.print(table)
