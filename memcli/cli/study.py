"""The study options of `memcli replay`: parsing, checks, and the one progress bar."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, List, Optional

from memcli.cli.guard import Interrupted
from memcli.config import Config
from memcli.errors import MemcliError
from memcli.tools.replay.grid import Point, grid_points, parse_sweep, point_label, read_sweep_file
from memcli.tools.replay.study import StudyContext
from memcli.tools.replay.study_run import choose_executor, prepare_study


def study_points(sweeps: List[str], sweep_file: Optional[Path]) -> Optional[list[Point]]:
    """The points of `--sweep` / `--sweep-file`; None when neither is given (one replay)."""
    if not sweeps and sweep_file is None:
        return None
    file_points = read_sweep_file(sweep_file) if sweep_file is not None else None
    return grid_points([parse_sweep(text) for text in sweeps], file_points)


def check_study_options(study: bool, jobs: Optional[int], use_ray: bool, ray_address: Optional[str],
                        out: Optional[Path], resume: bool, events: Optional[Path]) -> None:
    if not study:
        given = [name for name, value in (("--jobs", jobs is not None), ("--ray", use_ray), ("--out", out is not None),
                                          ("--resume", resume), ("--ray-address", ray_address is not None)) if value]
        if given:
            raise MemcliError(f"{given[0]} runs the points of a study, and there is none",
                              "add --sweep KEY=v1,v2 or --sweep-file FILE, or leave out " + given[0])
        return
    if events is not None:
        raise MemcliError("--events writes the stream of one replay; it cannot be combined with --sweep or"
                          " --sweep-file",
                          "leave out --sweep / --sweep-file, or --events")
    if jobs is not None and jobs < 1:
        raise MemcliError(f"--jobs {jobs}: at least 1", "--jobs 1 runs the points one after another")
    if ray_address is not None and not use_ray:
        raise MemcliError("--ray-address is the Ray cluster of --ray", "add --ray, or leave out --ray-address")
    if use_ray and jobs is not None and ray_address is not None:
        raise MemcliError("--jobs sizes a local Ray runtime or process pool, not a cluster joined with --ray-address",
                          "leave out --jobs: the cluster's CPUs run the points")
    if resume and out is None:
        raise MemcliError("--resume continues the study under --out DIR", "add --out DIR (the folder of study.json)")


def run_study_command(points: list[Point], make_config: Callable[[list[str]], Config], context: StudyContext,
                      jobs: Optional[int], use_ray: bool, ray_address: Optional[str], out: Optional[Path],
                      resume: bool, task: Callable[[str], Callable[..., None]]) -> dict[str, Any]:
    """Plan, run and record the study; the document. `task(label)` adds the one progress bar
    (`memcli.cli.progress.bars`). Ctrl-C: `Interrupted`, after the files were written with
    what finished."""
    study = prepare_study(points, make_config, context, choose_executor(jobs, use_ray, ray_address), out, resume)
    update = task(f"study ({study.choice.label})")
    update(study.finished, study.total, "resumed" if study.finished else "")
    done = [study.finished]

    def finished(task_done, row) -> None:
        done[0] += 1
        update(done[0], study.total, f"{task_done.kind} {point_label(task_done.point)}: hit rate {row['hit_rate']:.2%}")

    try:
        return study.run(finished)
    except KeyboardInterrupt:
        where = f"; --resume --out {out} runs the rest" if out is not None else ""
        raise Interrupted(f"interrupted: {study.finished} of {study.total} replays finished{where}") from None
