"""A study: one replay per point of a grid, run by an executor, recorded as points finish.

`plan_study` builds and checks the config of every point before anything runs, and adds the
unlimited-pool reference of every page size the points use (`unlimited.py`). `run_tasks` hands
the tasks to an executor (`executors.py`: serial, processes or Ray), which yields them back
in completion order; each finished task goes to the `StudySink` (files under `--out`, the
progress bar) at once, so an interrupted study keeps what it finished and `--resume` skips it.

Points that the engine runs alike are replayed once: a point whose config differs from an
earlier point's only in a policy the engine's tree orders the same way (`Engine.eviction_order`:
LFU on a tree that never counts hits is LRU) takes that point's row, its own policy in it
and `same_as` naming the point replayed.

A point's result is a flat row of numbers (`results.point_row`): the same whatever ran it.
"""

from __future__ import annotations

import gc
import json
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterable, Iterator, Optional

import numpy as np

from memcli.config import Config
from memcli import engines
from memcli.tools.replay.runner import ReplayOptions, check_options, limit_cuts, replay
from memcli.tools.study.grid import Point, point_key, point_overrides
from memcli.tools.study.results import point_row
from memcli.tools.study.unlimited import reference_row
from memcli.workload.spec import Trace


@dataclass(frozen=True)
class Task:
    """One replay of a study. `kind`: "point" (a grid point) or "reference" (the unlimited
    pool at `point`'s page size). `index`: the point's place in the study (references count
    after the points). `same_as`: the index of an earlier point whose replay is this one's
    (`replay_identity`), or None: replayed itself."""

    index: int
    kind: str
    point: Point
    config: Config
    same_as: Optional[int] = None

    @property
    def key(self) -> str:
        return f"{self.kind}:{point_key(self.point)}"


@dataclass(frozen=True)
class StudyContext:
    """What every task of a study reads: shipped once to each worker (or object store).
    `kept`: the trace's read-only indexes, built by a process's first replay that needs them
    and shared by its later ones (`build_future`); shipped empty, filled in each process."""

    trace: Trace
    options: ReplayOptions
    shared: np.ndarray
    kept: dict = field(default_factory=dict, compare=False, repr=False)

    def __getstate__(self) -> dict:
        return {**self.__dict__, "kept": {}}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)


@dataclass(frozen=True)
class StudyPlan:
    keys: tuple[str, ...]
    points: tuple[Point, ...]
    tasks: tuple[Task, ...]
    base: Config


POLICY_KEY = "cache.eviction_policy"


def with_belady(points: list[Point], bound: bool) -> list[Point]:
    """`points`, then the same points under `eviction_policy: belady` (each once) when the
    study sweeps the eviction policy or asks for the bound: the offline reference beside the
    online policies."""
    if not bound and not any(POLICY_KEY in point for point in points):
        return points
    seen = {point_key(point) for point in points}
    out = list(points)
    for point in points:
        if point.get(POLICY_KEY) == "belady":
            continue
        twin = {**point, POLICY_KEY: "belady"}
        if point_key(twin) not in seen:
            seen.add(point_key(twin))
            out.append(twin)
    return out


def plan_study(points: list[Point], make_config: Callable[[list[str]], Config], trace: Trace,
               options: ReplayOptions) -> StudyPlan:
    """Every point's config, built and checked (`CapacityError`, `ConfigError`) before the
    first replay; then one reference task per page size the points use.
    `make_config(extra_overrides)` loads the base config with them."""
    base = make_config([])
    keys: list[str] = []
    for point in points:
        keys += [key for key in point if key not in keys]
    tasks = []
    for index, point in enumerate(points):
        config = make_config(point_overrides(point, base))
        check_options(trace, config, options)
        limit_cuts(config, trace, options)  # what cannot run even as the engine cuts it is refused here
        tasks.append(Task(index, "point", point, config))
    tasks = _same_replays(tasks)
    page_sizes = sorted({task.config.page_size for task in tasks})
    for offset, ps in enumerate(page_sizes):
        config = make_config(point_overrides({"memory.page_size": ps}, base))
        tasks.append(Task(len(points) + offset, "reference", {"memory.page_size": ps}, config))
    return StudyPlan(tuple(keys), tuple(points), tuple(tasks), base)


def replay_identity(config: Config) -> str:
    """What decides a replay's numbers: the config, its eviction policy as the order the
    engine's tree follows (`Engine.eviction_order`). Two points of one identity replay step for
    step alike."""
    doc = config.to_dict()
    order = engines.get(config).eviction_order
    if order is not None:
        doc["cache"]["eviction_policy"] = order(config)
    return json.dumps(doc, sort_keys=True, default=str)


def _same_replays(tasks: list[Task]) -> list[Task]:
    """`tasks` (points), each one whose replay identity an earlier point has marked `same_as` it."""
    first: dict[str, int] = {}
    out = []
    for task in tasks:
        index = first.setdefault(replay_identity(task.config), task.index)
        out.append(task if index == task.index else replace(task, same_as=index))
    return out


def same_row(row: dict[str, Any], task: Task) -> dict[str, Any]:
    """The row of `task` (`same_as` another point) from that point's row: the same numbers,
    its own eviction policy, and `same_as`."""
    return {**row, "eviction_policy": task.config.cache.eviction_policy, "same_as": task.same_as}


def run_task(task: Task, context: StudyContext) -> dict[str, Any]:
    """The row of one task (a point's replay, or a reference). Raises KeyboardInterrupt when
    the replay was interrupted: a partial replay is never recorded."""
    try:
        if task.kind == "reference":
            return reference_row(task.config, context.trace, context.options, context.shared)
        result = replay(task.config, context.trace, context.options, None, context.shared, context.kept)
        if result.interrupted:
            raise KeyboardInterrupt
        return point_row(result)
    finally:
        # A replay's tree, scheduler and pools reference each other: without a collection their
        # memory waits for the next full one, and a process running point after point grows.
        gc.collect()


@dataclass
class StudyState:
    """The rows so far, by task key; `done` counts finished tasks of this plan."""

    plan: StudyPlan
    rows: dict[str, dict[str, Any]] = field(default_factory=dict)

    def pending(self) -> list[Task]:
        return [task for task in self.plan.tasks if task.key not in self.rows]

    @property
    def complete(self) -> bool:
        return not self.pending()


Executor = Callable[[Iterable[Task], StudyContext], Iterator[tuple[Task, dict[str, Any]]]]


def run_tasks(state: StudyState, context: StudyContext, executor: Executor,
              on_row: Optional[Callable[[Task, dict[str, Any]], None]] = None) -> StudyState:
    """Run the pending tasks of `state`; each row is stored, then passed to `on_row`, as it
    arrives, and so is the row of each point `same_as` it. KeyboardInterrupt propagates after
    the executor has stopped its workers."""
    points = {task.index: task for task in state.plan.tasks if task.kind == "point"}
    twins: dict[int, list[Task]] = {}
    for task in state.pending():
        if task.same_as is not None:
            twins.setdefault(task.same_as, []).append(task)

    def store(task: Task, row: dict[str, Any]) -> None:
        state.rows[task.key] = row
        if on_row is not None:
            on_row(task, row)
        for twin in twins.pop(task.index, []) if task.kind == "point" else []:
            store(twin, same_row(row, twin))

    for index in [index for index in twins if points[index].key in state.rows]:  # replayed before a resume
        for twin in twins.pop(index):
            store(twin, same_row(state.rows[points[index].key], twin))
    for task, row in executor([task for task in state.pending() if task.same_as is None], context):
        store(task, row)
    return state
