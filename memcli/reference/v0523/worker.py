"""The process that runs SGLang 0.5.23's real code for memcli (`python -m memcli.reference.v0523.worker`).

Reads one JSON request per line on stdin, `{"task": NAME, "args": {...}}`, and answers one
JSON line on stdout: `{"ok": RESULT}` or `{"error": MESSAGE}`. Tasks (`TASKS`) import their
module lazily; the reference is loaded once, on the first request.
"""

from __future__ import annotations

import json
import sys
import traceback
from typing import Any, Callable

from memcli.reference.v0523.loader import load_reference_0523


def _info(ref: Any, **_: Any) -> dict:
    from memcli.reference.v0523.stack import CORES, build_stack_0523, tree_core_name

    cores = {core: tree_core_name(build_stack_0523(ref, 64, 1, core)) for core in CORES}
    classes = {name: getattr(ref, name).__module__ for name in
               ("UnifiedRadixCache", "TokenToKVPoolAllocator", "PagedTokenToKVPoolAllocator", "ReqToTokenPool",
                "Req", "ScheduleBatch", "PrefillAdder")}
    return {"cores": cores, "classes": classes, "allocation": ref.allocation.__name__,
            "standins": sorted(ref.standins), "stubbed": list(ref.stubbed)}


def _ops(ref: Any, **args: Any) -> Any:
    from memcli.reference.v0523.ops import run_reference_ops

    return run_reference_ops(ref, **args)


def _replay(ref: Any, **args: Any) -> Any:
    from memcli.reference.v0523.loop import run_reference_replay

    return run_reference_replay(ref, **args)


def _host_pool(ref: Any, size: int, page_size: int, ratio: float, **_: Any) -> int:
    """Slots of the host pool `init_hicache` builds beside a `size`-token device pool."""
    from memcli.reference.v0523.stack import HostTier, build_stack_0523

    stack = build_stack_0523(ref, size, page_size, "rust", host=HostTier("write_through", ratio))
    return int(stack.tree.cache_controller.mem_pool_host.anchor_entry.host_pool.size)


TASKS: dict[str, Callable[..., Any]] = {"info": _info, "ops": _ops, "replay": _replay, "host_pool": _host_pool}


def serve(stdin=sys.stdin, stdout=sys.stdout) -> None:
    ref = None
    for line in stdin:
        if not line.strip():
            continue
        try:
            request = json.loads(line)
            ref = ref or load_reference_0523()
            answer = {"ok": TASKS[request["task"]](ref, **request.get("args", {}))}
        except Exception as exc:  # reported to the client, which raises it there
            answer = {"error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()[-4000:]}
        stdout.write(json.dumps(answer) + "\n")
        stdout.flush()


if __name__ == "__main__":
    serve()
