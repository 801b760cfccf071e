"""The scheduler reaches memory only through mem_cache.common and the prefix-cache interface."""

import ast
from pathlib import Path

import memcli.sched

SCHED_DIR = Path(memcli.sched.__file__).parent
FORBIDDEN = (
    "memcli.mem_cache.allocator",
    "memcli.mem_cache.pools",
    "memcli.kernels",
    "kernels",
    "memcli.stack",
)


def imported_modules(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            names.append(module)
            names.extend(f"{module}.{alias.name}" for alias in node.names)
    return names


def is_forbidden(name: str) -> bool:
    return any(name == bad or name.startswith(bad + ".") for bad in FORBIDDEN)


def test_sched_imports_nothing_from_allocator_pools_or_kernels():
    files = sorted(SCHED_DIR.glob("*.py"))
    assert files, "no scheduler modules found"
    offenders = {
        f.name: [n for n in imported_modules(f) if is_forbidden(n)] for f in files
    }
    offenders = {k: v for k, v in offenders.items() if v}
    assert offenders == {}


def test_rule_detects_a_forbidden_import(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("from memcli.mem_cache.allocator import TokenToKVPoolAllocator\nimport memcli.kernels\n")
    assert [n for n in imported_modules(bad) if is_forbidden(n)] == [
        "memcli.mem_cache.allocator",
        "memcli.mem_cache.allocator.TokenToKVPoolAllocator",
        "memcli.kernels",
    ]
