"""Drive SGLang 0.5.23's real code from a memcli process: one worker process, JSON lines.

    with Worker0523() as worker:
        worker.call("info")
        worker.call("ops", ops=[...], page_size=16, core="rust")

`unavailable_reason_0523()` is None when the wheel is ready for this Python, else why not
(tests skip with it).
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from typing import Any, Optional

from memcli.errors import MemcliError
from memcli.reference.fetch import SGLANG_0523, unavailable_reason


class WorkerError(MemcliError):
    """The 0.5.23 worker failed a task (its message and the tail of its traceback)."""


def unavailable_reason_0523() -> Optional[str]:
    """Why the 0.5.23 reference cannot run here (no cp311, no index, no msgspec), or None."""
    reason = unavailable_reason(wheel=SGLANG_0523)
    if reason is None and importlib.util.find_spec("msgspec") is None:
        reason = f"msgspec is not installed (SGLang {SGLANG_0523} builds on it): pip install -e '.[test]'"
    return reason


class Worker0523:
    """A `python -m memcli.reference.v0523.worker` child; `call` sends a task and waits."""

    def __init__(self) -> None:
        self.proc: Optional[subprocess.Popen] = None

    def __enter__(self) -> "Worker0523":
        self.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def start(self) -> None:
        if self.proc is None:
            self.proc = subprocess.Popen([sys.executable, "-m", "memcli.reference.v0523.worker"],
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1)

    def call(self, task: str, **args: Any) -> Any:
        self.start()
        assert self.proc is not None and self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps({"task": task, "args": args}) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise WorkerError(f"the SGLang {SGLANG_0523} worker exited (status {self.proc.poll()})",
                              hint="run python -m memcli.reference.v0523.worker by hand to see its error")
        answer = json.loads(line)
        if "error" in answer:
            raise WorkerError(f"{task}: {answer['error']}", hint=answer.get("trace", "").strip().splitlines()[-1:] and
                              "the worker's traceback ends: " + answer["trace"].strip().splitlines()[-1])
        return answer["ok"]

    def close(self) -> None:
        if self.proc is not None:
            if self.proc.stdin:
                self.proc.stdin.close()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:  # its answers are all in; a slow teardown is not waited for
                self.proc.kill()
                self.proc.wait()
            self.proc = None
