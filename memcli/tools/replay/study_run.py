"""Running a study end to end: plan, resume, execute, record (`memcli replay --sweep ...`)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

from memcli.config import Config
from memcli.tools.replay.executors import default_jobs, processes, ray_address, ray_executor, require_ray, serial
from memcli.tools.replay.grid import Point
from memcli.tools.replay.study import Executor, StudyContext, StudyState, Task, plan_study, run_study
from memcli.tools.replay.study_files import StudyFiles, study_document, study_identity


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

        run_study(self.state, self.context, self.choice.executor(), record)
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
