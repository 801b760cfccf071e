"""Engine `vllm-0.33` through the seam: replay runs on it, and bad input exits 2 with a hint."""

import json

import pytest
from typer.testing import CliRunner

from memcli import engines
from memcli.cli.app import app
from memcli.config import Config, load_config

TRACE = "tests/data/conversation_head300.jsonl"
SYNC = []


def test_the_engine_is_registered():
    assert "vllm-0.33" in engines.names()


def test_replay_runs_under_vllm_and_frees_everything():
    result = CliRunner().invoke(app, ["replay", TRACE, "--limit", "40", "--engine", "vllm-0.33", *SYNC, "--json",
                                      "--set", "memory.max_context_len=131072", "--set", "memory.max_total_tokens=200000"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["summary"]["finished"] == 40
    assert doc["integrity"]["everything_free_at_end"]
    assert doc["config"]["semantics"]["engine"] == "vllm-0.33"


@pytest.mark.parametrize("setting, message", [
    ("memory.page_size=8", "multiples of 16"),
    ("cache.kind=hiradix", "no host tier"),
    ("cache.eviction_policy=lfu", "free-block queue"),
    ("semantics.event_loop=overlap", "SGLang's loop"),
])
def test_what_vllm_lacks_is_refused(setting, message):
    result = CliRunner().invoke(app, ["replay", TRACE, "--limit", "2", "--engine", "vllm-0.33", *SYNC, "--set", setting])
    assert result.exit_code == 2, result.output
    assert message in result.output and "hint:" in result.output and "Traceback" not in result.output


def test_vllm_keys_stay_out_of_documents_while_unset():
    assert "max_num_seqs" not in Config().to_dict()["scheduler"]
    config = load_config(overrides=["scheduler.max_num_seqs=4"])
    assert config.to_dict()["scheduler"]["max_num_seqs"] == 4


def test_reference_diff_runs_vllms_own_scheduler(vllm_ref):
    result = CliRunner().invoke(app, ["reference", "diff", TRACE, "--limit", "12", "--engine", "vllm-0.33", "--json",
                                      "--set", "memory.max_context_len=131072", "--set", "memory.max_total_tokens=200000"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["divergent"] is False and doc["steps"] > 12 and doc["event_loop"] == "async" and doc["failure"] is None
    assert doc["profile"] == "vllm-0.33 (async loop)"


@pytest.mark.parametrize("command, message", [(["check-page-size"], "not one yet"),
                                              (["bench-one-batch"], "no static batch")])
def test_commands_without_a_vllm_path_say_so(command, message):
    result = CliRunner().invoke(app, [*command, "--engine", "vllm-0.33"])
    assert result.exit_code == 2, result.output
    assert message in result.output and "--engine sglang-0.5.5" in result.output


def test_show_config_prints_vllms_blocks():
    result = CliRunner().invoke(app, ["show-config", "--engine", "vllm-0.33", "--json",
                                      "--set", "memory.max_total_tokens=160000"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["derived"]["num_gpu_blocks"] == 10_000 and doc["derived"]["usable_blocks"] == 9_999
    assert doc["semantics_in_force"]["event_loop"] == "async" and doc["config"]["memory"]["page_size"] == 16
