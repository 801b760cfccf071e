"""Options and parsing shared by the commands.

List options take several values in any of three forms, mixed freely: `--batch-size 1 8 32`
(values after one flag, as in SGLang's bench_one_batch), `--batch-size 1,8,32` (a comma
list) and `--batch-size 1 --batch-size 8` (a repeated flag). A command opts in with
a `LIST_FLAGS` tuple that `memcli.cli.app` registers it with.
"""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer
from typer.core import TyperCommand

from memcli.errors import MemcliError

ConfigOpt: Optional[Path] = typer.Option(None, "--config", "-c", help="YAML config (default: the built-in default)")
SetOpt: List[str] = typer.Option([], "--set", "-s", help="Override a key: section.key=value (repeatable)")
JsonOpt: bool = typer.Option(False, "--json", help="Print one JSON document")
LIST_METAVAR = "N[,N...]"


def expand_list_flags(args: list[str], list_flags: tuple[str, ...]) -> list[str]:
    """`--batch-size 1 8 32` -> `--batch-size 1 --batch-size 8 --batch-size 32`.

    The command has no positional arguments, so every bare word after a list flag (or after
    `--list-flag=value`) is one more of its values; other words are left to the parser.
    """
    out: list[str] = []
    flag, has_value = None, False
    for i, arg in enumerate(args):
        if arg == "--":
            return out + args[i:]
        if arg.startswith("-"):
            name = arg.split("=", 1)[0]
            flag = name if name in list_flags else None
            has_value = "=" in arg
            out.append(arg)
        elif flag is not None:
            out += [flag, arg] if has_value else [arg]
            has_value = True
        else:
            out.append(arg)
    return out


def list_flags_command(list_flags: tuple[str, ...]) -> type[TyperCommand]:
    """A typer command class that reads several values after each of `list_flags`."""

    class ListFlagsCommand(TyperCommand):
        def parse_args(self, ctx, args: list[str]) -> list[str]:
            return super().parse_args(ctx, expand_list_flags(list(args), list_flags))

    return ListFlagsCommand


def parse_ints(option: str, values: Optional[List[str]], default: Optional[list[int]]) -> Optional[list[int]]:
    """Integers from repeated flags, each possibly a comma or space separated list."""
    if not values:
        return default
    out = []
    for value in values:
        for word in value.replace(",", " ").split():
            try:
                out.append(int(word))
            except ValueError:
                raise MemcliError(f"{option} {word!r}: not an integer",
                                  hint=f"for example {option} 1,8,32 or {option} 1 8 32") from None
    if not out:
        raise MemcliError(f"{option}: no value given", hint=f"for example {option} 1,8,32")
    return out
