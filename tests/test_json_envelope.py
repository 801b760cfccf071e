"""Every command's --json document opens with the one envelope of docs/JSON.md: `command`,
`memcli_version`, `profile` and `config` (null for a command that reads no config), then the
command's own fields."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

import memcli
from memcli.cli.app import COMMANDS, app
from memcli.report.envelope import ENVELOPE_KEYS, envelope

TRACE = "tests/data/conversation_head300.jsonl"
SMALL = ["--set", "memory.max_total_tokens=90000", "--set", "memory.max_context_len=88000"]

# command -> (arguments for a cheap run, whether it reads a config); {tmp} is a fresh folder.
CASES = {
    "show-config": (["--set", "memory.page_size=16"], True),
    "bench-one-batch": (["--batch-size", "1", "--input-len", "16", "--output-len", "2", "--repeat", "1",
                         "--warmup", "0", "--set", "memory.page_size=16"], True),
    "check-page-size": (["--set", "memory.page_size=16", "--steps", "40", "--allow-unfinished"], True),
    "gen-trace": (["{tmp}/t.jsonl", "--requests", "5"], False),
    "replay": ([TRACE, "--limit", "4", *SMALL, "--set", "memory.page_size=16"], True),
    "replay --sweep": ([TRACE, "--limit", "3", *SMALL, "--sweep", "memory.page_size=1,16"], True),
    "bench-radix": (["--trace", TRACE, "--requests", "5", "--repeat", "1"], False),
    "diff": ([TRACE, "--limit", "3", "--a", "--set memory.page_size=16", "--b", "--set memory.page_size=16"], False),
}
# `reference fetch` and `reference diff` need SGLang's wheel: tests/reference/test_cli.py.
ELSEWHERE = {"reference fetch", "reference diff"}


def test_every_command_is_covered():
    names = {name for name, _, _ in COMMANDS} | ELSEWHERE
    assert {case.split()[0] for case in CASES} | ELSEWHERE == names


def assert_envelope(doc: dict, command: str, reads_config: bool) -> None:
    assert list(doc)[:4] == list(ENVELOPE_KEYS)
    assert doc["command"] == command and doc["memcli_version"] == memcli.__version__
    if reads_config:
        assert isinstance(doc["config"], dict) and set(doc["config"]) >= {"memory", "cache", "semantics"}
        assert doc["profile"] == doc["config"]["semantics"]["profile"] == "sglang-0.5.23"  # the default engine
    else:
        assert doc["config"] is None and doc["profile"] is None
    assert len(doc) > 4  # the command's own fields follow


@pytest.mark.parametrize("case", list(CASES))
def test_json_document_has_the_envelope(case, tmp_path):
    args, reads_config = CASES[case]
    command = case.split()[0]
    result = CliRunner().invoke(app, [command, *(a.format(tmp=tmp_path) for a in args), "--json"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)  # exactly one document: json.loads rejects anything after it
    assert_envelope(doc, command, reads_config)
    if command in ("show-config", "bench-one-batch", "check-page-size", "replay") and case != "replay --sweep":
        assert doc["config"]["memory"]["page_size"] == 16  # the resolved config, --set applied


def test_the_profile_follows_the_config():
    result = CliRunner().invoke(app, ["show-config", "--set", "semantics.profile=memcli",
                                      "--set", "semantics.event_loop=overlap", "--json"])
    doc = json.loads(result.stdout)
    assert doc["profile"] == "memcli + event_loop=overlap"


def test_a_command_field_cannot_overwrite_the_envelope():
    with pytest.raises(ValueError, match="config"):
        envelope("replay", {"config": {}})
    assert list(envelope("gen-trace", {"path": "x"})) == [*ENVELOPE_KEYS, "path"]
