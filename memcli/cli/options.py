"""Options, parsing and help text shared by the commands.

Every command is a `MemcliCommand`: its help names each value plainly (`TRACE`, `PATH`, `N`;
no `<bool>` beside a flag, no braces around an argument in the usage line).

List options take several values in any of three forms, mixed freely: `--batch-size 1 8 32`
(values after one flag, as in SGLang's bench_one_batch), `--batch-size 1,8,32` (a comma
list) and `--batch-size 1 --batch-size 8` (a repeated flag). A command opts in with
a `LIST_FLAGS` tuple that `memcli.cli.app` registers it with.

An option whose value may be left out (`replay --check`, `replay --check full`) is an ordinary
option with a value that the command fills in before parsing: a command opts in with an
`OPTIONAL_VALUES` mapping, {flag: its values, the first the one a bare flag means}.
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
EngineOpt: Optional[str] = typer.Option(
    None, "--engine", metavar="NAME",
    help="The engine the stack reproduces (default sglang-0.5.23; sglang-0.5.5, vllm-0.33); the same as --set"
         " semantics.engine=NAME")
JsonOpt: bool = typer.Option(False, "--json", help="Print one JSON document on stdout")


def with_engine(overrides: List[str], engine: Optional[str]) -> List[str]:
    """The `--set` overrides with `--engine NAME` as `semantics.engine=NAME`, last (it wins)."""
    return [*overrides, f"semantics.engine={engine}"] if engine is not None else list(overrides)
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


def expand_optional_values(args: list[str],
                           optional: dict[str, tuple[str, ...]]) -> tuple[list[str], dict[str, str]]:
    """`--check full` -> `--check=full`; a bare `--check` (last, or before any word that is not
    one of its values) -> `--check=incremental`, the first of its values. Returns the
    arguments and {word: flag} for the words that followed such a flag without being one of
    its values (they stay where they are: a positional argument, or a mistyped value)."""
    out: list[str] = []
    strays: dict[str, str] = {}
    i = 0
    while i < len(args):
        arg = args[i]
        if arg == "--":
            return out + args[i:], strays
        if arg in optional:
            values = optional[arg]
            following = args[i + 1] if i + 1 < len(args) else None
            if following in values:
                out.append(f"{arg}={following}")
                i += 2
                continue
            out.append(f"{arg}={values[0]}")
            if following is not None and not following.startswith("-"):
                strays.setdefault(following, arg)
        else:
            out.append(arg)
        i += 1
    return out, strays


class MemcliCommand(TyperCommand):
    """A memcli command: readable help, several values after each flag of `list_flags`, and
    a value that may be left out after each flag of `optional_values`."""

    list_flags: tuple[str, ...] = ()
    optional_values: dict[str, tuple[str, ...]] = {}

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if self.help:
            self.help = reflow(self.help)

    def parse_args(self, ctx, args: list[str]) -> list[str]:
        if self.list_flags:
            args = expand_list_flags(list(args), self.list_flags)
        if not self.optional_values:
            return super().parse_args(ctx, args)
        args, strays = expand_optional_values(list(args), self.optional_values)
        ctx.allow_extra_args = True  # a stray left over: named below, with the flag's values
        rest = super().parse_args(ctx, args)
        ctx.allow_extra_args = False
        if ctx.args:
            self._extra_arguments(ctx, ctx.args, strays)
        return rest

    def _extra_arguments(self, ctx, extra: list[str], strays: dict[str, str]) -> None:
        """Words left over after parsing: a word that followed an optional-value flag is a
        value it does not take (exit 2 naming its values); anything else, click's own error."""
        if extra[0] in strays:
            flag = strays[extra[0]]
            values = self.optional_values[flag]
            raise MemcliError(f'unexpected argument "{extra[0]}"',
                              f"{flag} takes no value or one of: {', '.join(values)} (as in {flag} {values[-1]})")
        ctx.fail(f"Got unexpected extra argument(s) ({' '.join(extra)})")

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


def list_flags_command(list_flags: tuple[str, ...],
                       optional_values: Optional[dict[str, tuple[str, ...]]] = None) -> type[MemcliCommand]:
    """A command class that reads several values after each of `list_flags`, and an
    optional value after each flag of `optional_values`."""
    return type("ListFlagsCommand", (MemcliCommand,),
                {"list_flags": tuple(list_flags), "optional_values": dict(optional_values or {})})


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
