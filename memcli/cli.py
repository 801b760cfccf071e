"""The `memcli` command line: thin typer commands over functions that return results.

Every command is registered through `command()`, which turns a `MemcliError` (bad input)
into `error:` / `hint:` lines on stderr and exit code 2, without a traceback unless
MEMCLI_DEBUG=1.
"""

from __future__ import annotations

import functools
import os
import sys
from typing import Callable

import typer

from memcli.errors import MemcliError

app = typer.Typer(
    name="memcli",
    help="Build, exercise and inspect the KV-cache memory stack of an LLM serving engine.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)


@app.callback()
def _root() -> None:
    """Build, exercise and inspect the KV-cache memory stack of an LLM serving engine."""


def report_error(exc: MemcliError) -> None:
    print(f"error: {exc.message}", file=sys.stderr)
    if exc.hint:
        print(f"hint: {exc.hint}", file=sys.stderr)


def command(name: str, list_flags: tuple[str, ...] = ()) -> Callable[[Callable], Callable]:
    """Register a command on `app` with the shared bad-input handling.

    `list_flags` name options that take several values after one flag (`--page-size 1 16`).
    """

    def decorate(func: Callable) -> Callable:
        @functools.wraps(func)
        def wrapper(*args, **kwargs):
            try:
                return func(*args, **kwargs)
            except MemcliError as exc:
                if os.environ.get("MEMCLI_DEBUG") == "1":
                    raise
                report_error(exc)
                raise typer.Exit(exc.exit_code) from None

        if list_flags:
            from memcli.commands.options import list_flags_command

            return app.command(name, cls=list_flags_command(list_flags))(wrapper)
        return app.command(name)(wrapper)

    return decorate


# Importing a command module registers its command.
from memcli.commands import bench_one_batch, bench_radix, check_page_size, gen_trace, replay, show_config  # noqa: E402,F401


def main() -> None:
    app()
