"""The README's tour, run as written from an empty folder (with cheaper limits appended), twice:
every line exits 0 both times, and the mismatch example exits 1. So the README cannot drift
from the tool."""

from __future__ import annotations

import re
import shlex
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from memcli.cli.app import app

REPO = Path(__file__).resolve().parents[1]
# Appended to a tour line by its command; for an option given once, the last value wins.
CHEAPER = {
    "bench-one-batch": ["--input-len", "300", "--output-len", "2", "--repeat", "1", "--warmup", "0", "--rounds", "1"],
    "check-page-size": ["--steps", "120", "--allow-unfinished"],  # the full run finishes in about 370 steps
    "gen-trace": ["--requests", "40"],
    "replay": ["--limit", "20"],
    "bench-radix": ["--requests", "30", "--repeat", "1"],
    "reference diff": ["--limit", "4"],
}


def tour_blocks(readme: str) -> list[list[str]]:
    """The ```bash blocks of the tour section, each as its memcli lines without comments."""
    section = readme.split("## A short tour", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```bash\n(.*?)```", section, re.S)
    return [[line.split(" #")[0].strip() for line in block.splitlines() if line.startswith("memcli ")]
            for block in blocks]


def command_of(args: list[str]) -> str:
    return " ".join(args[:2]) if args[0] == "reference" else args[0]


def run_line(line: str) -> tuple[int, str]:
    args = shlex.split(line)[1:]
    command = command_of(args)
    if command == "reference diff" or "--compare" in args:
        from memcli.reference import unavailable_reason

        if unavailable_reason() is not None:
            return 0, f"skipped (no SGLang reference: {unavailable_reason()})"
    if "--compare" in args and args[args.index("--compare") + 1] == "vllm-0.33":
        from memcli.reference.vllm033.loader import vllm_unavailable_reason

        if vllm_unavailable_reason() is not None:
            return 0, f"skipped (no vLLM reference: {vllm_unavailable_reason()})"
    result = CliRunner().invoke(app, [*args, *CHEAPER.get(command, [])])
    return result.exit_code, result.stderr


@pytest.fixture(scope="module")
def tour():
    blocks = tour_blocks((REPO / "README.md").read_text())
    assert len(blocks) == 2 and len(blocks[0]) >= 8 and len(blocks[1]) == 1
    return blocks


@pytest.fixture
def clone_dir(tmp_path, monkeypatch):
    """An empty folder where the README's relative paths (tests/data/...) resolve."""
    (tmp_path / "tests").symlink_to(REPO / "tests")
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_the_tour_runs_twice_with_exit_0(tour, clone_dir):
    for round_ in (1, 2):
        for line in tour[0]:
            start = time.perf_counter()
            code, err = run_line(line)
            assert code == 0, f"round {round_}: {line}: exit {code}\n{err}"
            print(f"round {round_} {time.perf_counter() - start:5.1f} s  {line}")
    assert (clone_dir / "chat.jsonl").is_file()


def test_the_mismatch_example_exits_1(tour, clone_dir):
    (line,) = tour[1]
    code, err = run_line(line)
    assert code == 1, err


def test_every_command_of_the_tour_is_made_cheaper_or_already_cheap(tour):
    commands = {command_of(shlex.split(line)[1:]) for block in tour for line in block}
    assert commands - set(CHEAPER) <= {"show-config", "diff"}  # diff of two step logs reads two small files


def test_tour_blocks_reads_only_the_tour():
    readme = "## Two\n```bash\nmemcli x\n```\n## A short tour\n```bash\nmemcli a  # c\nnot me\n```\n## Next\n```bash\nmemcli z\n```"
    assert tour_blocks(readme) == [["memcli a"]]
