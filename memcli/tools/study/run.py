"""A study end to end (`memcli replay TRACE --sweep ...`): the options checked, the points
planned (every config checked before the first replay), what `--resume` keeps, the tasks
run by the chosen executor, the files and the plot written.

`run_study` is the entry; what comes before the points (config, trace, replay options) is
`memcli.tools.replay.run.prepare`, shared with the single replay.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

from memcli.config import Config
from memcli.errors import MemcliError
from memcli.tools.replay.run import Hooks, ReplayRequest, TaskFn, check_request, prepare
from memcli.tools.study.executors import default_jobs, processes, ray_address, ray_executor, require_ray, serial
from memcli.tools.study.files import StudyFiles, study_document, study_identity
from memcli.tools.study.grid import Point, grid_points, parse_sweep, point_label, read_sweep_file
from memcli.tools.study.plan import Executor, StudyContext, StudyState, Task, plan_study, run_tasks, with_belady
from memcli.tools.study.plot import plot_study
from memcli.tools.study.results import StudyOutcome


@dataclass(frozen=True)
class StudyOptions:
    """The study options of `memcli replay`: the points (`--sweep KEY=V1,V2`, repeatable, and
    `--sweep-file FILE`), where they run (`--jobs`, `--ray`, `--ray-address`) and the folder
    they are recorded in (`--out DIR`, `--resume`)."""

    sweeps: tuple[str, ...] = ()
    sweep_file: Optional[Path] = None
    jobs: Optional[int] = None
    use_ray: bool = False
    ray_address: Optional[str] = None
    out: Optional[Path] = None
    resume: bool = False

    @property
    def wanted(self) -> bool:
        """A study was asked for: `--sweep` or `--sweep-file`."""
        return bool(self.sweeps) or self.sweep_file is not None

    def points(self) -> list[Point]:
        """The points of `--sweep` / `--sweep-file` (`MemcliError` for a bad one)."""
        file_points = read_sweep_file(self.sweep_file) if self.sweep_file is not None else None
        return grid_points([parse_sweep(text) for text in self.sweeps], file_points)

    def check_unused(self) -> None:
        """Without a study: `MemcliError` for the first option that only a study uses."""
        given = [name for name, value in (("--jobs", self.jobs is not None), ("--ray", self.use_ray),
                                          ("--out", self.out is not None), ("--resume", self.resume),
                                          ("--ray-address", self.ray_address is not None)) if value]
        if given:
            raise MemcliError(f"{given[0]} runs the points of a study, and there is none",
                              "add --sweep KEY=v1,v2 or --sweep-file FILE, or leave out " + given[0])

    def check(self, replay: ReplayRequest) -> None:
        """`MemcliError` for study options that contradict each other or the replay's."""
        if replay.events is not None:
            raise MemcliError("--events writes the stream of one replay; it cannot be combined with --sweep or"
                              " --sweep-file", "leave out --sweep / --sweep-file, or --events")
        if self.jobs is not None and self.jobs < 1:
            raise MemcliError(f"--jobs {self.jobs}: at least 1", "--jobs 1 runs the points one after another")
        if self.ray_address is not None and not self.use_ray:
            raise MemcliError("--ray-address is the Ray cluster of --ray", "add --ray, or leave out --ray-address")
        if self.use_ray and self.jobs is not None and self.ray_address is not None:
            raise MemcliError("--jobs sizes a local Ray runtime or process pool, not a cluster joined with"
                              " --ray-address", "leave out --jobs: the cluster's CPUs run the points")
        if self.resume and self.out is None:
            raise MemcliError("--resume continues the study under --out DIR",
                              "add --out DIR (the folder of study.json)")
        if replay.requests_out is not None:
            raise MemcliError("--requests-out writes what one replay did; it cannot be combined with --sweep or"
                              " --sweep-file", "leave out --sweep / --sweep-file, or --requests-out")


@dataclass(frozen=True)
class StudyRequest:
    """A study: the replay that every point varies, and the study's own options."""

    replay: ReplayRequest
    study: StudyOptions


def run_study(request: StudyRequest, hooks: Hooks = Hooks()) -> StudyOutcome:
    """Check, plan, run and record the study; with `--plot`, plot it. Ctrl-C while the points
    run: an outcome with no document and the line saying how far it got (the files under
    `--out` hold what finished). Raises `MemcliError` for bad input, before anything runs."""
    options = request.study
    points = options.points()
    options.check(request.replay)
    check_request(request.replay)
    prepared = prepare(request.replay, hooks)
    context = StudyContext(prepared.trace, prepared.options, prepared.shared)
    study = prepare_study(with_belady(points, request.replay.bound is not None), request.replay.config.load,
                          context, choose_executor(options.jobs, options.use_ray, options.ray_address),
                          options.out, options.resume)
    try:
        document = study.run(_bar(study, hooks.task or _hidden))
    except KeyboardInterrupt:
        where = f"; --resume --out {options.out} runs the rest" if options.out is not None else ""
        return StudyOutcome(None, f"interrupted: {study.finished} of {study.total} replays finished{where}")
    plot = request.replay.plot
    if plot is not None:
        plot_study(document, plot)
    return StudyOutcome(document, plot=plot)


def _hidden(label: str) -> Callable[..., None]:
    return lambda *args, **kwargs: None


def _bar(study: "StudyRun", task: TaskFn) -> Callable[[Task, dict[str, Any]], None]:
    """The study's one progress bar: a tick per finished replay, with its hit rate."""
    update = task(f"study ({study.choice.label})")
    update(study.finished, study.total, "resumed" if study.finished else "")
    done = [study.finished]

    def finished(task_done: Task, row: dict[str, Any]) -> None:
        done[0] += 1
        update(done[0], study.total, f"{task_done.kind} {point_label(task_done.point)}: hit rate {row['hit_rate']:.2%}")
    return finished


@dataclass(frozen=True)
class ExecutorChoice:
    """`--jobs`, `--ray`, `--ray-address`, resolved: `label` names it in reports."""

    jobs: int
    use_ray: bool = False
    address: Optional[str] = None

    @property
    def label(self) -> str:
        if self.use_ray:
            target = ray_address(self.address)
            return f"ray ({target})" if target else f"ray (local, {self.jobs} CPUs)"
        return "serial" if self.jobs == 1 else f"processes ({self.jobs} jobs)"

    def executor(self) -> Executor:
        if self.use_ray:
            return ray_executor(self.address, self.jobs)
        return serial if self.jobs == 1 else processes(self.jobs)

    def check(self) -> None:
        """Raise `MemcliError` before anything runs (Ray not installed)."""
        if self.use_ray:
            require_ray(local=ray_address(self.address) is None)


def choose_executor(jobs: Optional[int], use_ray: bool, address: Optional[str]) -> ExecutorChoice:
    return ExecutorChoice(jobs if jobs is not None else default_jobs(), use_ray, address)


@dataclass
class StudyRun:
    """A planned study with what `--resume` kept; `run()` executes the rest."""

    state: StudyState
    context: StudyContext
    choice: ExecutorChoice
    files: Optional[StudyFiles]

    @property
    def total(self) -> int:
        return len(self.state.plan.tasks)

    @property
    def finished(self) -> int:
        return len(self.state.rows)

    def document(self) -> dict[str, Any]:
        return study_document(self.state, self.context, self.choice.label)

    def run(self, on_task: Callable[[Task, dict[str, Any]], None] = lambda task, row: None) -> dict[str, Any]:
        """Execute the pending tasks, writing the files after each. KeyboardInterrupt
        propagates once the executor has stopped (the files hold what finished)."""

        def record(task: Task, row: dict[str, Any]) -> None:
            if self.files is not None:
                self.files.write(self.document())
            on_task(task, row)

        run_tasks(self.state, self.context, self.choice.executor(), record)
        if self.files is not None:
            self.files.write(self.document())
        return self.document()


def prepare_study(points: list[Point], make_config: Callable[[list[str]], Config], context: StudyContext,
                  choice: ExecutorChoice, out: Optional[Path], resume: bool) -> StudyRun:
    """Plan the study (every config checked), check the executor and the output folder, and
    take the rows `--resume` may keep. Raises `MemcliError` for bad input."""
    choice.check()
    files = StudyFiles(out) if out is not None else None
    if files is not None:
        files.check_start(resume)
    plan = plan_study(points, make_config, context.trace, context.options)
    state = StudyState(plan)
    if files is not None and resume:
        state.rows.update(files.load(study_identity(context, plan.base), plan.tasks))
    return StudyRun(state, context, choice, files)
