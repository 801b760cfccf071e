"""The replay report shows only labels that apply to the run, gives each count one name, and
explains every "lost" or "waste" figure in a footnote."""

from __future__ import annotations

import json
import re

import pytest
from typer.testing import CliRunner

from memcli.cli.app import app

CPU = ["--set", "runtime.device=cpu"]


def text(*args) -> str:
    result = CliRunner().invoke(app, ["replay", *map(str, args)], env={"NO_COLOR": "1"})
    assert result.exit_code == 0, result.output
    return result.stdout


def labels(report: str) -> list[str]:
    """The key column of every table row."""
    return [m.group(1).strip() for m in re.finditer(r"^│ (.+?) +│", report, re.M)]


@pytest.fixture(scope="module")
def short_trace(tmp_path_factory):
    path = tmp_path_factory.mktemp("t") / "short.jsonl"
    prompt = list(range(1, 60))
    rows = [{"rid": f"r{i}", "input_ids": prompt + [100 + i] * 7, "output_len": 3} for i in range(100)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def long_trace(tmp_path_factory):
    path = tmp_path_factory.mktemp("t") / "long.jsonl"
    path.write_text("".join(json.dumps({"input_len": 4, "output_len": 1}) + "\n" for _ in range(1001)))
    return path


def test_the_last_1000_window_is_shown_only_for_longer_traces(short_trace, long_trace):
    assert not any("last 1,000" in label for label in labels(text(short_trace, *CPU)))
    assert "hit rate, last 1,000 requests" in labels(text(long_trace, *CPU))


def test_page_figures_only_when_pages_hold_several_tokens(short_trace):
    unpaged = labels(text(short_trace, *CPU))
    paged = labels(text(short_trace, *CPU, "--set", "memory.page_size=16"))
    for label in ("lost to page alignment", "partial-page waste, peak / mean (tokens)", "peak used pages",
                  "requests with a sub-page shared prefix"):
        assert label not in unpaged and label in paged


def test_eviction_distributions_only_when_something_was_evicted(short_trace):
    roomy = labels(text(short_trace, *CPU))
    tight = labels(text(short_trace, *CPU, "--set", "memory.max_total_tokens=400", "--set", "memory.max_context_len=200"))
    assert "age at eviction p50 / p90 / max (s)" not in roomy and "age at eviction p50 / p90 / max (s)" in tight


@pytest.mark.parametrize("page_size", [1, 16])
def test_every_lost_or_waste_figure_has_a_footnote(short_trace, page_size):
    report = text(short_trace, *CPU, "--set", f"memory.page_size={page_size}")
    shown = [label for label in labels(report) if "lost" in label or "waste" in label]
    assert shown
    for label in shown:
        name = label.split(",")[0].split(" (")[0]
        assert f"\n{name} = " in report, name


def test_free_counts_do_not_read_as_a_contradiction(short_trace):
    report = text(short_trace, *CPU)
    assert "frees (tokens)" not in report and "everything free" not in report
    assert "returned to the free list: calls (tokens)" in labels(report)
    assert "no request holds memory at the end" in labels(report)
    assert "\nno request holds memory at the end = at the end no request holds a slot" in report
    assert "retraction events (requests retracted)" in labels(report)


def test_the_footnote_finder_is_not_blind():
    report = "│ lost to page alignment │ 3 │\nhit rate = x.\n"
    assert labels(report) == ["lost to page alignment"] and "\nlost to page alignment = " not in report
