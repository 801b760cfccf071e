"""Options, parsing and help text shared by the commands.

Every command is a `MemcliCommand`: its help names each value plainly (`TRACE`, `PATH`, `N`;
no `<bool>` beside a flag, no braces around an argument in the usage line).

List options take several values in any of three forms, mixed freely: `--batch-size 1 8 32`
(values after one flag, as in SGLang's bench_one_batch), `--batch-size 1,8,32` (a comma
list) and `--batch-size 1 --batch-size 8` (a repeated flag). A command opts in with
a `LIST_FLAGS` tuple that `memcli.cli.app` registers it with.
"""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import List, Optional

import typer
from typer.core import TyperArgument, TyperCommand, TyperGroup

from memcli.errors import MemcliError

ConfigOpt: Optional[Path] = typer.Option(None, "--config", "-c", metavar="FILE",
                                         help="YAML config (default: the built-in default)")
ReplayConfigOpt: Optional[Path] = typer.Option(None, "--config", "-c", metavar="FILE",
                                               help="YAML config (default: the built-in replay config)")
SetOpt: List[str] = typer.Option([], "--set", "-s", metavar="KEY=VALUE",
                                 help="Override a config key, section.key=value (repeatable)")
JsonOpt: bool = typer.Option(False, "--json", help="Print one JSON document on stdout")
ProgressOpt: bool = typer.Option(False, "--progress",
                                 help="Show progress on stderr even when it is not a terminal")
LIST_METAVAR = "N[,N...]"
# The value's name in help text, by Python type, for options defined without a metavar.
TYPE_METAVARS = {"int": "N", "float": "X", "Path": "PATH", "str": "TEXT"}


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


class MemcliCommand(TyperCommand):
    """A memcli command: readable help, and several values after each flag of `list_flags`."""

    list_flags: tuple[str, ...] = ()

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if self.help:
            self.help = reflow(self.help)

    def parse_args(self, ctx, args: list[str]) -> list[str]:
        if self.list_flags:
            args = expand_list_flags(list(args), self.list_flags)
        return super().parse_args(ctx, args)

    def get_params(self, ctx) -> list:
        params = super().get_params(ctx)
        for param in params:
            _readable_metavar(param)
        return params

    def collect_usage_pieces(self, ctx) -> list[str]:
        pieces = [self.options_metavar] if self.options_metavar else []
        for param in self.get_params(ctx):
            if isinstance(param, TyperArgument):
                name = param.metavar or param.name.upper()
                name = name if param.required else f"[{name}]"
                pieces.append(name + ("..." if param.nargs != 1 else ""))
            else:
                pieces.extend(param.get_usage_pieces(ctx))
        return pieces


class MemcliGroup(TyperGroup):
    """A group of memcli commands (the root, `reference`): its own options read like a command's."""

    def get_params(self, ctx) -> list:
        params = super().get_params(ctx)
        for param in params:
            _readable_metavar(param)
        return params


def reflow(text: str) -> str:
    """Each paragraph of a docstring on one line (the help panel wraps it to the terminal)."""
    return "\n\n".join(" ".join(paragraph.split()) for paragraph in inspect.cleandoc(text).split("\n\n"))


def _readable_metavar(param) -> None:
    """A flag shows no value type; an option without a metavar gets one from its type; an
    argument shows its name (TRACE, PATH) and no type beside it."""
    if isinstance(param, TyperArgument):
        param.display_type_rich = lambda ctx: None  # the name column already says what it is
        return
    if param.metavar is not None:
        return
    if getattr(param, "is_flag", False) or getattr(param, "count", False):
        param.metavar = ""
    else:
        name = _type_name(param)
        param.metavar = TYPE_METAVARS.get(name, name.upper())


# click's type names, for a typer that builds its options on click (before 0.29).
_CLICK_TYPE_NAMES = {"integer": "int", "float": "float", "text": "str", "path": "Path"}


def _type_name(param) -> str:
    """The option's value type as typer names it (`int`, `float`, `Path`, `str`), whatever
    typer's version: typer 0.29 asks the parameter itself, earlier ones its click type."""
    bare = getattr(param, "bare_type", None)
    if callable(bare):
        return bare()
    name = getattr(getattr(param, "type", None), "name", "") or "value"
    return _CLICK_TYPE_NAMES.get(name, name)


def list_flags_command(list_flags: tuple[str, ...]) -> type[MemcliCommand]:
    """A command class that reads several values after each of `list_flags`."""
    return type("ListFlagsCommand", (MemcliCommand,), {"list_flags": tuple(list_flags)})


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
