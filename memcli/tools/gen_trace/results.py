"""What `gen-trace` wrote: the file, its size, the options that made it and what it holds."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class GenTraceResult:
    """`unchanged`: the file already held this very trace and was not written again."""

    out: Path
    num_bytes: int
    params: dict[str, Any]
    stats: dict[str, Any]
    unchanged: bool = False
