"""Bad input as `error:` / `hint:` lines and an exit code, for every command."""

from __future__ import annotations

import functools
import os
import sys
from typing import Callable

import typer

from memcli.errors import MemcliError


def report_error(exc: MemcliError) -> None:
    print(f"error: {exc.message}", file=sys.stderr)
    if exc.hint:
        print(f"hint: {exc.hint}", file=sys.stderr)


def guarded(func: Callable) -> Callable:
    """`func` with a `MemcliError` turned into `error:` / `hint:` lines and its exit code
    (2 for bad input), without a traceback unless MEMCLI_DEBUG=1."""

    @functools.wraps(func)
    def wrapper(*args, **kwargs):
        try:
            return func(*args, **kwargs)
        except MemcliError as exc:
            if os.environ.get("MEMCLI_DEBUG") == "1":
                raise
            report_error(exc)
            raise typer.Exit(exc.exit_code) from None

    return wrapper
