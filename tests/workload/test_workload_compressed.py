"""read_trace on compressed traces (gzip always, zstd with the zstandard package) and on
standard input: the same requests as the plain file, and errors that still name the line."""

from __future__ import annotations

import gzip
import io
import json
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from memcli.cli.app import app
from memcli.errors import TraceError
from memcli.workload.generate import generate_trace, write_trace
from memcli.workload.readers import read_trace

DATA = Path(__file__).parents[1] / "data"
MOONCAKE = DATA / "conversation_head300.jsonl"


@pytest.fixture(scope="module")
def memcli_trace(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("memcli") / "chat.jsonl"
    write_trace(generate_trace(40, seed=3, system_prompt_len=64, input_len=16, output_len=8), path)
    return path


def same_requests(a, b) -> None:
    assert a.format == b.format and a.num_requests == b.num_requests > 0
    assert [(r.rid, r.input_len, r.output_len, r.arrival_ms, r.line) for r in a.requests] == \
           [(r.rid, r.input_len, r.output_len, r.arrival_ms, r.line) for r in b.requests]
    assert all((x.input_ids() == y.input_ids()).all() for x, y in zip(a.requests, b.requests))


def gz(tmp_path: Path, source: Path, name: str) -> Path:
    path = tmp_path / name
    path.write_bytes(gzip.compress(source.read_bytes()))
    return path


@pytest.mark.parametrize("fmt", ["mooncake", "memcli"])
def test_gzip_reads_the_same_requests(tmp_path, fmt, memcli_trace):
    source = MOONCAKE if fmt == "mooncake" else memcli_trace
    trace = read_trace(gz(tmp_path, source, "t.jsonl.gz"))
    assert trace.format == fmt
    same_requests(trace, read_trace(source))


def test_gzip_is_told_by_its_bytes_not_its_name(tmp_path, memcli_trace):
    same_requests(read_trace(gz(tmp_path, memcli_trace, "plain-name.jsonl"), limit=20), read_trace(memcli_trace, limit=20))


def test_zstd_reads_the_same_requests(tmp_path):
    zstandard = pytest.importorskip("zstandard")
    path = tmp_path / "t.jsonl.zst"
    path.write_bytes(zstandard.ZstdCompressor().compress(MOONCAKE.read_bytes()))
    same_requests(read_trace(path), read_trace(MOONCAKE))


def test_zstd_without_the_package_says_how_to_get_it(tmp_path, monkeypatch):
    path = tmp_path / "t.jsonl.zst"
    path.write_bytes(b"\x28\xb5\x2f\xfd" + b"\0" * 16)
    monkeypatch.setitem(sys.modules, "zstandard", None)  # import zstandard now raises ImportError
    with pytest.raises(TraceError) as err:
        read_trace(path)
    assert "zstandard package is not installed" in err.value.message
    assert err.value.hint.startswith("pip install zstandard") and f"zstd -d {path}" in err.value.hint


def test_an_error_in_a_compressed_trace_names_the_line(tmp_path, memcli_trace):
    lines = memcli_trace.read_text().splitlines()[:5]
    lines[2] = '{"rid": "x", "output_len": 3}'
    path = tmp_path / "bad.jsonl.gz"
    path.write_bytes(gzip.compress(("\n".join(lines) + "\n").encode()))
    with pytest.raises(TraceError, match=r"bad\.jsonl\.gz:3: missing field"):
        read_trace(path)


def test_a_cut_gzip_is_an_error_with_a_hint(tmp_path, memcli_trace):
    path = tmp_path / "cut.jsonl.gz"
    path.write_bytes(gzip.compress(memcli_trace.read_bytes())[:2000])
    with pytest.raises(TraceError) as err:
        read_trace(path)
    assert "cannot decompress the trace" in err.value.message and "damaged or cut short" in err.value.hint
    assert err.value.message.startswith(f"{path}:")


def test_binary_input_hints_at_compression(tmp_path):
    path = tmp_path / "t.jsonl.bz2"
    path.write_bytes(b"BZh91AY&SY\xff\xfe\x00\n")
    with pytest.raises(TraceError) as err:
        read_trace(path)
    assert err.value.message == f"{path}:1: not valid JSON (not UTF-8 text)"
    assert "gzip (.gz) or zstd (.zst)" in err.value.hint


@pytest.mark.parametrize("compress", [False, True], ids=["plain", "gzip"])
def test_dash_reads_standard_input(monkeypatch, compress, memcli_trace):
    data = memcli_trace.read_bytes()
    data = gzip.compress(data) if compress else data
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BufferedReader(io.BytesIO(data))))
    trace = read_trace("-", limit=30)
    assert str(trace.path) == "<stdin>"
    same_requests(trace, read_trace(memcli_trace, limit=30))


def test_dash_errors_name_stdin_and_the_line(monkeypatch):
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b'{"rid": "a", "input_len": 3, "output_len": 1}\n[]\n')))
    with pytest.raises(TraceError, match=r"^<stdin>:2: expected a JSON object"):
        read_trace("-")


def test_replay_reads_a_trace_piped_in(memcli_trace):
    result = CliRunner().invoke(app, ["replay", "-", "--limit", "5", "--json"], input=memcli_trace.read_bytes())
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["trace"]["path"] == "<stdin>" and doc["requests"] == 5
