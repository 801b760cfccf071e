"""`replay --check` (incremental) and `--check full`: modes, counters, and a planted fault
reported with its step and check in the JSON integrity section, under both profiles."""

from __future__ import annotations

import json

import pytest

from memcli.mem_cache.radix_cache import RadixCache
from memcli.sched.scheduler import Scheduler
from tests.tools.replay.helpers import plant_leak
from tests.tools.replay.test_command import SMALL, invoke, memcli_trace  # noqa: F401  (fixture)

PROFILES = ["sglang-0.5.5", "memcli"]


def run(trace, *args):
    result = invoke(trace, *args, "--json", *SMALL)
    return result.exit_code, json.loads(result.stdout)


@pytest.mark.parametrize("profile", PROFILES)
def test_check_is_incremental_every_step(memcli_trace, profile):  # noqa: F811
    code, doc = run(memcli_trace, "--check", "--set", f"semantics.profile={profile}")
    i = doc["integrity"]
    assert code == 0 and i["ok"] and i["mode"] == "every step"
    assert i["incremental_checks"] == doc["summary"]["steps"] and i["full_walks"] >= 1
    assert i["failure_step"] is None and i["failure_check"] is None


def test_check_full_walks_every_step(memcli_trace):  # noqa: F811
    code, doc = run(memcli_trace, "--check", "full")
    i = doc["integrity"]
    assert code == 0 and i["mode"] == "every step (full)"
    assert i["incremental_checks"] == 0 and i["full_walks"] == doc["summary"]["steps"] + 1


def test_a_word_after_the_trace_other_than_full_is_bad_input(memcli_trace):  # noqa: F811
    result = invoke(memcli_trace, "--check", "fast", *SMALL)
    assert result.exit_code == 2 and "--check full" in result.stderr and '"fast"' in result.stderr
    # The same with the level spelled out as the option's value.
    result = invoke(memcli_trace, "--check=fast", *SMALL)
    assert result.exit_code == 2 and "--check full" in result.stderr


@pytest.mark.parametrize("args, mode", [
    (["--check"], "every step"),  # last on the line
    (["--check", "incremental"], "every step"),
    (["--check", "--limit", "20"], "every step"),  # before another option
    (["--check=full"], "every step (full)"),
    ([], "idle steps and end"),
])
def test_check_takes_an_optional_level(memcli_trace, args, mode):  # noqa: F811
    code, doc = run(memcli_trace, *args)
    assert code == 0 and doc["integrity"]["mode"] == mode


def test_check_before_the_trace_is_still_a_flag(memcli_trace):  # noqa: F811
    result = invoke("--check", memcli_trace, "--json", *SMALL)
    assert result.exit_code == 0, result.stderr
    assert json.loads(result.stdout)["integrity"]["mode"] == "every step"
    result = invoke("--check", "full", memcli_trace, "--json", *SMALL)
    assert result.exit_code == 0 and json.loads(result.stdout)["integrity"]["mode"] == "every step (full)"


def test_two_traces_are_still_one_too_many(memcli_trace):  # noqa: F811
    result = invoke(memcli_trace, "--check", memcli_trace, *SMALL)
    assert result.exit_code == 2 and "--check full" in result.stderr
    result = invoke(memcli_trace, memcli_trace, *SMALL)
    assert result.exit_code == 2 and "unexpected extra argument" in result.stderr


def test_expand_optional_values():
    from memcli.cli.options import expand_optional_values

    levels = {"--check": ("incremental", "full")}
    assert expand_optional_values(["T", "--check"], levels) == (["T", "--check=incremental"], {})
    assert expand_optional_values(["T", "--check", "full"], levels) == (["T", "--check=full"], {})
    assert expand_optional_values(["--check", "T"], levels) == (["--check=incremental", "T"], {"T": "--check"})
    assert expand_optional_values(["--check", "-j", "2"], levels) == (["--check=incremental", "-j", "2"], {})
    assert expand_optional_values(["--", "--check", "full"], levels) == (["--", "--check", "full"], {})


def test_help_shows_check_as_an_option_with_an_optional_level():
    from typer.testing import CliRunner

    from memcli.cli.app import app

    result = CliRunner().invoke(app, ["replay", "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0
    usage = next(line for line in result.stdout.splitlines() if "Usage:" in line)
    assert usage.split("replay", 1)[1].split() == ["[OPTIONS]", "TRACE"]  # no positional [full]
    check = next(line for line in result.stdout.splitlines() if "--check" in line)
    assert "[incremental|full]" in check


@pytest.mark.parametrize("profile", PROFILES)
def test_double_free_is_reported_with_its_step_and_check(memcli_trace, monkeypatch, profile):  # noqa: F811
    planted = []
    step = Scheduler.step

    def freeing_step(self):
        if self.step_count == 7 and self.active_reqs():
            req = self.active_reqs()[0]
            row = self.memory.req_to_token_pool.req_to_token[req.req_pool_idx]
            planted.append(self.step_count)
            slot = int(row[req.kv_allocated_len - 1])
            victims.append((req.rid, slot // self.memory.page_size, req.req_pool_idx))
            self.memory.allocator.free(row[req.kv_allocated_len - 1: req.kv_allocated_len])  # still in use
        return step(self)

    victims = []
    monkeypatch.setattr(Scheduler, "step", freeing_step)
    code, doc = run(memcli_trace, "--check", "--set", f"semantics.profile={profile}")
    i = doc["integrity"]
    assert planted == [7] and code == 1
    assert i["failure_step"] == 7 and i["failure_check"] == "double_free"
    assert "request row" in i["failure"] and "allocator.free" in i["failure"]
    assert "history of" not in i["failure"]  # the story is the list, not the message
    # The story, in the JSON: the page was allocated for the request (an extend or a decode
    # opening it), then freed at step 7 by nobody while the row still owned it.
    (rid, page, row), = victims
    first, last = i["history"][0], i["history"][-1]
    assert {t["page"] for t in i["history"]} == {page}
    assert first["rid"] == rid and first["op"] in ("alloc_for_extend", "alloc_for_decode") and first["step"] < 7
    assert first["from"] == "free" and first["to"] == f"request row {row}"
    assert last == {"step": 7, "rid": None, "op": "allocator.free", "what": "double free", "page": page,
                    "from": f"request row {row}", "to": "refused"}
    # ... and in the text report, after the failure.
    text = invoke(memcli_trace, "--check", "--set", f"semantics.profile={profile}", *SMALL).stdout
    story = text[text.index("history of page"):]
    assert f"request {rid}: allocated for a" in story and "allocator.free REFUSED (double free)" in story


def test_check_full_fails_without_a_history_and_says_how_to_get_one(memcli_trace, monkeypatch):  # noqa: F811
    plant_leak(monkeypatch, after_step=3)
    code, doc = run(memcli_trace, "--check", "full")
    assert code == 1 and "history" not in doc["integrity"]
    text = invoke(memcli_trace, "--check", "full", *SMALL).stdout
    assert "replay with --check for the history" in text
