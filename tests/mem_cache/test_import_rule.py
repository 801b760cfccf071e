"""mem_cache never calls back into the scheduler or the tools (imports go one way)."""

from pathlib import Path

import memcli.mem_cache
from tests.sched.test_import_rule import imported_modules

MEM_CACHE_DIR = Path(memcli.mem_cache.__file__).parent


def test_mem_cache_imports_nothing_from_sched_tools_or_cli():
    bad = ("memcli.sched", "memcli.tools", "memcli.cli")
    offenders = {
        f.name: [n for n in imported_modules(f) if any(n == b or n.startswith(b + ".") for b in bad)]
        for f in sorted(MEM_CACHE_DIR.glob("*.py"))
    }
    assert {name: mods for name, mods in offenders.items() if mods} == {}
