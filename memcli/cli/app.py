"""The typer app: every command registered one way, with the shared bad-input handling.

A `MemcliError` (bad input) becomes `error:` / `hint:` lines on stderr and its exit code
(2), without a traceback unless MEMCLI_DEBUG=1.
"""

from __future__ import annotations

import functools
import os
import sys
from typing import Callable

import typer

from memcli.cli import bench_one_batch, bench_radix, check_page_size, gen_trace, replay, show_config
from memcli.cli.options import list_flags_command
from memcli.errors import MemcliError

app = typer.Typer(
    name="memcli",
    help="Build, exercise and inspect the KV-cache memory stack of an LLM serving engine.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)

# (name, typer function, options that take several values after one flag)
COMMANDS: tuple[tuple[str, Callable, tuple[str, ...]], ...] = (
    ("show-config", show_config.show_config, ()),
    ("bench-one-batch", bench_one_batch.bench_one_batch, bench_one_batch.LIST_FLAGS),
    ("check-page-size", check_page_size.check_page_size, check_page_size.LIST_FLAGS),
    ("gen-trace", gen_trace.gen_trace, ()),
    ("replay", replay.replay_command, ()),
    ("bench-radix", bench_radix.bench_radix, ()),
)


@app.callback()
def _root() -> None:
    """Build, exercise and inspect the KV-cache memory stack of an LLM serving engine."""


def report_error(exc: MemcliError) -> None:
    print(f"error: {exc.message}", file=sys.stderr)
    if exc.hint:
        print(f"hint: {exc.hint}", file=sys.stderr)


def guarded(func: Callable) -> Callable:
    """`func` with a `MemcliError` turned into `error:` / `hint:` lines and its exit code."""

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


def register(name: str, func: Callable, list_flags: tuple[str, ...] = ()) -> None:
    cls = list_flags_command(list_flags) if list_flags else None
    app.command(name, cls=cls)(guarded(func))


for _name, _func, _list_flags in COMMANDS:
    register(_name, _func, _list_flags)


def main() -> None:
    app()
