"""Belady's offline eviction through a whole replay: it bounds the online policies, the
integrity checks hold, --bound belady reports it, and only replay accepts it."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from memcli.cli.app import app

from tests.tools.replay.helpers import CONVERSATION

runner = CliRunner()
# 300 real conversation requests through a pool that evicts often (8 rows, 400k tokens).
PRESSURE = ["--set", "memory.max_total_tokens=400000", "--set", "memory.max_running_requests=8"]


def replay_json(*args):
    result = runner.invoke(app, ["replay", str(CONVERSATION), *PRESSURE, *map(str, args), "--json"])
    assert result.exit_code == 0, result.stderr
    return json.loads(result.stdout)


@pytest.fixture(scope="module")
def by_policy():
    # The integrity checks run after every step of the belady replay.
    return {policy: replay_json("--set", f"cache.eviction_policy={policy}", *(["--check"] if policy == "belady" else []))
            for policy in ("lru", "fifo", "belady")}


def test_belady_bounds_the_online_policies(by_policy):
    belady = by_policy["belady"]
    assert belady["integrity"]["ok"] and belady["eviction"]["evictions"] > 0
    online = [by_policy[p]["hit_rate"] for p in ("lru", "fifo")]
    assert belady["hit_rate"] > max(online)
    assert belady["hit_rate"] <= belady["prefix_cache"]["ceiling"]["hit_rate"]
    # It keeps what is needed again: fewer evicted tokens are wanted later than under LRU.
    assert belady["eviction"]["needed_again_share"] < by_policy["lru"]["eviction"]["needed_again_share"]


def test_bound_belady_is_a_second_replay_beside_the_first(by_policy):
    doc = replay_json("--bound", "belady")
    bound = doc["prefix_cache"]["belady"]
    assert doc["hit_rate"] == by_policy["lru"]["hit_rate"]
    assert bound["hit_rate"] == by_policy["belady"]["hit_rate"] and "furthest in the future" in bound["definition"]


@pytest.mark.parametrize("args, needle", [
    (["replay", str(CONVERSATION), "--set", "cache.kind=chunk", "--bound", "belady"], "--bound belady ranks the radix"),
    (["replay", str(CONVERSATION), "--bound", "opt"], 'unknown --bound "opt"'),
    (["check-page-size", "--set", "cache.eviction_policy=belady"], "belady evicts by the trace's future uses"),
    (["replay", str(CONVERSATION), "--set", "cache.kind=hiradix", "--set", "cache.eviction_policy=belady"],
     "the host tier (cache.kind hiradix) is not modelled with it"),
])
def test_belady_where_it_cannot_apply_is_bad_input(args, needle):
    result = runner.invoke(app, args)
    assert result.exit_code == 2, result.stdout
    assert result.stderr.startswith("error: ") and needle in result.stderr and "hint: " in result.stderr


@pytest.mark.parametrize("engine, page_size, policy", [("sglang-0.5.23", 1, "lru"), ("sglang-0.5.5", 16, "lru"),
                                                        ("sglang-0.5.23", 16, "belady")])
def test_first_page_handles_read_off_the_prompt_equal_the_walk(monkeypatch, engine, page_size, policy):
    # Every first-page handle the replay asks for (evictions, Belady's order), read off the
    # prompt of the request whose tokens the node holds, equals the walk along the path.
    from memcli.mem_cache.radix_cache import RadixCache

    shortcut, checked = RadixCache._first_handle, []

    def both(self, node):
        handle = shortcut(self, node)
        assert handle == RadixCache._first_handle_walked(self, node), node
        checked.append((node.origin is not None, handle is not None))
        return handle

    monkeypatch.setattr(RadixCache, "_first_handle", both)
    doc = replay_json("--engine", engine, "--set", f"memory.page_size={page_size}",
                      "--set", f"cache.eviction_policy={policy}")
    assert doc["eviction"]["evictions"] > 0 and len(checked) > 0
    assert all(origin for origin, _ in checked)  # every node came from a request: read off its prompt
    assert {found for _, found in checked} == {True, False}  # paths inside a prompt, and past one
