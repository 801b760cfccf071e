"""The resolved config and the pool sizes derived from it, as a JSON document or tables."""

from __future__ import annotations

from typing import Any

from rich.console import Console

from memcli.report.envelope import envelope
from memcli.report.tables import kv_table
from memcli.tools.show_config.results import ShowConfigResult


def show_config_document(result: ShowConfigResult) -> dict[str, Any]:
    return envelope("show-config", {"semantics_in_force": result.semantics_in_force, "derived": result.derived},
                    result.config)


def render(result: ShowConfigResult, console: Console) -> None:
    cfg = result.config
    for section, values in cfg.to_dict().items():
        if section != "semantics":
            console.print(kv_table(section, ((f"{section}.{k}", v) for k, v in values.items())))
    overrides = cfg.semantics.overrides()
    rows = [(f"semantics.{k}", f"{v} (set)" if k in overrides else v) for k, v in result.semantics_in_force.items()]
    console.print(kv_table(f"semantics in force: {result.label or cfg.semantics.label}", rows))
    console.print(kv_table("derived sizes", result.derived.items()))
