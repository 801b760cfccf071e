"""Consoles: data to stdout, progress and diagnostics to stderr. NO_COLOR is honoured by rich."""

from __future__ import annotations

import json
import sys
from typing import Any

from rich.console import Console


def stdout_console() -> Console:
    return Console(file=sys.stdout, soft_wrap=False, width=None if sys.stdout.isatty() else 120)


def stderr_console() -> Console:
    return Console(file=sys.stderr, soft_wrap=False)


def print_json(document: Any) -> None:
    """Exactly one JSON document on stdout."""
    sys.stdout.write(json.dumps(document, indent=2, default=_jsonable) + "\n")


def _jsonable(value: Any) -> Any:
    if hasattr(value, "item"):
        return value.item()
    if hasattr(value, "tolist"):
        return value.tolist()
    if hasattr(value, "__dataclass_fields__"):
        import dataclasses

        return dataclasses.asdict(value)
    raise TypeError(f"not JSON serialisable: {type(value).__name__}")
