"""`bench-one-batch --tree-cache hiradix` on a CPU: the copies are real and the table adds up."""

import json

import pytest
from typer.testing import CliRunner

from memcli.cli.app import app
from memcli.config import load_config
from memcli.tools.bench_one_batch.cases import plan_cases
from memcli.tools.bench_one_batch.host_tier_bench import run_transfer_bench

ARGS = ["bench-one-batch", "--tree-cache", "hiradix", "--batch-size", "2", "--input-len", "100", "--page-size", "1",
        "16", "--rounds", "2", "--repeat", "2", "--warmup", "1", "--set", "runtime.device=cpu"]


def test_json_reports_bytes_and_gbps_for_every_phase():
    out = CliRunner().invoke(app, [*ARGS, "--json"])
    assert out.exit_code == 0, out.output
    doc = json.loads(out.stdout)
    assert doc["command"] == "bench-one-batch" and doc["tree_cache"] == "hiradix"
    cfg = load_config(None, ["runtime.device=cpu"])
    for case, ps in zip(doc["cases"], (1, 16)):
        tokens = 2 * (-(-100 // ps) * ps)
        assert case["page_size"] == ps and case["tokens"] == tokens
        assert case["bytes"] == tokens * cfg.model.bytes_per_token
        for phase in ("backup", "load_back", "plain_d2h", "plain_h2d"):
            p = case["phases"][phase]
            assert p["us"] > 0 and p["gbps"] == pytest.approx(case["bytes"] / (p["us"] * 1e3), rel=1e-3, abs=2e-3)
        assert case["backup_share_of_plain_d2h"] == pytest.approx(
            case["phases"]["backup"]["gbps"] / case["phases"]["plain_d2h"]["gbps"], rel=2e-2, abs=2e-3)


def test_the_table_prints_one_row_per_case():
    out = CliRunner().invoke(app, ARGS)
    assert out.exit_code == 0, out.output
    assert "bs=2 input=100 ps=1" in out.stdout and "bs=2 input=100 ps=16" in out.stdout
    assert "plain copy" in out.stdout


def test_a_backup_that_copies_nothing_is_caught(monkeypatch):
    import memcli.mem_cache.host_pool as host_pool

    monkeypatch.setattr(host_pool.HostKVPool, "backup_from_device", lambda self, *a, **k: None)
    cfg = load_config(None, ["runtime.device=cpu"])
    with pytest.raises(AssertionError, match="host copy differs from the device"):
        run_transfer_bench(cfg, plan_cases([1], [64], [1], [0], [1]), repeat=1, warmup=0, rounds=1)


def test_options_that_do_not_apply_are_refused():
    out = CliRunner().invoke(app, [*ARGS, "--compare", "sglang-0.5.5"])
    assert out.exit_code == 2 and "--tree-cache hiradix times host copies only" in out.output
