"""Bad input as `error:` / `hint:` lines and an exit code, for every command and for the
command line itself (usage errors, Ctrl-C, and, as a last resort, bugs).

Exit codes: 0 ok, 1 a check found a problem (or an internal error), 2 bad input or usage,
130 interrupted. `MEMCLI_DEBUG=1` re-raises instead, with the traceback.
"""

from __future__ import annotations

import errno
import functools
import os
import sys
from typing import Any, Callable

import typer

from memcli.cli.options import MemcliGroup
from memcli.errors import MemcliError

try:  # typer >= 0.25 vendors click
    from typer._click import exceptions as click_exceptions
except ImportError:  # pragma: no cover - older typer
    from click import exceptions as click_exceptions

INTERRUPTED = 130
CONFIG_FLAGS = ("--config", "-c", "--set", "-s")
CONFIG_COMMANDS = "show-config, bench-one-batch, check-page-size, replay and reference diff"
INTERNAL_ERROR = "internal error"


def debugging() -> bool:
    return os.environ.get("MEMCLI_DEBUG") == "1"


def report_error(exc: MemcliError) -> None:
    print(exc.lines(), file=sys.stderr)


def note_ignored(ignored: dict[str, str], command: str) -> None:
    """One `note:` line on stderr per key the command does not read."""
    for key, why in ignored.items():
        print(f"note: {key} is ignored by {command}: {why}", file=sys.stderr)


class Interrupted(Exception):
    """Ctrl-C, after the command said where it stopped (`line`, printed once)."""

    def __init__(self, line: str):
        super().__init__(line)
        self.line = line


def guarded(func: Callable) -> Callable:
    """`func` with a `MemcliError` turned into `error:` / `hint:` lines and its exit code
    (2 for bad input), and Ctrl-C into one `interrupted` line and exit 130; without a
    traceback unless MEMCLI_DEBUG=1."""

    @functools.wraps(func)
    def wrapper(*args, **kwargs):
        try:
            return func(*args, **kwargs)
        except MemcliError as exc:
            if debugging():
                raise
            report_error(exc)
            raise typer.Exit(exc.exit_code) from None
        except Interrupted as exc:
            print(exc.line, file=sys.stderr)
            raise typer.Exit(INTERRUPTED) from None
        except KeyboardInterrupt:
            print("interrupted", file=sys.stderr)
            raise typer.Exit(INTERRUPTED) from None

    return wrapper


class GuardedGroup(MemcliGroup):
    """The root command: click's own usage errors become `error:` / `hint:` lines (exit 2)
    instead of a framed box, and an unexpected exception one `error: internal error` line
    (exit 1), so no input ends in a traceback. `--help` is untouched."""

    def main(self, args: Any = None, prog_name: str | None = None, complete_var: str | None = None,
             standalone_mode: bool = True, **extra: Any) -> Any:
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        code = run_guarded(lambda: super(GuardedGroup, self).main(args, prog_name, complete_var,
                                                                   standalone_mode=False, **extra))
        sys.exit(code)


def run_guarded(call: Callable[[], Any]) -> int:
    """Run a click main in non-standalone mode; return the exit code, reporting any error."""
    try:
        rv = call()
        return rv if isinstance(rv, int) else 0
    except click_exceptions.NoArgsIsHelpError as exc:
        print(exc.ctx.get_help())
        return 2
    except click_exceptions.UsageError as exc:
        command = exc.ctx.command_path if exc.ctx is not None else "memcli"
        print(f"error: {exc.format_message()}", file=sys.stderr)
        if getattr(exc, "option_name", None) in CONFIG_FLAGS:
            print(f"hint: {command} reads no config; {CONFIG_COMMANDS} do. Its options are all it uses:"
                  f" run '{command} --help'", file=sys.stderr)
        else:
            print(f"hint: run '{command} --help' for the commands and options", file=sys.stderr)
        return 2
    except click_exceptions.ClickException as exc:
        print(f"error: {exc.format_message()}", file=sys.stderr)
        return 2
    except (typer.Abort, KeyboardInterrupt, EOFError):  # typer.Abort: click's Abort, or typer's own (>= 0.29)
        print("interrupted", file=sys.stderr)
        return INTERRUPTED
    except MemcliError as exc:
        if debugging():
            raise
        report_error(exc)
        return exc.exit_code
    except OSError as exc:
        if exc.errno == errno.EPIPE:  # the reader went away (`memcli ... | head`)
            return 1
        return _internal(exc)
    except Exception as exc:  # noqa: BLE001 - the last resort: no traceback for the user
        return _internal(exc)


def _internal(exc: Exception) -> int:
    if debugging():
        raise exc
    print(f"error: {INTERNAL_ERROR}: {type(exc).__name__}: {exc}", file=sys.stderr)
    print("hint: this is a bug in memcli; rerun with MEMCLI_DEBUG=1 for the traceback and report it",
          file=sys.stderr)
    return 1
