"""What a side of a side-by-side run that raised instead of taking its step reports.

Either side's own checks (SGLang's leak check and assertions, memcli's integrity and
progress guards) end the comparison as a finding, not a crash: `RAISED` are the exceptions
taken that way, `raised_at(side, step, exc)` the `failure` text that names the side, the
step, the error and where it was raised. `MEMCLI_DEBUG=1` (`debugging()`) re-raises instead.
"""

from __future__ import annotations

import os
import traceback
from pathlib import Path

RAISED = (AssertionError, RuntimeError, ValueError, IndexError, KeyError, TypeError)


def debugging() -> bool:
    """True under `MEMCLI_DEBUG=1`: a side that raises is re-raised, with its traceback."""
    return os.environ.get("MEMCLI_DEBUG") == "1"


def what_raised(exc: BaseException) -> str:
    """`Type: message (file.py:line, in function)`, the innermost frame of its traceback."""
    where = traceback.extract_tb(exc.__traceback__)[-1]
    return f"{type(exc).__name__}: {exc} ({Path(where.filename).name}:{where.lineno}, in {where.name})"


def raised_at(side: str, step: int, what: str) -> str:
    """`SIDE raised at step N: WHAT`; `what` as `what_raised` gives it."""
    return f"{side} raised at step {step}: {what}"
