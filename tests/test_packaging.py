"""The package layout: kernels/ ships as memcli.kernels, configs ship inside the package."""

import subprocess
import sys
from pathlib import Path

from typer.testing import CliRunner

import memcli.kernels
from memcli.cli.app import app
from memcli.config import builtin_config_text

REPO = Path(__file__).resolve().parents[1]


def test_kernels_folder_is_memcli_kernels():
    origin = Path(memcli.kernels.__file__).resolve().parent
    assert origin.name == "kernels"
    for name in ("alloc_extend_write", "alloc_decode_write", "alloc_decode_step", "store_kv"):
        assert callable(getattr(memcli.kernels, name)), name


def test_kernel_modules_never_import_memcli():
    for path in (REPO / "kernels").glob("*.py"):
        text = path.read_text()
        assert "import memcli" not in text and "from memcli" not in text, path.name


def test_builtin_default_config_ships_with_the_package():
    assert "page_size" in builtin_config_text("default")


def test_help_and_python_dash_m():
    result = CliRunner().invoke(app, ["--help"])
    assert result.exit_code == 0 and "show-config" in result.stdout
    proc = subprocess.run([sys.executable, "-m", "memcli", "--help"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "Usage" in proc.stdout


def test_every_package_folder_is_listed_for_a_normal_install():
    import tomllib

    listed = set(tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    folders = {".".join(p.parent.relative_to(REPO).parts) for p in (REPO / "memcli").rglob("__init__.py")}
    assert folders - listed == set()
