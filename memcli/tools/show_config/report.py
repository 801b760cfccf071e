"""The resolved config and the pool sizes derived from it, as a JSON document or tables."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table

from memcli.report.envelope import envelope
from memcli.report.tables import kv_table
from memcli.tools.show_config.results import ShowConfigResult


def show_config_document(result: ShowConfigResult) -> dict[str, Any]:
    """The document; `baseline` only for an engine with an earlier release (`Engine.baseline`)."""
    fields: dict[str, Any] = {"semantics_in_force": result.semantics_in_force}
    if result.baseline:
        fields["baseline"] = {"engine": result.baseline, "differs": result.baseline_differs}
    return envelope("show-config", {**fields, "derived": result.derived}, result.config)


def render(result: ShowConfigResult, console: Console) -> None:
    cfg = result.config
    if result.engine:
        console.print(f"engine {result.engine}")
    for section, values in cfg.to_dict().items():
        if section != "semantics":
            console.print(kv_table(section, ((f"{section}.{k}", v) for k, v in values.items())))
    overrides = cfg.semantics.overrides()
    rows = [(f"semantics.{k}", f"{v} (set)" if k in overrides else v) for k, v in result.semantics_in_force.items()]
    title = f"semantics in force: {result.label or cfg.semantics.label}"
    if not result.baseline:
        console.print(kv_table(title, rows))
    else:
        console.print(_with_baseline(title, rows, result))
    console.print(kv_table("derived sizes", result.derived.items()))


def _with_baseline(title: str, rows: list, result: ShowConfigResult) -> Table:
    """The behaviours in force, with the baseline engine's value where it differs."""
    table = Table(title=f"{title} (beside {result.baseline} where it differs)", title_justify="left")
    for header in ("key", "value", result.baseline):
        table.add_column(header, justify="left" if header == "key" else "right")
    for key, value in rows:
        table.add_row(key, value, result.baseline_differs.get(key.split(".", 1)[1], ""))
    return table
