"""Errors that reach the user as `error:` / `hint:` lines with exit code 2.

Anything raised as a `MemcliError` is bad input or an impossible request: the CLI prints
it without a traceback. Other exceptions are bugs and keep their traceback.
"""

from __future__ import annotations


class MemcliError(Exception):
    """Bad input. `hint` says how to fix it."""

    exit_code = 2

    def __init__(self, message: str, hint: str | None = None):
        super().__init__(message)
        self.message = message
        self.hint = hint

    def lines(self) -> str:
        """What the user reads: the `error:` line, then the `hint:` line when there is one."""
        return f"error: {self.message}" + (f"\nhint: {self.hint}" if self.hint else "")


class ConfigError(MemcliError):
    """A config key is unknown, has the wrong type, or describes an impossible stack."""


class TraceError(MemcliError):
    """A trace file cannot be read; the message names the file and line."""


class CapacityError(MemcliError):
    """A requested run cannot fit in the configured pools (checked before it starts)."""


class OutOfMemoryError(RuntimeError):
    """An allocation failed at run time even after evicting what could be evicted.

    Not a `MemcliError`: raised inside the stack, handled (retraction, skipping a batch)
    or reported by the commands. The message carries every number.
    """

    def __init__(self, what: str, need_tokens: int, available: int, evictable: int, protected: int):
        self.need_tokens = need_tokens
        self.available = available
        self.evictable = evictable
        self.protected = protected
        super().__init__(
            f"{what} out of memory: need {need_tokens} tokens, available {available}"
            f" + evictable {evictable}, protected {protected}"
        )


class RequestSlotsExhausted(RuntimeError):
    """No free row in req_to_token; raise max_running_requests."""


class IntegrityError(RuntimeError):
    """An invariant of the memory stack is broken; the message carries the numbers."""


class StalledError(RuntimeError):
    """The scheduler stopped making progress (the clock is not finite or went back, or no
    request advanced for a bounded number of steps); the message names the step, the clock
    and the queues and pool. A replay reports it and exits 1."""
