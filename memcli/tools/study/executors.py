"""Executors of a study: each takes the tasks and the shared context and yields
`(task, row)` pairs in completion order.

- `serial`: one task after another in this process.
- `processes(jobs)`: a pool of `jobs` worker processes (spawned, so no thread state is
  inherited); the context is sent to each worker once, when it starts; each worker runs one
  replay at a time on one torch thread and ignores Ctrl-C, which the parent handles by
  stopping the pool.
- `ray(address, jobs)`: each task a Ray task of one CPU. The context is put into the object
  store once (`ray.put`) and read once per worker process; rows come back with `ray.wait`
  as they finish. Without an address (and without RAY_ADDRESS) a local Ray runtime of
  `jobs` CPUs is started, and stopped at the end.

Ray is optional (`pip install 'memcli[ray]'`): `require_ray` raises a `MemcliError` with the
install hint before anything runs.
"""

from __future__ import annotations

import concurrent.futures as cf
import gc
import multiprocessing
import os
import signal
import sys
from typing import Any, Iterable, Iterator, Optional

from memcli.errors import MemcliError
from memcli.tools.study.plan import StudyContext, Task, run_task

# Ray binds a runtime it starts to the host's network address unless this is "0" (then to
# 127.0.0.1): a study's local runtime serves no other machine.
LOOPBACK_SWITCH = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
RAY_HINT = "pip install 'memcli[ray]' (or pip install ray), or leave out --ray to run the points in local processes"


def default_jobs() -> int:
    """The cores this process may use."""
    try:
        return max(len(os.sched_getaffinity(0)), 1)
    except AttributeError:  # pragma: no cover - not on Linux
        return max(os.cpu_count() or 1, 1)


def serial(tasks: Iterable[Task], context: StudyContext) -> Iterator[tuple[Task, dict[str, Any]]]:
    for task in tasks:
        yield task, run_task(task, context)


# -- processes ------------------------------------------------------------------------------

_WORKER_CONTEXT: Optional[StudyContext] = None


def _init_worker(context: StudyContext) -> None:
    global _WORKER_CONTEXT
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent stops the pool on Ctrl-C
    import torch

    torch.set_num_threads(1)
    _WORKER_CONTEXT = context
    settle()


def settle() -> None:
    """Move what this process holds now (its modules, the study's context) out of the cyclic
    collector's reach: the full collection after each replay (`run_task`) then walks that
    replay's objects only, not the hundreds of thousands the imports left."""
    gc.collect()
    gc.freeze()


def _run_in_worker(task: Task) -> dict[str, Any]:
    assert _WORKER_CONTEXT is not None, "worker started without its context"
    return run_task(task, _WORKER_CONTEXT)


def processes(jobs: int):
    """An executor that runs tasks in `jobs` spawned worker processes."""

    def run(tasks: Iterable[Task], context: StudyContext) -> Iterator[tuple[Task, dict[str, Any]]]:
        tasks = list(tasks)
        if not tasks:
            return
        pool = cf.ProcessPoolExecutor(max_workers=min(jobs, len(tasks)), mp_context=multiprocessing.get_context("spawn"),
                                      initializer=_init_worker, initargs=(context,))
        try:
            futures = {pool.submit(_run_in_worker, task): task for task in tasks}
            for future in cf.as_completed(futures):
                yield futures[future], future.result()
        except BaseException:
            _stop(pool)
            raise
        pool.shutdown(wait=True)

    return run


def _stop(pool: cf.ProcessPoolExecutor) -> None:
    """Cancel what has not started and end the workers (a replay cannot be cut short)."""
    workers = list(getattr(pool, "_processes", {}).values())
    pool.shutdown(wait=False, cancel_futures=True)
    for worker in workers:
        if worker.is_alive():
            worker.terminate()
    for worker in workers:
        worker.join(timeout=5)


# -- ray ------------------------------------------------------------------------------------


def require_ray(local: bool = False):
    """The ray module; `MemcliError` with the install hint without it. `local`: the runtime
    will be started here, on the loopback address only (Ray reads the switch when imported)."""
    if local and "ray" not in sys.modules:
        os.environ.setdefault(LOOPBACK_SWITCH, "0")
    try:
        import ray
    except ImportError:
        raise MemcliError("--ray needs Ray, which is not installed", RAY_HINT) from None
    return ray


def ray_address(address: Optional[str]) -> Optional[str]:
    """The cluster to join: --ray-address, else RAY_ADDRESS, else None (a local runtime)."""
    return address or os.environ.get("RAY_ADDRESS") or None


_RAY_CONTEXTS: dict[str, StudyContext] = {}


def _ray_task(boxed_ref: list, task: Task) -> dict[str, Any]:
    """Runs on a Ray worker: the context is fetched once per worker process, by its id."""
    import ray
    import torch

    torch.set_num_threads(1)
    ref = boxed_ref[0]
    context = _RAY_CONTEXTS.get(ref.hex())
    if context is None:
        _RAY_CONTEXTS.clear()
        context = _RAY_CONTEXTS[ref.hex()] = ray.get(ref)
        settle()
    return run_task(task, context)


def ray_executor(address: Optional[str], jobs: int):
    """An executor that runs every task as a Ray task of one CPU (see the module docstring)."""

    def run(tasks: Iterable[Task], context: StudyContext) -> Iterator[tuple[Task, dict[str, Any]]]:
        tasks = list(tasks)
        if not tasks:
            return
        target = ray_address(address)
        ray = require_ray(local=target is None)
        started = not ray.is_initialized()
        if started:
            try:
                if target is None:
                    ray.init(num_cpus=jobs, include_dashboard=False, log_to_driver=False, logging_level="ERROR")
                else:
                    ray.init(address=target, log_to_driver=False, logging_level="ERROR")
            except (ConnectionError, ValueError, RuntimeError) as exc:
                raise MemcliError(f"cannot start or join Ray at {target or 'a local runtime'}: {exc}",
                                  "check --ray-address / RAY_ADDRESS (ray status shows the cluster's address),"
                                  " or leave it out for a local runtime") from None
        remote = ray.remote(num_cpus=1, max_retries=0)(_ray_task)
        try:
            boxed = [ray.put(context)]  # in a list: the task receives the reference, not a copy per task
            pending = {remote.remote(boxed, task): task for task in tasks}
            while pending:
                done, _ = ray.wait(list(pending), num_returns=1)
                for ref in done:
                    task = pending.pop(ref)
                    yield task, ray.get(ref)
        except BaseException:
            for ref in list(locals().get("pending", {})):
                ray.cancel(ref, force=True)
            raise
        finally:
            if started:
                ray.shutdown()

    return run
