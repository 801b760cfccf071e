"""The points of a study: `--sweep KEY=v1,v2,...` (repeatable) and `--sweep-file FILE`.

A point is an ordered mapping `{"section.key": value}` of config overrides. Repeated
`--sweep` options give the product of their values, the first key outermost:

    --sweep memory.max_total_tokens=1e6,2e6 --sweep cache.eviction_policy=lru,lfu
    -> (1e6, lru), (1e6, lfu), (2e6, lru), (2e6, lfu)

A sweep file is a YAML list of mappings, one point each, for studies that are not a product
(keys dotted, `memory.page_size: 16`, or nested, `memory: {page_size: 16}`). With both, every
file point is combined with every `--sweep` point. Values are read as YAML and checked by the
config itself when the point's config is built (`Study.configs`), before anything runs.
"""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import yaml

from memcli.config import GIB, SECTIONS, Config, parse_override
from memcli.errors import MemcliError
from memcli.mem_cache.pages import align_down

Point = dict[str, Any]
# Setting one of two alternative pool-size keys clears the other.
_ALTERNATIVES = {"memory.max_total_tokens": "memory.kv_budget_gib", "memory.kv_budget_gib": "memory.max_total_tokens"}
SWEEP_USAGE = ("for example --sweep memory.max_total_tokens=100000,200000 --sweep cache.eviction_policy=lru,lfu,"
               " or a --sweep-file with one mapping of overrides per point")


@dataclass(frozen=True)
class SweepSpec:
    """One `--sweep KEY=v1,v2,...`: a dotted config key and its values, in order."""

    key: str
    values: tuple[Any, ...]


def parse_sweep(text: str) -> SweepSpec:
    """`memory.max_total_tokens=100000,200000` -> SweepSpec; values are read as YAML."""
    if "=" not in text:
        raise MemcliError(f"--sweep {text!r}: expected KEY=v1,v2,...", SWEEP_USAGE)
    key, _, raw = text.partition("=")
    (section, name), _ = parse_override(f"{key.strip()}=0")
    parts = [part.strip() for part in raw.split(",")]
    if not all(parts):
        raise MemcliError(f"--sweep {text!r}: empty value in the list", SWEEP_USAGE)
    values = tuple(parse_override(f"{section}.{name}={part}")[1] for part in parts)
    if len(set(map(_canonical, values))) < len(values):
        raise MemcliError(f"--sweep {text!r}: a value is given twice", "give each value once")
    return SweepSpec(f"{section}.{name}", values)


def read_sweep_file(path: Path) -> list[Point]:
    """The points of a sweep file (see the module docstring); `MemcliError` names the file,
    the line and the fix for anything else."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise MemcliError(f"cannot read --sweep-file {path}: {exc.strerror}", "pass an existing YAML file") from None
    except UnicodeDecodeError:
        raise MemcliError(f"--sweep-file {path}: not UTF-8 text", "pass a YAML text file") from None
    try:
        root = yaml.compose(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark is not None else str(path)
        raise MemcliError(f"{where}: not valid YAML ({getattr(exc, 'problem', None) or exc})",
                          "write a YAML list with one mapping of overrides per point") from None
    example = "for example:\n- {memory.max_total_tokens: 1000000, cache.eviction_policy: lru}\n- {memory.page_size: 16}"
    if not isinstance(root, yaml.SequenceNode) or not root.value:
        line = f":{root.start_mark.line + 1}" if root is not None else ""
        raise MemcliError(f"{path}{line}: a sweep file is a non-empty YAML list of points", example)
    points = []
    for node in root.value:
        where = f"{path}:{node.start_mark.line + 1}"
        value = yaml.safe_load(yaml.serialize(node))
        if not isinstance(value, dict) or not value:
            raise MemcliError(f"{where}: a point is a non-empty mapping of config overrides, got {value!r}", example)
        points.append(_flatten(value, where))
    seen = set()
    for node, point in zip(root.value, points):
        key = point_key(point)
        if key in seen:
            raise MemcliError(f"{path}:{node.start_mark.line + 1}: point {point_label(point)} is listed twice",
                              "list each point once")
        seen.add(key)
    return points


def _flatten(mapping: dict, where: str) -> Point:
    out: Point = {}
    for key, value in mapping.items():
        if isinstance(value, dict) and key in SECTIONS:
            items = [(f"{key}.{name}", v) for name, v in value.items()]
        else:
            items = [(str(key), value)]
        for dotted, v in items:
            parts = dotted.split(".")
            if len(parts) != 2 or parts[0] not in SECTIONS:
                raise MemcliError(f"{where}: {dotted!r} is not a config key (section.key)",
                                  f"sections: {', '.join(SECTIONS)}")
            out[dotted] = v
    return out


def grid_points(sweeps: list[SweepSpec], file_points: Optional[list[Point]] = None) -> list[Point]:
    """Every file point (or one empty point) times the product of the `--sweep` values."""
    keys = [spec.key for spec in sweeps]
    if len(set(keys)) < len(keys):
        raise MemcliError(f"--sweep: key {next(k for k in keys if keys.count(k) > 1)} is swept twice",
                          "give each key once, with all its values: --sweep KEY=v1,v2")
    file_keys = {key for point in file_points or [] for key in point}
    both = file_keys & set(keys)
    if both:
        raise MemcliError(f"{sorted(both)[0]} is set both by --sweep and by the --sweep-file",
                          "set each key in one place")
    base = file_points or [{}]
    product = list(itertools.product(*(spec.values for spec in sweeps)))
    return [{**point, **dict(zip(keys, values))} for point in base for values in product]


def point_overrides(point: Point, base: Config) -> list[str]:
    """`--set` overrides that select `point`. A pool-size value also clears the alternative
    key, and shortens `memory.max_context_len` to the pool when it is longer (every request
    is still checked against both before the replay), unless the point sets those itself."""
    extra = [f"{key}={_yaml(value)}" for key, value in point.items()]
    page_size = point.get("memory.page_size", base.page_size)
    for key, value in point.items():
        other = _ALTERNATIVES.get(key)
        if other is None or other in point:
            continue
        extra.append(f"{other}=null")
        pool = _pool_tokens(key, value, base, page_size)
        if pool is not None and 0 < pool < base.memory.max_context_len and "memory.max_context_len" not in point:
            extra.append(f"memory.max_context_len={pool}")
    return extra


def _pool_tokens(key: str, value: Any, base: Config, page_size: Any) -> Optional[int]:
    if type(value) not in (int, float) or type(page_size) is not int or page_size < 1:
        return None  # not a size: the config validation names the problem
    tokens = int(value) if key == "memory.max_total_tokens" else int(value * GIB // base.model.bytes_per_token)
    return align_down(tokens, page_size)


def _yaml(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (list, dict)):
        return json.dumps(value)
    return str(value)


def _canonical(value: Any) -> str:
    return json.dumps(value, sort_keys=True, default=str)


def point_key(point: Point) -> str:
    """The identity of a point (order of keys ignored): how `--resume` recognises it."""
    return json.dumps({key: point[key] for key in sorted(point)}, sort_keys=True, default=str)


def point_label(point: Point) -> str:
    """`memory.page_size=16, cache.eviction_policy=lru` (the key's section left out when unique)."""
    return ", ".join(f"{short_key(key, point)}={_yaml(value)}" for key, value in point.items()) or "base config"


def short_key(key: str, keys) -> str:
    """`cache.eviction_policy` -> `eviction_policy` unless another key ends the same way."""
    name = key.split(".", 1)[-1]
    return key if sum(1 for k in keys if k.split(".", 1)[-1] == name) > 1 else name
