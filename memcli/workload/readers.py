"""Trace readers: Mooncake JSONL and memcli JSONL in, a validated `Trace` out.

Everything is checked while reading, before anything runs: the first bad line raises a
`TraceError` whose message starts with `FILE:LINE:` and whose hint says how to fix it.
Nothing is reordered or repaired: requests keep file order, and arrival times that go
backwards are an error. The formats are described in docs/TRACES.md.

A trace may be gzip- or zstd-compressed (told by its first bytes, whatever its name; zstd
needs the `zstandard` package), and `-` reads standard input. Line numbers count the
decompressed lines.
"""

from __future__ import annotations

import contextlib
import difflib
import gzip
import io
import json
import math
import sys
import zlib
from pathlib import Path
from typing import IO, Any, Callable, Iterator, NoReturn, Optional

import numpy as np

from memcli.errors import MemcliError, TraceError
from memcli.workload import FORMATS
from memcli.mem_cache.pages import cdiv
from memcli.workload.spec import SYNTHETIC_TOKEN_BASE, RequestSpec, Trace, TokenRun

MEMCLI_KEYS = ("rid", "input_ids", "input_len", "prefix", "output_len", "arrival_ms", "extra_key", "priority",
               "ignore_eos", "max_new_tokens")
PREFIX_KEYS = ("rid", "len")
MOONCAKE_REQUIRED = ("input_length", "output_length", "hash_ids")
# `timestamp` is optional (all lines or none), so is vLLM's `priority`; the Qwen-Bailian fields are accepted and
# not used, since the prefix sharing they describe is already in `hash_ids`.
MOONCAKE_OPTIONAL = ("timestamp", "chat_id", "parent_chat_id", "turn", "type", "priority")
MOONCAKE_KEYS = MOONCAKE_REQUIRED + MOONCAKE_OPTIONAL
DOCS = "see docs/TRACES.md"
_INT_ONLY = {int}
_MOONCAKE_KEY_SET = frozenset(MOONCAKE_KEYS)
_MEMCLI_KEY_SET = frozenset(MEMCLI_KEYS)
_decode_json = json.JSONDecoder().decode
MAX_TOKEN_COUNT = 2**31 - 1  # no request is longer (ranges and arrays of more cannot be built)
STDIN = "-"
STDIN_NAME = "<stdin>"
GZIP_MAGIC = b"\x1f\x8b"
ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
READABLE = "memcli reads JSONL traces, plain, gzip (.gz) or zstd (.zst)"
PROGRESS_EVERY = 2048  # requests between two progress reports
# progress(bytes read, file size or None, requests read); bytes of the file as stored (compressed)
ReadProgress = Callable[[int, Optional[int], int], None]


def read_trace(path: str | Path, format: str = "auto", block_size: int = 512, limit: int | None = None,
               progress: Optional[ReadProgress] = None) -> Trace:
    """Read and validate a whole trace (or its first `limit` requests, stopping early).

    `format` is "auto" (detected from the first non-empty line), "memcli" or "mooncake".
    `block_size` is the Mooncake hash-block size (512 for Mooncake, 16 for Qwen-Bailian) and
    the chunk size of memcli block hashes. `path` "-" reads standard input. Raises `TraceError`
    on the first bad line and `MemcliError` on bad arguments; returns only when every request
    read is valid. `progress` is called every few thousand requests and at the end.
    """
    path = Path(STDIN_NAME) if str(path) == STDIN else Path(path)
    _check_args(format, block_size, limit)
    requests: list[RequestSpec] = []
    parser = None
    arrivals = _ArrivalCheck()
    with _open(path) as (fh, where):
        for line in _lines(path, fh):
            if parser is None:
                parser = _make_parser(line, format, block_size)
            spec = parser.parse(line)
            arrivals.check(line, spec.arrival_ms, parser.arrival_key)
            requests.append(spec)
            if limit is not None and len(requests) == limit:
                break
            if progress is not None and len(requests) % PROGRESS_EVERY == 0:
                progress(*where(), len(requests))
        if progress is not None:
            progress(*where(), len(requests))
    if not requests:
        raise TraceError(f"{path}:1: the file holds no requests", f"a trace has one JSON object per line; {DOCS}")
    return Trace(path, parser.format, block_size, requests, tuple(sorted(parser.ignored)))


@contextlib.contextmanager
def _open(path: Path) -> Iterator[tuple[IO[bytes], Callable[[], tuple[int, Optional[int]]]]]:
    """The trace's bytes, decompressed when its first bytes say gzip or zstd, and `where()`:
    (bytes of the stored file read so far, its size or None). Standard input for `<stdin>`
    (left open). Raises `TraceError` when it cannot be opened."""
    if path == Path(STDIN_NAME):
        raw, close = sys.stdin.buffer, False
    else:
        try:
            raw, close = path.open("rb"), True
        except OSError as exc:
            raise TraceError(f"cannot read {path}: {exc.strerror}", "check the path") from None
    buffered = raw if hasattr(raw, "peek") else io.BufferedReader(raw)  # a test's stdin may not peek
    size = path.stat().st_size if close and path.is_file() else None

    def where() -> tuple[int, Optional[int]]:
        return (buffered.tell() if size is not None else 0), size

    try:
        head = buffered.peek(4)[:4]
        if head.startswith(GZIP_MAGIC):
            yield gzip.GzipFile(fileobj=buffered, mode="rb"), where
        elif head.startswith(ZSTD_MAGIC):
            yield _zstd_reader(path, buffered), where
        else:
            yield buffered, where
    finally:
        if buffered is not raw:
            buffered.detach()  # leaves `raw` open
        if close:
            raw.close()


def _zstd_reader(path: Path, raw: IO[bytes]) -> IO[bytes]:
    try:
        import zstandard
    except ImportError:
        raise TraceError(f"{path}: the trace is zstd-compressed, and the zstandard package is not installed",
                         f"pip install zstandard (or memcli[zst]); or decompress it first: zstd -d {path}") from None
    return io.BufferedReader(zstandard.ZstdDecompressor().stream_reader(raw, closefd=False))


def _decompression_errors() -> tuple[type[BaseException], ...]:
    errors: tuple[type[BaseException], ...] = (gzip.BadGzipFile, EOFError, zlib.error)
    zstandard = sys.modules.get("zstandard")
    return errors + ((zstandard.ZstdError,) if zstandard is not None else ())


def _check_args(format: str, block_size: int, limit: int | None) -> None:
    if format not in FORMATS:
        raise MemcliError(f'unknown trace format "{format}"', f"use one of: {', '.join(FORMATS)}")
    if type(block_size) is not int or block_size < 1:
        raise MemcliError(
            f"block size must be a positive integer, got {block_size!r}",
            "Mooncake uses 512, Qwen-Bailian 16",
        )
    if limit is not None and (type(limit) is not int or limit < 1):
        raise MemcliError(f"limit must be a positive integer, got {limit!r}", "leave it out to read every request")


class _Line:
    """One line of the file: where it is, and typed access to its fields with errors."""

    __slots__ = ("path", "no", "obj")

    def __init__(self, path: Path, no: int, obj: dict[str, Any]):
        self.path, self.no, self.obj = path, no, obj

    def fail(self, what: str, hint: str) -> NoReturn:
        raise TraceError(f"{self.path}:{self.no}: {what}", hint)

    def require(self, key: str, hint: str) -> Any:
        if key not in self.obj:
            self.fail(f'missing field "{key}"', hint)
        return self.obj[key]

    def int_field(self, key: str, minimum: int, what: str = "a token count") -> int:
        value = self.obj[key]
        if type(value) is not int:
            self.fail(f'"{key}" must be an integer, got {_describe(value)}', f'write {key} as a JSON integer ({what})')
        if value < minimum:
            if minimum == 1 and value == 0:
                self.fail(
                    f'"{key}" is 0: a request needs at least one input token',
                    "drop the request or give it input tokens",
                )
            self.fail(f'"{key}" is {value}, must be >= {minimum}', f"{key} is {what} and cannot be negative")
        if value > MAX_TOKEN_COUNT:
            self.fail(f'"{key}" is {value}, must be <= {MAX_TOKEN_COUNT}', f"{key} is {what}; no request is that long")
        return value

    def arrival(self, key: str) -> float | None:
        value = self.obj.get(key)
        if value is None:
            return None
        if type(value) not in (int, float) or not math.isfinite(value):
            self.fail(
                f'"{key}" must be a number of milliseconds, got {_describe(value)}',
                f"write {key} as a JSON number",
            )
        if value < 0:
            self.fail(
                f'"{key}" is {value}, must be >= 0',
                "arrival times are milliseconds since the start of the trace",
            )
        return float(value)

    def optional_str(self, key: str) -> str | None:
        value = self.obj.get(key)
        if value is not None and type(value) is not str:
            self.fail(
                f'"{key}" must be a string, got {_describe(value)}',
                f'write it as a JSON string: "{key}": "{value}"',
            )
        return value

    def priority(self) -> int:
        """The optional `priority` (vLLM's: any integer, smaller first; 0 when absent or null)."""
        value = self.obj.get("priority")
        if value is None:
            return 0
        if type(value) is not int:
            self.fail(f'"priority" must be an integer, got {_describe(value)}',
                      "write priority as a JSON integer (vLLM's request priority: smaller is served first)")
        return value

    def optional_bool(self, key: str) -> bool:
        """The JSON boolean at `key`; False when absent or null."""
        value = self.obj.get(key)
        if value is not None and type(value) is not bool:
            self.fail(f'"{key}" must be true or false, got {_describe(value)}',
                      f'write it as a JSON boolean: "{key}": true')
        return bool(value)

    def int_list(self, key: str, upper: int | None = None) -> list[int]:
        value = self.obj[key]
        if type(value) is not list or not set(map(type, value)) <= _INT_ONLY:
            self.fail(
                f'"{key}" must be a list of integers, got {_describe(value)}',
                f"write {key} as a JSON array of integers",
            )
        if value and min(value) < 0:
            self.fail(f'"{key}" holds the negative value {min(value)}', "ids are non-negative integers")
        if value and upper is not None and max(value) >= upper:
            self.fail(
                f'"{key}" holds {max(value)}, must be < {upper}',
                "token ids must be below 2**31; use input_len for synthetic tokens",
            )
        return value


def _lines(path: Path, fh) -> Iterator[_Line]:
    """Yield every non-empty line as a `_Line`; raises at the first one that is not a JSON object,
    or where the compressed stream breaks."""
    no = 0
    try:
        for no, raw in enumerate(fh, start=1):
            if raw.strip():
                yield _line(path, no, raw)
    except _decompression_errors() as exc:
        raise TraceError(f"{path}:{no + 1}: cannot decompress the trace ({exc or type(exc).__name__})",
                         "the compressed file is damaged or cut short: fetch or compress it again") from None


def _line(path: Path, no: int, raw: bytes) -> _Line:
    try:
        obj = _decode_json(raw.decode("utf-8-sig"))
    except ValueError as exc:
        if isinstance(exc, json.JSONDecodeError):
            raise TraceError(f"{path}:{no}: not valid JSON ({exc.msg})",
                             f"each line must be one JSON object; {DOCS}") from None
        raise TraceError(f"{path}:{no}: not valid JSON (not UTF-8 text)",
                         f"{READABLE}: is it compressed another way, or not a trace?") from None
    if type(obj) is not dict:
        raise TraceError(
            f"{path}:{no}: expected a JSON object, got {_describe(obj)}",
            f"each line must be one JSON object; {DOCS}",
        )
    return _Line(path, no, obj)


def _make_parser(line: _Line, format: str, block_size: int):
    obj = line.obj
    if format == "auto":
        is_mooncake = bool(obj.keys() & {"hash_ids", "input_length"})
        is_memcli = bool(obj.keys() & {"input_ids", "input_len"})
        if is_mooncake == is_memcli:
            line.fail(
                f"cannot tell the trace format from the keys {sorted(obj)}",
                "a Mooncake line has hash_ids and input_length, a memcli line input_ids or input_len;"
                " or pass --format memcli|mooncake",
            )
        format = "mooncake" if is_mooncake else "memcli"
    return _MooncakeParser(block_size) if format == "mooncake" else _MemcliParser(block_size)


class _ArrivalCheck:
    """Arrival times: on every request or on none, and never going backwards."""

    def __init__(self) -> None:
        self.first: tuple[int, bool] | None = None
        self.prev: tuple[int, float] | None = None

    def check(self, line: _Line, arrival_ms: float | None, key: str) -> None:
        if self.first is None:
            self.first = (line.no, arrival_ms is not None)
        elif self.first[1] != (arrival_ms is not None):
            first_no, first_has = self.first
            state = ("has no", "does") if first_has else ("has", "does not")
            line.fail(
                f'{state[0]} "{key}" while line {first_no} {state[1]}',
                "give every request an arrival time, or none",
            )
        if arrival_ms is None:
            return
        if self.prev is not None and arrival_ms < self.prev[1]:
            line.fail(
                f'"{key}" {_ms(arrival_ms)} is earlier than {_ms(self.prev[1])} on line {self.prev[0]}',
                "arrival times must not go backwards: sort the file by arrival time (memcli keeps file order)",
            )
        self.prev = (line.no, arrival_ms)


class _MooncakeParser:
    format = "mooncake"
    arrival_key = "timestamp"

    def __init__(self, block_size: int):
        self.block_size = block_size
        self.ignored: set[str] = set()

    def parse(self, line: _Line) -> RequestSpec:
        obj = line.obj
        unknown = obj.keys() - _MOONCAKE_KEY_SET
        if unknown:
            self._check_unknown(line, unknown)
        for key in MOONCAKE_REQUIRED:
            line.require(key, f"a Mooncake line needs {', '.join(MOONCAKE_REQUIRED)} (timestamp optional)")
        input_len = line.int_field("input_length", minimum=1)
        output_len = line.int_field("output_length", minimum=0)
        hash_ids = line.int_list("hash_ids")
        need = cdiv(input_len, self.block_size)
        if len(hash_ids) != need:
            line.fail(
                f"hash_ids has {len(hash_ids)} entries but input_length {input_len} needs"
                f" ceil({input_len} / {self.block_size}) = {need}",
                _block_size_hint(input_len, len(hash_ids)),
            )
        return RequestSpec(
            rid=str(line.no),
            input_len=input_len,
            output_len=output_len,
            arrival_ms=line.arrival("timestamp"),
            hash_ids=tuple(hash_ids),
            block_size=self.block_size,
            line=line.no,
            priority=line.priority(),
        )

    def _check_unknown(self, line: _Line, unknown: set[str]) -> None:
        """Extra fields from other tools are ignored, but a near-miss of a field the line lacks is a typo."""
        memcli_keys = sorted(unknown & {"input_ids", "input_len", "output_len"})
        if memcli_keys and "input_length" not in line.obj:
            line.fail(
                f'"{memcli_keys[0]}" is a memcli key: this line is not a Mooncake request',
                "pass --format memcli (or auto)",
            )
        absent = [k for k in MOONCAKE_KEYS if k not in line.obj]
        for key in sorted(unknown):
            close = difflib.get_close_matches(key, absent, n=1, cutoff=0.8)
            if close:
                line.fail(
                    f'unknown field "{key}": did you mean "{close[0]}"?',
                    f"Mooncake fields are: {', '.join(MOONCAKE_KEYS)}",
                )
        self.ignored |= unknown


def _block_size_hint(input_len: int, num_hashes: int) -> str:
    if num_hashes == 0:
        return "hash_ids must hold one id per block of the input"
    low = cdiv(input_len, num_hashes)
    high = None if num_hashes == 1 else cdiv(input_len, num_hashes - 1) - 1
    if high is not None and high < low:
        return "no block size fits this row: check its input_length and hash_ids"
    fits = f"{low} or more" if high is None else (f"{low}" if low == high else f"{low}..{high}")
    return f"check --block-size (Mooncake 512, Qwen-Bailian 16): this row fits a block size of {fits}"


class _MemcliParser:
    format = "memcli"
    arrival_key = "arrival_ms"

    def __init__(self, block_size: int):
        self.block_size = block_size
        self.ignored: set[str] = set()
        self.next_synthetic = SYNTHETIC_TOKEN_BASE
        self.by_rid: dict[str, tuple[int, RequestSpec]] = {}

    def parse(self, line: _Line) -> RequestSpec:
        obj = line.obj
        self._check_keys(line, obj)
        rid = self._rid(line, obj)
        line.require("output_len", "every memcli request needs output_len (tokens to generate)")
        output_len = line.int_field("output_len", minimum=0)
        if "input_ids" in obj:
            runs = self._explicit(line, obj)
        elif "input_len" in obj:
            runs = self._synthetic(line, obj)
        else:
            line.fail(
                'missing field "input_ids" or "input_len"',
                "give the prompt as input_ids, or its length as input_len",
            )
        spec = RequestSpec(
            rid=rid,
            input_len=sum(len(r) for r in runs),
            output_len=output_len,
            arrival_ms=line.arrival("arrival_ms"),
            extra_key=line.optional_str("extra_key"),
            ignore_eos=line.optional_bool("ignore_eos"),
            max_new_tokens=self._max_new_tokens(line, output_len),
            token_runs=runs,
            block_size=self.block_size,
            line=line.no,
            priority=line.priority(),
        )
        self.by_rid[rid] = (line.no, spec)
        return spec

    @staticmethod
    def _max_new_tokens(line: _Line, output_len: int) -> int | None:
        if line.obj.get("max_new_tokens") is None:
            return None
        value = line.int_field("max_new_tokens", minimum=0)
        if value < output_len:
            line.fail(f'"max_new_tokens" {value} is below output_len {output_len}',
                      "a request stops at max_new_tokens; give at least output_len (more: it ends on EOS)")
        if value > output_len and line.obj.get("ignore_eos") is True:
            line.fail(f'"max_new_tokens" {value} is above output_len {output_len} on an ignore_eos request',
                      "an ignore_eos request never stops on EOS: drop max_new_tokens or ignore_eos")
        return value

    def _check_keys(self, line: _Line, obj: dict[str, Any]) -> None:
        unknown = sorted(obj.keys() - _MEMCLI_KEY_SET)
        if unknown:
            hint = f"valid keys: {', '.join(MEMCLI_KEYS)}"
            if obj.keys() & {"hash_ids", "input_length"}:
                hint += "; this line looks like a Mooncake trace: pass --format mooncake (or auto)"
            names = ", ".join(f'"{key}"' for key in unknown)
            line.fail(f"unknown key{'s' if len(unknown) > 1 else ''} {names}", hint)
        if "input_ids" in obj and "input_len" in obj:
            line.fail(
                "give input_ids or input_len, not both",
                "input_len is for synthetic tokens; with input_ids the length is implied",
            )
        if "prefix" in obj and "input_ids" in obj:
            line.fail(
                "prefix combines with input_len, not input_ids",
                "write the full input_ids, or use prefix with input_len",
            )

    def _rid(self, line: _Line, obj: dict[str, Any]) -> str:
        rid = line.optional_str("rid")
        rid = str(line.no) if rid is None else rid
        if rid in self.by_rid:
            line.fail(
                f'duplicate rid "{rid}" (first used on line {self.by_rid[rid][0]})',
                "every rid must be unique; rid defaults to the line number",
            )
        return rid

    def _explicit(self, line: _Line, obj: dict[str, Any]) -> tuple[TokenRun, ...]:
        ids = line.int_list("input_ids", upper=SYNTHETIC_TOKEN_BASE)
        if not ids:
            line.fail(
                '"input_ids" is empty: a request needs at least one input token',
                "drop the request or give it input tokens",
            )
        arr = np.array(ids, dtype=np.int64)
        arr.flags.writeable = False
        return (arr,)

    def _synthetic(self, line: _Line, obj: dict[str, Any]) -> tuple[TokenRun, ...]:
        input_len = line.int_field("input_len", minimum=1)
        runs = self._prefix(line, obj["prefix"], input_len) if "prefix" in obj else ()
        own_len = input_len - sum(len(r) for r in runs)
        if own_len:
            runs += (range(self.next_synthetic, self.next_synthetic + own_len),)
            self.next_synthetic += own_len
        return runs

    def _prefix(self, line: _Line, prefix: Any, input_len: int) -> tuple[TokenRun, ...]:
        shape = '"prefix": {"rid": "<earlier rid>", "len": <tokens>}'
        if type(prefix) is not dict or set(prefix) != set(PREFIX_KEYS):
            line.fail(f'"prefix" must be an object with keys rid and len, got {_describe(prefix)}', f"write {shape}")
        rid, length = prefix["rid"], prefix["len"]
        if type(rid) is not str or type(length) is not int or length < 1:
            line.fail(
                f'"prefix" needs a string rid and a positive integer len, got {json.dumps(prefix)}',
                f"write {shape}",
            )
        if rid not in self.by_rid:
            line.fail(
                f'prefix rid "{rid}" is not an earlier request',
                "a prefix can only reuse a request on an earlier line",
            )
        source = self.by_rid[rid][1]
        if length > source.input_len or length > input_len:
            line.fail(
                f'prefix len {length} is longer than request "{rid}" ({source.input_len} tokens)'
                f" or this input_len ({input_len})",
                "prefix len must be at most both input lengths",
            )
        return _cut_runs(source.token_runs, length)


def _cut_runs(runs: tuple[TokenRun, ...], length: int) -> tuple[TokenRun, ...]:
    """The first `length` tokens of `runs`, as views (array slices and sub-ranges)."""
    out: list[TokenRun] = []
    for run in runs:
        if length <= 0:
            break
        out.append(run[:length])
        length -= len(run)
    return tuple(out)


def _ms(value: float) -> str:
    return str(int(value)) if value.is_integer() else repr(value)


def _describe(value: Any) -> str:
    """A JSON value for an error message: its JSON type and a short rendering."""
    text = json.dumps(value)
    text = text if len(text) <= 40 else text[:37] + "..."
    return f"{_JSON_KINDS.get(type(value), type(value).__name__)} {text}"


_JSON_KINDS = {bool: "boolean", int: "integer", float: "number", str: "string", list: "array", dict: "object"}
_JSON_KINDS[type(None)] = "null"
