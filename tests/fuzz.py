"""Fuzz the inputs memcli reads: `python -m tests.fuzz --count 10000` (from the repository root).

Four kinds of input, in turn: random bytes as a config file, random YAML configs (keys mostly
from the schema, values of every type, NaN and infinities included), random trace files
(random bytes and random JSON lines in both formats) and random `--set` strings given to the
CLI through typer's `CliRunner`. Anything but a `MemcliError` from the loaders, or a CLI run
that ends other than exit 0/1/2 without an `internal error` line, counts as a traceback.
Prints the count per kind (target 0) and the first few failing inputs; exit 1 if any.

A test harness, not a command: tests/test_fuzz.py runs its generators one input at a time, and
the script above runs many (no memcli module imports it).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import tempfile
import traceback
from dataclasses import fields
from pathlib import Path
from typing import Any, Callable

import yaml

from memcli.config import Config, load_config
from memcli.errors import MemcliError

SCHEMA = {s.name: [f.name for f in fields(s.default_factory)] for s in fields(Config)}
WORDS = ["radix", "chunk", "none", "lru", "lfu", "fifo", "cpu", "cuda", "auto", "torch", "triton", "indices",
         "materialized", "bfloat16", "float32", "fcfs", "lpm", "memcli", "sglang-0.5.5", "", "null", "~", "yes"]
TRACE_KEYS = ["rid", "input_ids", "input_len", "prefix", "output_len", "arrival_ms", "extra_key", "input_length",
              "output_length", "hash_ids", "timestamp", "chat_id", "turn", "len", "bogus"]


def random_scalar(rng: random.Random) -> Any:
    kind = rng.randrange(10)
    if kind == 0:
        return rng.choice([math.nan, math.inf, -math.inf, -0.0, 1e308, 5e-324])
    if kind == 1:
        return rng.choice([-1, 1]) * 10 ** rng.randrange(40)
    if kind == 2:
        return rng.randrange(-3, 200)
    if kind == 3:
        return rng.uniform(-10, 10)
    if kind == 4:
        return rng.choice([True, False, None])
    if kind == 5:
        return "".join(rng.choice("ab01.-=:{}[]#&*!|>'\"%@` \n\t\u00e9\u2603") for _ in range(rng.randrange(8)))
    return rng.choice(WORDS) if kind < 8 else 2 ** rng.randrange(8)


def random_value(rng: random.Random, depth: int = 0) -> Any:
    roll = rng.randrange(12)
    if depth < 2 and roll == 0:
        return [random_value(rng, depth + 1) for _ in range(rng.randrange(4))]
    if depth < 2 and roll == 1:
        return {random_scalar(rng) if rng.random() < 0.3 else rng.choice(WORDS): random_value(rng, depth + 1)
                for _ in range(rng.randrange(3))}
    return random_scalar(rng)


def random_config(rng: random.Random) -> Any:
    if rng.random() < 0.05:
        return random_value(rng)
    raw: dict[Any, Any] = {}
    for _ in range(rng.randrange(1, 4)):
        section = rng.choice(list(SCHEMA)) if rng.random() < 0.95 else random_scalar(rng)
        if rng.random() < 0.05:
            raw[section] = random_value(rng)
            continue
        keys = SCHEMA.get(section, WORDS)
        raw[section] = {(rng.choice(keys) if rng.random() < 0.95 else random_scalar(rng)): random_value(rng)
                        for _ in range(rng.randrange(1, 4))}
    return raw


def _dump_yaml(rng: random.Random, raw: Any) -> bytes:
    try:
        text = yaml.safe_dump(raw, allow_unicode=True)
    except yaml.YAMLError:
        text = str(raw)
    if rng.random() < 0.2:  # mutate: drop, insert or swap characters
        chars = list(text)
        for _ in range(rng.randrange(1, 6)):
            i = rng.randrange(len(chars) + 1)
            op = rng.randrange(3)
            if op == 0 and i < len(chars):
                del chars[i]
            else:
                chars.insert(i, rng.choice(":-[]{}!&*|>'\"#%\n \t"))
        text = "".join(chars)
    return text.encode("utf-8", "surrogatepass")


def random_bytes(rng: random.Random) -> bytes:
    return bytes(rng.randrange(256) for _ in range(rng.randrange(64)))


def random_trace_line(rng: random.Random) -> str:
    if rng.random() < 0.5:
        obj: dict[str, Any] = {"input_length": rng.choice([rng.randrange(-2, 2000), random_scalar(rng)]),
                               "output_length": rng.choice([rng.randrange(-2, 50), random_scalar(rng)]),
                               "hash_ids": rng.choice([list(range(rng.randrange(5))), random_value(rng)])}
        if rng.random() < 0.5:
            obj["timestamp"] = rng.choice([rng.randrange(0, 10_000), random_scalar(rng)])
    else:
        obj = {"rid": rng.choice([f"r{rng.randrange(5)}", random_scalar(rng)]),
               "output_len": rng.choice([rng.randrange(-1, 50), random_scalar(rng)])}
        pick = rng.randrange(3)
        if pick == 0:
            obj["input_ids"] = rng.choice([[rng.randrange(-1, 2**32) for _ in range(rng.randrange(5))],
                                           random_value(rng)])
        elif pick == 1:
            obj["input_len"] = rng.choice([rng.randrange(-1, 5000), random_scalar(rng)])
        else:
            obj["prefix"] = random_value(rng)
            obj["input_len"] = rng.randrange(0, 100)
    for _ in range(rng.randrange(2) if rng.random() < 0.3 else 0):
        obj[rng.choice(TRACE_KEYS)] = random_value(rng)
    if rng.random() < 0.05:
        return json.dumps(random_value(rng))
    return json.dumps(obj)


def random_trace(rng: random.Random) -> bytes:
    if rng.random() < 0.15:
        return random_bytes(rng)
    lines = [random_trace_line(rng) if rng.random() < 0.9 else "" for _ in range(rng.randrange(1, 6))]
    return "\n".join(lines).encode()


def random_set(rng: random.Random) -> str:
    section = rng.choice(list(SCHEMA)) if rng.random() < 0.9 else str(random_scalar(rng))
    key = rng.choice(SCHEMA.get(section, WORDS)) if rng.random() < 0.9 else str(random_scalar(rng))
    value = rng.choice([str(random_scalar(rng)), json.dumps(random_value(rng)), ".nan", ".inf", "-5", "1e400",
                        "[1, 2", "{a: b}", "!!python/object:os.system", "&a [*a]", "2001-13-45"])
    sep = rng.choice(["=", "=", "=", "", "==", " = "])
    dotted = rng.choice([f"{section}.{key}", f"{section}.{key}", section, f"{section}.{key}.x", f".{key}"])
    return f"{dotted}{sep}{value}"


def _load_config_file(data: bytes, work: Path) -> None:
    path = work / "config.yaml"
    path.write_bytes(data)
    try:
        load_config(path)
    except MemcliError:
        pass


def check_config_bytes(rng: random.Random, work: Path) -> str:
    data = random_bytes(rng)
    _load_config_file(data, work)
    return repr(data)


def check_config_yaml(rng: random.Random, work: Path) -> str:
    data = _dump_yaml(rng, random_config(rng))
    _load_config_file(data, work)
    return data.decode("utf-8", "replace")


def check_trace(rng: random.Random, work: Path) -> str:
    from memcli.capacity import check_fits
    from memcli.workload.readers import read_trace

    data = random_trace(rng)
    path = work / "trace.jsonl"
    path.write_bytes(data)
    try:
        trace = read_trace(path, format=rng.choice(["auto", "auto", "memcli", "mooncake"]),
                           block_size=rng.choice([1, 16, 512]))
        check_fits(load_config(None, ["memory.max_total_tokens=4096", "memory.max_context_len=2048"],
                               builtin="replay"), trace.requests, trace.path)
    except MemcliError:
        pass
    return data.decode("utf-8", "replace")


def check_cli_set(rng: random.Random, work: Path) -> str:
    from typer.testing import CliRunner

    from memcli.cli.app import app
    from memcli.cli.guard import INTERNAL_ERROR

    args = ["show-config", "--json"]
    for _ in range(rng.randrange(1, 4)):
        args += ["--set", random_set(rng)]
    result = CliRunner().invoke(app, args)
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    if result.exit_code not in (0, 1, 2) or INTERNAL_ERROR in result.output:
        raise AssertionError(f"exit {result.exit_code}: {result.output[-300:]}")
    return repr(args)


CHECKS: dict[str, Callable[[random.Random, Path], str]] = {
    "config bytes": check_config_bytes,
    "config yaml": check_config_yaml,
    "trace": check_trace,
    "cli --set": check_cli_set,
}


def run(count: int, seed: int, show: int = 3) -> dict[str, list[int]]:
    """Run `count` inputs (spread over `CHECKS`); returns `{kind: [inputs, tracebacks]}`."""
    counts = {name: [0, 0] for name in CHECKS}
    shown = 0
    names = list(CHECKS)
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(count):
            name = names[i % len(names)]
            rng = random.Random(f"{seed}-{i}")
            counts[name][0] += 1
            try:
                CHECKS[name](rng, Path(tmp))
            except Exception:  # noqa: BLE001 - the point: count what escapes
                counts[name][1] += 1
                if shown < show:
                    shown += 1
                    print(f"--- {name}, input {i} (seed {seed}):", file=sys.stderr)
                    traceback.print_exc(limit=3)
    return counts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.fuzz", description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=10_000, help="inputs to run (default 10,000)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    counts = run(args.count, args.seed)
    for name, (inputs, bad) in counts.items():
        print(f"{name:14} {inputs:7,} inputs {bad:5,} tracebacks")
    total = sum(bad for _, bad in counts.values())
    print(f"{'total':14} {sum(n for n, _ in counts.values()):7,} inputs {total:5,} tracebacks")
    return 1 if total else 0


if __name__ == "__main__":
    sys.exit(main())
