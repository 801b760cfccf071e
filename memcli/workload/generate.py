"""Synthetic memcli traces: shared system prompts, multi-turn chats, Poisson arrivals.

The shape of a generated trace (deterministic for a seed):

- `system_prompts` random system prompts of `system_prompt_len` tokens each.
- Chats of `turns` turns. A chat picks one system prompt; turn 1's input is that prompt
  plus a user message; turn t+1's input is turn t's input, then a reply as long as turn t's
  output_len, then a new user message. Later turns therefore extend earlier ones exactly.
- `active_chats` chats are open at once; each arrival continues a random open chat (a new
  chat opens when one ends), so turns of different chats interleave as in real traffic.
- Message, reply and output lengths are uniform in [1, 2 * mean - 1] (mean `input_len`
  or `output_len`); arrivals are a Poisson process of `rate` requests per second (rate 0:
  no arrival times).

Requests carry explicit `input_ids`, so the sharing in the file is exact.
"""

from __future__ import annotations

import bisect
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Optional

import numpy as np

from memcli.errors import MemcliError

Progress = Callable[[int], None]  # called with the number of requests done so far
PROGRESS_EVERY = 256


def generate_trace(
    num_requests: int,
    seed: int = 0,
    *,
    system_prompts: int = 4,
    system_prompt_len: int = 1024,
    turns: int = 3,
    input_len: int = 256,
    output_len: int = 128,
    rate: float = 4.0,
    active_chats: int = 8,
    vocab_size: int = 32000,
    progress: Optional[Progress] = None,
) -> list[dict[str, Any]]:
    """Memcli-format request records in arrival order. Raises `MemcliError` on bad parameters.

    Each record is `{"rid", "input_ids", "output_len"[, "arrival_ms"]}`; rids read
    `chat<C>-turn<T>`. Same arguments, same records. `progress(done)` is called every few
    hundred requests.
    """
    _check_params(rate, requests=num_requests, seed=seed, system_prompts=system_prompts,
                  system_prompt_len=system_prompt_len, turns=turns, input_len=input_len,
                  output_len=output_len, active_chats=active_chats, vocab_size=vocab_size)
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(0, vocab_size, system_prompt_len) for _ in range(system_prompts)]
    arrivals_ms = np.cumsum(rng.exponential(1000.0 / rate, num_requests)) if rate > 0 else None
    open_chats: list[_Chat] = []
    num_chats = 0
    records = []
    for i in range(num_requests):
        while len(open_chats) < active_chats:
            prompt = prompts[rng.integers(system_prompts)] if system_prompts else np.zeros(0, dtype=np.int64)
            open_chats.append(_Chat(num_chats, prompt))
            num_chats += 1
        chat = open_chats[rng.integers(len(open_chats))]
        ids = np.concatenate([chat.history, rng.integers(0, vocab_size, _length(rng, input_len))])
        out_len = _length(rng, output_len)
        record: dict[str, Any] = {
            "rid": f"chat{chat.chat_id}-turn{chat.turn}",
            "input_ids": ids.tolist(),
            "output_len": out_len,
        }
        if arrivals_ms is not None:
            record["arrival_ms"] = round(float(arrivals_ms[i]), 3)
        records.append(record)
        chat.history = np.concatenate([ids, rng.integers(0, vocab_size, out_len)])
        chat.turn += 1
        if chat.turn > turns:
            open_chats.remove(chat)
        _tick(progress, i + 1)
    _tick(progress, num_requests, last=True)
    return records


def _tick(progress: Optional[Progress], done: int, last: bool = False) -> None:
    if progress is not None and (last or done % PROGRESS_EVERY == 0):
        progress(done)


class _Chat:
    """An open conversation: the tokens every later turn starts with."""

    __slots__ = ("chat_id", "history", "turn")

    def __init__(self, chat_id: int, prompt: np.ndarray):
        self.chat_id = chat_id
        self.history = prompt
        self.turn = 1


def _length(rng: np.random.Generator, mean: int) -> int:
    """Uniform in [1, 2 * mean - 1]: mean `mean`, never zero."""
    return int(rng.integers(1, 2 * mean))


def _check_params(rate: float, **counts: int) -> None:
    """Counts are at least 1 (seed and system_prompts at least 0); named by their gen-trace flag."""
    for name, value in counts.items():
        minimum = 0 if name in ("seed", "system_prompts") else 1
        label = name if name in _LIBRARY_ONLY else "--" + name.replace("_", "-")
        if type(value) is not int or value < minimum:
            raise MemcliError(
                f"{label} must be an integer >= {minimum}, got {value!r}",
                f"pass {label} {minimum} or more",
            )
    if not (rate >= 0 and np.isfinite(rate)):
        raise MemcliError(
            f"--rate must be a finite number >= 0, got {rate!r}",
            "requests per second; 0 writes no arrival times",
        )


_LIBRARY_ONLY = ("active_chats", "vocab_size")


def expected_tokens(num_requests: int, system_prompts: int, system_prompt_len: int, turns: int,
                    input_len: int, output_len: int) -> int:
    """Tokens a trace with these parameters holds on average (prompts written plus the system
    prompts kept while generating): a turn-t prompt holds the system prompt and t - 1 earlier
    exchanges plus its own message."""
    per_request = system_prompt_len + (turns + 1) / 2 * (input_len + output_len)
    return int(num_requests * per_request + system_prompts * system_prompt_len)


def check_trace_size(max_tokens: int, num_requests: int, **params: int) -> None:
    """Raise `MemcliError` when the trace would hold more than `max_tokens` tokens."""
    tokens = expected_tokens(num_requests, **params)
    if tokens > max_tokens:
        raise MemcliError(
            f"the trace would hold about {tokens:,} tokens (about {tokens * 6 / 1e9:,.1f} GB of JSON),"
            f" over --max-tokens {max_tokens:,}",
            "lower --requests, --system-prompt-len, --turns or the lengths, or raise --max-tokens explicitly",
        )


def _encode(record: dict[str, Any]) -> bytes:
    return json.dumps(record, separators=(",", ":")).encode() + b"\n"


def write_trace(records: Iterable[dict[str, Any]], path: str | Path, overwrite: bool = False,
                progress: Optional[Progress] = None) -> int:
    """Write records as JSONL (one compact object per line); returns the bytes written.

    Raises `MemcliError` if `path` exists and `overwrite` is false, or cannot be written.
    """
    path = Path(path)
    try:
        with path.open("wb" if overwrite else "xb") as fh:
            num_bytes = done = 0
            for done, record in enumerate(records, start=1):
                num_bytes += fh.write(_encode(record))
                _tick(progress, done)
            _tick(progress, done, last=True)
            return num_bytes
    except FileExistsError:
        raise MemcliError(f"{path} already exists", "pass --force to overwrite it, or choose another path") from None
    except OSError as exc:
        raise MemcliError(
            f"cannot write {path}: {exc.strerror}",
            "check that the folder exists and is writable",
        ) from None


def holds_trace(records: Iterable[dict[str, Any]], path: str | Path) -> bool:
    """Whether `path` is a file holding exactly the bytes `write_trace(records, path)` writes."""
    path = Path(path)
    if not path.is_file():
        return False
    with path.open("rb") as fh:
        for record in records:
            line = _encode(record)
            if fh.read(len(line)) != line:
                return False
        return fh.read(1) == b""


@dataclass(frozen=True)
class TraceSummary:
    """What a list of memcli records holds. `reusable_input_tokens`: see `prefix_reuse_tokens`."""

    num_requests: int
    input_tokens: int
    output_tokens: int
    max_input_len: int
    duration_ms: float | None
    reusable_input_tokens: int

    @property
    def mean_input_len(self) -> float:
        return self.input_tokens / self.num_requests

    @property
    def mean_output_len(self) -> float:
        return self.output_tokens / self.num_requests

    @property
    def reusable_fraction(self) -> float:
        return self.reusable_input_tokens / self.input_tokens


def summarize_records(records: list[dict[str, Any]], progress: Optional[Progress] = None) -> TraceSummary:
    """Totals of records with explicit `input_ids` (as `generate_trace` writes them)."""
    inputs = [np.asarray(r["input_ids"], dtype=np.int64) for r in records]
    arrivals = [r["arrival_ms"] for r in records if "arrival_ms" in r]
    return TraceSummary(
        num_requests=len(records),
        input_tokens=sum(len(ids) for ids in inputs),
        output_tokens=sum(r["output_len"] for r in records),
        max_input_len=max(len(ids) for ids in inputs),
        duration_ms=arrivals[-1] if arrivals else None,
        reusable_input_tokens=prefix_reuse_tokens(inputs, progress),
    )


def prefix_reuse_tokens(inputs: Iterable[np.ndarray], progress: Optional[Progress] = None) -> int:
    """Sum over requests of the longest prefix shared with any earlier request's input.

    The ceiling of an unlimited, token-granular prefix cache over inputs alone (no outputs
    inserted, a match may cover the whole prompt). Non-negative ids only. Inputs are kept
    sorted as big-endian bytes, so the closest earlier input is a sorted neighbour.
    """
    keys: list[bytes] = []
    total = done = 0
    for done, ids in enumerate(inputs, start=1):
        key = np.asarray(ids, dtype=">i8").tobytes()
        pos = bisect.bisect_left(keys, key)
        best = 0
        for neighbour in keys[max(pos - 1, 0) : pos + 1]:
            best = max(best, _common_prefix_len(key, neighbour))
        total += best
        keys.insert(pos, key)
        _tick(progress, done)
    _tick(progress, done, last=True)
    return total


def _common_prefix_len(a: bytes, b: bytes) -> int:
    n = min(len(a), len(b)) // 8
    x, y = np.frombuffer(a, ">i8", n), np.frombuffer(b, ">i8", n)
    diff = np.flatnonzero(x != y)
    return int(diff[0]) if len(diff) else n
