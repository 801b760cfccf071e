"""Fetching and extracting the wheel, without the network: pip is replaced by a fake."""

import subprocess
import zipfile

import pytest

from memcli.errors import MemcliError
from memcli.reference import fetch
from memcli.reference.fetch import EXTRACT, ReferenceFetchError, extract, fetch_wheel

WHEEL = f"sglang-{fetch.SGLANG_VERSION}-py3-none-any.whl"


def _write_fake_wheel(path):
    with zipfile.ZipFile(path, "w") as zf:
        for name in EXTRACT:
            zf.writestr(name + "x.py" if name.endswith("/") else name, "# fake\n")
        zf.writestr("sglang/srt/models/llama.py", "# not extracted\n")


class FakePip:
    """Stands for `subprocess.run`: records each call; writes a wheel or fails like pip."""

    def __init__(self, returncode=0, stderr=""):
        self.calls, self.returncode, self.stderr = [], returncode, stderr

    def __call__(self, cmd, **kwargs):
        self.calls.append(cmd)
        if self.returncode == 0:
            _write_fake_wheel(fetch.Path(cmd[cmd.index("-d") + 1]) / WHEEL)
        return subprocess.CompletedProcess(cmd, self.returncode, "", self.stderr)


def test_fetch_runs_pip_once_then_reuses_the_cached_wheel(tmp_path, monkeypatch):
    pip = FakePip()
    monkeypatch.setattr(fetch.subprocess, "run", pip)
    first = fetch_wheel(tmp_path)
    second = fetch_wheel(tmp_path)
    assert first == second == tmp_path / "reference" / WHEEL
    assert len(pip.calls) == 1
    cmd = pip.calls[0]
    assert cmd[1:4] == ["-m", "pip", "download"] and "--no-deps" in cmd and "sglang==0.5.5" in cmd


def test_cache_dir_defaults_to_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("MEMCLI_CACHE_DIR", str(tmp_path))
    assert fetch.reference_dir() == tmp_path / "reference"
    monkeypatch.delenv("MEMCLI_CACHE_DIR")
    assert fetch.default_cache_dir().parts[-2:] == (".cache", "memcli")


def test_unreachable_index_is_a_network_error(tmp_path, monkeypatch):
    pip = FakePip(1, "ERROR: Could not find a version that satisfies the requirement sglang==0.5.5 (from versions: none)")
    monkeypatch.setattr(fetch.subprocess, "run", pip)
    with pytest.raises(ReferenceFetchError) as info:
        fetch_wheel(tmp_path)
    assert info.value.network and isinstance(info.value, MemcliError)
    assert "pip download sglang==0.5.5 failed" in info.value.message and "index" in info.value.hint


def test_other_pip_failures_are_not_network_errors(tmp_path, monkeypatch):
    monkeypatch.setattr(fetch.subprocess, "run", FakePip(2, "ERROR: unknown option --only-binary"))
    with pytest.raises(ReferenceFetchError) as info:
        fetch_wheel(tmp_path)
    assert not info.value.network and info.value.hint


def test_extract_unpacks_only_the_subset(tmp_path):
    wheel = tmp_path / WHEEL
    _write_fake_wheel(wheel)
    root = extract(wheel, tmp_path)
    assert (root / "sglang/srt/mem_cache/x.py").is_file()
    assert (root / "sglang/srt/managers/schedule_batch.py").is_file()
    assert not (root / "sglang/srt/models").exists()
    assert extract(wheel, tmp_path) == root  # idempotent


def test_extract_rejects_a_wheel_missing_a_file(tmp_path):
    wheel = tmp_path / WHEEL
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr("sglang/srt/mem_cache/radix_cache.py", "")
    with pytest.raises(ReferenceFetchError, match="has no"):
        extract(wheel, tmp_path)


def test_versions_have_their_own_wheel_and_pip_arguments(tmp_path, monkeypatch):
    spec = fetch.wheel_spec(fetch.SGLANG_0523)
    cmd = fetch._pip_command(tmp_path, spec)
    assert "sglang==0.5.23" in cmd and cmd[cmd.index("--platform") + 1] == "manylinux_2_34_x86_64"
    monkeypatch.setattr(fetch.sys, "version_info", (3, 12, 0))
    cmd = fetch._pip_command(tmp_path, spec)
    assert cmd[cmd.index("--python-version") + 1] == "3.11"
    assert "only" in fetch.interpreter_mismatch(fetch.SGLANG_0523)
    assert fetch.interpreter_mismatch(fetch.SGLANG_VERSION) is None
    with pytest.raises(ValueError, match="no SGLang reference"):
        fetch.wheel_spec("0.4.0")


def test_extract_leaves_out_the_skipped_members(tmp_path):
    wheel = tmp_path / "sglang-0.5.23-cp311-cp311-manylinux_2_34_x86_64.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        for name in ("sglang/__init__.py", "sglang/srt/rust_extensions/__init__.py",
                     "sglang/srt/rust_extensions/_server.cpython-311-x86_64-linux-gnu.so", "sglang/kernels/x.py"):
            zf.writestr(name, "")
    root = extract(wheel, tmp_path, fetch.SGLANG_0523)
    assert (root / "sglang/srt/rust_extensions/__init__.py").is_file()
    assert not (root / "sglang/srt/rust_extensions/_server.cpython-311-x86_64-linux-gnu.so").exists()
