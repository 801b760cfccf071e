"""Small rich-table builders shared by the tools' reports."""

from __future__ import annotations

from typing import Any, Iterable

from rich.table import Table


def kv_table(title: str, rows: Iterable[tuple[str, Any]], key_header: str = "key", value_header: str = "value") -> Table:
    table = Table(title=title, title_justify="left")
    table.add_column(key_header)
    table.add_column(value_header, justify="right")
    for key, value in rows:
        table.add_row(key, fmt(value))
    return table


def fmt(value: Any) -> str:
    if isinstance(value, bool) or value is None:
        return str(value).lower() if value is not None else "-"
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        return f"{value:,.4g}" if abs(value) < 1000 else f"{value:,.1f}"
    return str(value)
