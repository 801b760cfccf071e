"""The layering, as rules on import statements, checked over the real tree.

    cli -> tools/<tool> -> engines (the registry) -> sglang-0.5.5: sched, stack -> mem_cache -> kernels
                        -> workload, config, capacity, steps, devices, reference
    reference: SGLang's own code and the side-by-side run, imported by tools; imports no tool
    report: generic helpers, imported by tools; imports no tool
    check_result, errors: vocabularies every layer may import

No cycle between packages (`mem_cache/integrity` counts as a package of its own, so it
imports no other module of mem_cache), nor between the modules of `mem_cache`;
`TYPE_CHECKING` and function-level imports count like the others.

Each rule is also shown to fail on a tree that breaks it, so none of them can pass vacuously.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# Modules of mem_cache that the schedulers and the tools may import: the memory managers (SGLang's, vLLM's) and their
# value types (the page arithmetic, the KV events, the integrity checks' results).
MEMORY_FACE = ("manager", "block_manager", "pages", "kv_events", "integrity")
# Component benchmarks time one component on its own, so they build it directly.
COMPONENT_BENCHES = {"memcli.tools.bench_radix": ("radix_cache", "base_prefix_cache"),
                     "memcli.tools.bench_one_batch.host_tier_bench": ("host_pool",)}
# What the registry offers (`from memcli.engines import get`); any other lower-case name under
# memcli.engines is an engine's own module.
REGISTRY_NAMES = ("get", "names", "register", "unregister")
# What only an engine may import: its scheduling policy and its stack builder.
ENGINE_INSIDES = ("memcli.sched", "memcli.stack", "memcli.vllm_sched")


def module_name(path: Path, root: Path) -> str:
    """`memcli/tools/replay/runner.py` -> `memcli.tools.replay.runner`; kernels/ is memcli.kernels."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[0] == "kernels":
        parts.insert(0, "memcli")
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(path: Path, module: str) -> list[str]:
    """Every module a file imports, at any depth (function-level imports too), made absolute."""
    names = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
                package = package[: len(package) - node.level + 1]
                base = ".".join([*package, base]) if base else ".".join(package)
            names.append(base)
            names.extend(f"{base}.{alias.name}" for alias in node.names)
    return ["memcli.kernels" + n[len("kernels"):] if n == "kernels" or n.startswith("kernels.") else n for n in names]


def import_graph(root: Path) -> dict[str, list[str]]:
    files = [*(root / "memcli").rglob("*.py"), *(root / "kernels").rglob("*.py")]
    return {module_name(f, root): imports_of(f, module_name(f, root)) for f in files}


def within(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def package_of(module: str) -> str:
    """The unit of the layering: `memcli.tools.<tool>`, `memcli.<subpackage>`, or the module."""
    parts = module.split(".")
    if parts[:2] == ["memcli", "tools"] and len(parts) > 2:
        return ".".join(parts[:3])
    if parts[:3] == ["memcli", "mem_cache", "integrity"]:
        return "memcli.mem_cache.integrity"
    return ".".join(parts[:2])


def rule_violations(graph: dict[str, list[str]]) -> list[str]:
    out = [f"{module} imports {name}: {problem}"
           for module, names in graph.items() for name in names
           if (problem := _problem(module, name))]
    return out + cycle_violations(graph) + module_cycle_violations(graph)


def _problem(module: str, name: str) -> str | None:
    if within(module, "memcli.kernels") and within(name, "memcli") and not within(name, "memcli.kernels"):
        return "kernels import nothing of memcli"
    if module in ("memcli.mem_cache.allocator", "memcli.mem_cache.pools") and within(name, "memcli.mem_cache.integrity"):
        return "the allocator and the request table tell an observer; they import nothing of integrity"
    if within(module, "memcli.mem_cache"):
        for bad in ("memcli.sched", "memcli.tools", "memcli.cli", "memcli.report", "memcli.stack", "rich"):
            if within(name, bad):
                return "mem_cache imports no scheduler, tool, CLI, report or rich"
    if within(module, "memcli.sched") or within(module, "memcli.vllm_sched") or within(module, "memcli.tools") \
            or within(module, "memcli.cli"):
        if within(name, "memcli.mem_cache") and name != "memcli.mem_cache":
            sub = name.split(".")[2]
            allowed = next((subs for home, subs in COMPONENT_BENCHES.items() if within(module, home)), ())
            if sub not in MEMORY_FACE and sub not in allowed:
                return f"sched and tools reach memory only through {', '.join(MEMORY_FACE)}"
    if within(module, "memcli.tools") or within(module, "memcli.cli"):
        if within(name, "memcli.kernels"):
            return "tools reach kernels only through memory"
        engine_module = within(name, "memcli.engines") and name.split(".")[2:3] not in ([], ["base"]) \
            and name.split(".")[2][:1].islower() and name.split(".")[2] not in REGISTRY_NAMES
        if any(within(name, inside) for inside in ENGINE_INSIDES) or engine_module:
            return "tools reach an engine only through the registry (memcli.engines)"
    if within(module, "memcli.sched"):
        for bad in ("memcli.kernels", "memcli.stack", "memcli.tools", "memcli.cli", "memcli.engines", "rich"):
            if within(name, bad):
                return "sched imports no kernels, stack builder, tool, CLI or rich"
    if within(module, "memcli.reference") and (within(name, "memcli.tools") or within(name, "memcli.cli")):
        return "reference imports no tool or CLI"
    if within(module, "memcli.report") and (within(name, "memcli.tools") or within(name, "memcli.cli")):
        return "report helpers import no tool"
    if within(name, "memcli.cli") and not (within(module, "memcli.cli") or module == "memcli.__main__"):
        return "only the CLI package imports the CLI's typer functions"
    return None


def cycle_violations(graph: dict[str, list[str]]) -> list[str]:
    """Cycles between packages (a package's imports of its own modules do not count)."""
    edges: dict[str, set[str]] = {}
    for module, names in graph.items():
        src = package_of(module)
        for name in names:
            if within(name, "memcli") and name not in ("memcli",):
                dst = package_of(name)
                if dst != src and any(within(m, dst) for m in graph):
                    edges.setdefault(src, set()).add(dst)
    return ["cycle: " + cycle for cycle in cycles(edges)]


def module_cycle_violations(graph: dict[str, list[str]]) -> list[str]:
    """Cycles between the modules of `memcli.mem_cache` (a package counts as its `__init__`)."""
    edges: dict[str, set[str]] = {}
    for module, names in graph.items():
        if within(module, "memcli.mem_cache"):
            edges[module] = {name for name in names
                             if within(name, "memcli.mem_cache") and name in graph and name != module}
    return ["module cycle: " + cycle for cycle in cycles(edges)]


def cycles(edges: dict[str, set[str]]) -> list[str]:
    """`a -> b -> a` for each back edge a depth-first walk of `edges` meets (none: no cycle)."""
    out, state = [], {}

    def visit(node: str, stack: list[str]) -> None:
        state[node] = "open"
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == "open":
                out.append(" -> ".join(stack[stack.index(nxt):] + [nxt]))
            elif nxt not in state:
                visit(nxt, stack + [nxt])
        state[node] = "done"

    for node in sorted(edges):
        if node not in state:
            visit(node, [node])
    return out


def test_the_tree_keeps_every_rule():
    graph = import_graph(REPO)
    assert "memcli.sched.scheduler" in graph and "memcli.kernels.alloc" in graph
    assert rule_violations(graph) == []


def _plant(tmp_path: Path, files: dict[str, str]) -> dict[str, list[str]]:
    for rel, text in {"memcli/__init__.py": "", "kernels/__init__.py": "", **files}.items():
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return import_graph(tmp_path)


@pytest.mark.parametrize("files, expected", [
    ({"kernels/alloc.py": "from memcli.config import Config\n"}, "kernels import nothing of memcli"),
    ({"memcli/mem_cache/radix_cache.py": "from memcli.sched.req import Req\n"}, "mem_cache imports no scheduler"),
    ({"memcli/mem_cache/radix_cache.py": "def show():\n    from rich.tree import Tree\n"}, "mem_cache imports no scheduler"),
    ({"memcli/sched/batch.py": "from memcli.mem_cache.allocator import cdiv\n"}, "sched and tools reach memory only"),
    ({"memcli/tools/replay/runner.py": "from memcli.mem_cache.radix_cache import RadixCache\n"},
     "sched and tools reach memory only"),
    ({"memcli/tools/replay/runner.py": "from memcli.sched.scheduler import Scheduler\n"}, "only through the registry"),
    ({"memcli/tools/replay/runner.py": "from memcli.stack import build_stack\n"}, "only through the registry"),
    ({"memcli/tools/replay/runner.py": "from memcli.engines.sglang_055 import ENGINE\n"}, "only through the registry"),
    ({"memcli/tools/bench_one_batch/runner.py": "from memcli import kernels\n"}, "kernels only through memory"),
    ({"memcli/mem_cache/radix_cache.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
      "    from memcli.steps import StepRecord\n",
      "memcli/steps.py": "from memcli.mem_cache.radix_cache import RadixCache\n"}, "cycle: memcli.mem_cache -> memcli.steps"),
    ({"memcli/sched/batch.py": "import memcli.kernels\n"}, "sched imports no kernels"),
    ({"memcli/sched/batch.py": "from kernels.alloc import alloc_extend\n"}, "sched imports no kernels"),
    ({"memcli/report/tables.py": "from memcli.tools.replay.results import ReplayResult\n"}, "report helpers import no tool"),
    ({"memcli/tools/replay/runner.py": "from memcli.cli.app import app\n"}, "only the CLI package imports"),
    ({"memcli/reference/observe.py": "def run():\n    from memcli.tools.replay.runner import replay\n"},
     "reference imports no tool"),
    ({"memcli/sched/req.py": "from memcli.workload import spec\n",
      "memcli/workload/spec.py": "from memcli.sched.req import Req\n"}, "cycle: memcli.sched -> memcli.workload -> memcli.sched"),
    ({"memcli/sched/req.py": "from ..mem_cache import allocator\n"}, "sched and tools reach memory only"),
    ({"memcli/mem_cache/pools.py": "from memcli.mem_cache.integrity.ownership import FREE\n"},
     "the allocator and the request table tell an observer"),
    ({"memcli/mem_cache/radix_cache.py": "from memcli.mem_cache.integrity.owners import TREE\n",
      "memcli/mem_cache/integrity/requests.py": "from memcli.mem_cache.pages import cdiv\n"},
     "cycle: memcli.mem_cache -> memcli.mem_cache.integrity -> memcli.mem_cache"),
    ({"memcli/mem_cache/integrity/__init__.py": "from memcli.mem_cache.integrity import radix\n",
      "memcli/mem_cache/integrity/radix.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                              "    from memcli.mem_cache.radix_cache import RadixCache\n",
      "memcli/mem_cache/radix_cache.py": "from memcli.mem_cache.integrity import IntegrityReport\n"},
     "module cycle: memcli.mem_cache.integrity -> memcli.mem_cache.integrity.radix -> memcli.mem_cache.radix_cache"),
    ({"memcli/mem_cache/radix_cache.py": "from memcli.mem_cache.tree_checks import radix_checks\n",
      "memcli/mem_cache/tree_checks.py": "def walk():\n    from memcli.mem_cache.radix_cache import RadixCache\n"},
     "module cycle: memcli.mem_cache.radix_cache -> memcli.mem_cache.tree_checks -> memcli.mem_cache.radix_cache"),
])
def test_each_rule_fails_on_a_planted_violation(tmp_path, files, expected):
    violations = rule_violations(_plant(tmp_path, files))
    assert any(expected in v for v in violations), violations


def test_a_clean_planted_tree_passes(tmp_path):
    graph = _plant(tmp_path, {"memcli/sched/batch.py": "from memcli.mem_cache import manager\n",
                              "memcli/tools/replay/runner.py": "from memcli import engines\n",
                              "memcli/mem_cache/manager.py": "import torch\nfrom memcli.kernels import alloc\n",
                              "kernels/alloc.py": "import triton\n"})
    assert rule_violations(graph) == []
