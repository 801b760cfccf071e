"""Where the sglang-0.5.5 and sglang-0.5.23 engines differ, key by key, on the bundled traces.

Each case starts from `--engine sglang-0.5.5` and switches one semantics key at a time to its
SGLang 0.5.23 value (`memcli.config.SGLANG_0523_CHOICES`), replays, and records which of four
fields of the replay changed against plain 0.5.5:

    hits    each request's cached tokens at its admission
    evict   the tokens each eviction freed, in order
    steps   every step's kind, batch, extend lengths, retractions and finishes
    slots   every step's KV slots and request rows

Checked here: a key the reference page (`sglang-0.5.23-memstack.md`) gives no observable effect
under the case's settings changes nothing; a key it says changes only ids changes only slots;
with every key switched, the 0.5.5 engine gives exactly the 0.5.23 engine's replay (and with
every key at 0.5.5's value, the 0.5.23 engine gives 0.5.5's): the engines differ in their keys
and nowhere else. docs/FIDELITY.md ("From 0.5.5 to 0.5.23, key by key") is this module's table,
checked against it here; `python -m tests.test_engine_keys` prints it.
"""

from __future__ import annotations

import dataclasses
import sys
from functools import lru_cache
from pathlib import Path
from typing import NamedTuple

import pytest

from memcli.config import PROFILE_CHOICES, SGLANG_0523_CHOICES, load_config
from memcli.reference.observe import MemcliSide
from memcli.reference.v0523.diff import watch_rows
from memcli.workload.readers import read_trace
from memcli.workload.spec import output_token_base

REPO = Path(__file__).resolve().parents[1]
CONVERSATION = "tests/data/conversation_head300.jsonl"
SYNTHETIC = "tests/data/synthetic_head200.jsonl"
FIELDS = ("hits", "evict", "steps", "slots")
# The keys on which 0.5.23 differs from 0.5.5, in the order of memcli.config.
KEYS = tuple(k for k, v in SGLANG_0523_CHOICES.items() if PROFILE_CHOICES[k]["sglang-0.5.5"] != v)
OLD = {k: PROFILE_CHOICES[k]["sglang-0.5.5"] for k in KEYS}
NEW = {k: SGLANG_0523_CHOICES[k] for k in KEYS}


class Case(NamedTuple):
    name: str
    trace: str
    num_requests: int
    max_len: int  # requests whose input + output is longer are left out
    output_cap: int
    arrivals: str
    settings: tuple[str, ...]


def _settings(ps: int, pool: int, context: int, chunk: int, running: int, *more: str) -> tuple[str, ...]:
    return (f"memory.page_size={ps}", f"memory.max_total_tokens={pool}", f"memory.max_context_len={context}",
            f"scheduler.chunked_prefill_size={chunk}", f"memory.max_running_requests={running}", *more)


CASES = (
    # A pool that evicts and retracts (the last case of the step-level differential tests).
    Case("conversation, ps 16, 13k pool", CONVERSATION, 40, 12000, 40, "burst", _settings(16, 13000, 12000, 1024, 16)),
    # Shared prefixes at their trace times, page size 1 (free order and tree stamps act on nothing here).
    Case("synthetic, ps 1, 24k pool", SYNTHETIC, 40, 12000, 40, "timestamp", _settings(1, 24000, 12000, 1024, 16)),
    # An input budget below the chunk: 0.5.5 stops a second long request, 0.5.23 chunks it (rem_input_gate).
    Case("conversation, ps 16, input budget 1k", CONVERSATION, 30, 12000, 40, "burst",
         _settings(16, 24000, 12000, 2048, 16, "scheduler.max_prefill_tokens=1024")),
)

# The reference page's effect of each key (sections 2-4), as the fields it may change:
# "none" keys may change nothing, "ids" keys only slots. The rest may move the step list, and
# with it anything downstream.
NO_EFFECT = {
    "lfu_hits": "hit counts are read only by lfu; these cases evict by lru",
    "chunk_cache_protected": "the chunk cache's protected size is reported, and only by the chunk cache",
    "host_pool_floor": "read by the host tier only (cache.kind hiradix)",
    "hicache_ack": "read by the host tier only (cache.kind hiradix)",
}
NO_EFFECT_AT_PS1 = {"free_order": "paged frees only: at page size 1 every page is one slot"}
IDS_ONLY = ("retract_free", "chunked_prefix", "row_order", "free_order", "overlap_release")


def _requests(case: Case):
    trace = read_trace(case.trace, limit=300)
    requests = [r for r in trace.requests if r.input_len + r.output_len <= case.max_len][: case.num_requests]
    return [dataclasses.replace(r, output_len=min(r.output_len, case.output_cap)) for r in requests], \
        output_token_base(trace)


@lru_cache(maxsize=None)
def replay(case: Case, engine: str, switched: tuple[tuple[str, str], ...] = ()) -> dict[str, tuple]:
    """The four fields of `case` under `engine` with the keys `switched` set (key, value)."""
    requests, base = _requests(case)
    # Values quoted: YAML would read `off` as false.
    sets = (*case.settings, f"semantics.engine={engine}", *(f"semantics.{k}='{v}'" for k, v in switched))
    mem = MemcliSide(load_config(None, sets), requests, case.arrivals, base)
    rows = watch_rows(mem)
    steps = []
    while not mem.is_done():
        rows[0] = ()
        steps.append((mem.step(), rows[0]))
        assert len(steps) < 20000, "the replay does not finish"
    return _fields(steps)



def _fields(steps: list) -> dict[str, tuple]:
    hits: dict[str, int] = {}
    for obs, _ in steps:
        if obs.kind == "prefill":
            for rid, prefix in zip(obs.rids, obs.prefix_lens):
                hits.setdefault(rid, prefix)
    return {"hits": tuple(sorted(hits.items())),
            "evict": tuple(obs.evicted for obs, _ in steps if obs.evicted),
            "steps": tuple((obs.kind, obs.rids, obs.extend_lens, obs.retracted, obs.finished) for obs, _ in steps),
            "slots": tuple((obs.out_cache_loc, rows) for obs, rows in steps)}


def changed(a: dict, b: dict) -> tuple[str, ...]:
    return tuple(f for f in FIELDS if a[f] != b[f])


def one_key(case: Case, key: str) -> tuple[str, ...]:
    """The fields that switching `key` alone to 0.5.23's value changes, from plain 0.5.5."""
    return changed(replay(case, "sglang-0.5.5"), replay(case, "sglang-0.5.5", ((key, NEW[key]),)))


def table() -> list[tuple[str, ...]]:
    """One row per key: the key, its two values, then the fields it changes in each case."""
    return [(key, OLD[key], NEW[key], *(", ".join(one_key(case, key)) or "—" for case in CASES)) for key in KEYS]


def markdown() -> str:
    head = ["key", "0.5.5", "0.5.23", *(c.name for c in CASES)]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for key, old, new, *cells in table():
        lines.append(f"| `{key}` | `{old}` | `{new}` | " + " | ".join(cells) + " |")
    totals = [", ".join(changed(replay(c, "sglang-0.5.5"), replay(c, "sglang-0.5.23"))) or "—" for c in CASES]
    lines.append("| **all keys** (the `sglang-0.5.23` engine) | | | " + " | ".join(totals) + " |")
    return "\n".join(lines)


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_the_keys_together_are_the_0523_engine(case):
    everything = tuple(NEW.items())
    assert replay(case, "sglang-0.5.5", everything) == replay(case, "sglang-0.5.23")
    assert replay(case, "sglang-0.5.23", tuple(OLD.items())) == replay(case, "sglang-0.5.5")
    assert changed(replay(case, "sglang-0.5.5"), replay(case, "sglang-0.5.23"))  # the engines do differ here


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_a_key_without_an_observable_effect_changes_nothing(case):
    quiet = {**NO_EFFECT, **(NO_EFFECT_AT_PS1 if "memory.page_size=1" in case.settings else {})}
    for key, why in quiet.items():
        assert one_key(case, key) == (), f"{key} ({why})"
    for key in IDS_ONLY:
        assert set(one_key(case, key)) <= {"slots"}, key


def test_the_fidelity_table_is_this_measurement():
    text = (REPO / "docs" / "FIDELITY.md").read_text()
    section = text.split("### From 0.5.5 to 0.5.23, key by key", 1)[1].splitlines()
    start = next(i for i, line in enumerate(section) if line.startswith("|"))
    end = next(i for i in range(start, len(section) + 1) if i == len(section) or not section[i].startswith("|"))
    assert section[start:end] == markdown().splitlines(), \
        "docs/FIDELITY.md's key-by-key table is stale: print it with python -m tests.test_engine_keys"


def _main() -> None:
    sys.stdout.write(markdown() + "\n")


if __name__ == "__main__":
    _main()
