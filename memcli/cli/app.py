"""The typer app: every command registered one way, with the shared bad-input handling
(`guard.guarded`: a `MemcliError` becomes `error:` / `hint:` lines and exit code 2)."""

from __future__ import annotations

from typing import Callable

import typer

from memcli.cli import bench_one_batch, bench_radix, check_page_size, diff, gen_trace, reference, replay, show_config
from memcli.cli.guard import GuardedGroup, guarded
from memcli.cli.options import MemcliCommand, list_flags_command

app = typer.Typer(
    name="memcli",
    cls=GuardedGroup,
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
    ("diff", diff.diff_command, ()),
)


@app.callback()
def _root() -> None:
    """Build, exercise and inspect the KV-cache memory stack of an LLM serving engine."""


# Options whose value may be left out, by command: {flag: its values} (`memcli.cli.options`).
OPTIONAL_VALUES: dict[str, dict[str, tuple[str, ...]]] = {"replay": replay.OPTIONAL_VALUES}


def register(name: str, func: Callable, list_flags: tuple[str, ...] = ()) -> None:
    optional = OPTIONAL_VALUES.get(name)
    cls = list_flags_command(list_flags, optional) if list_flags or optional else MemcliCommand
    app.command(name, cls=cls)(guarded(func))


for _name, _func, _list_flags in COMMANDS:
    register(_name, _func, _list_flags)
app.add_typer(reference.app)


def main() -> None:
    app()
