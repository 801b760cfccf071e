"""Request specs: what a trace says about one request, with its tokens kept lazy.

A `RequestSpec` carries lengths, arrival time and a *token source*, never a materialised
prompt: the 12,031-request Mooncake conversation trace holds 145 M input tokens, so tokens
are produced one request at a time by `input_ids()`.

Token sources (exactly one per request):

- `hash_ids` (Mooncake): block `j` with hash `h` holds tokens `h * block_size + k` for
  `k in [0, block_size)`; the last block is cut at `input_len`. Equal hash ids give equal
  tokens, so requests share exactly what the trace says they share.
- `token_runs` (memcli format): a tuple of runs, each a read-only int64 array of explicit
  ids or a `range` of synthetic ids. Prefix references reuse an earlier request's runs, so
  nothing is copied.

Token ids of a trace never exceed `Trace.max_token_id`; a replay numbers output tokens from
`output_token_base(trace)` upwards so that no output token equals any input token.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Union

import numpy as np

from memcli.mem_cache.pages import cdiv

TokenRun = Union[np.ndarray, range]
TraceFormat = Literal["memcli", "mooncake"]

# Synthetic memcli tokens (`input_len` without `input_ids`) are numbered from here, so they
# never equal an explicit id; explicit ids must stay below it.
SYNTHETIC_TOKEN_BASE = 1 << 31


@dataclass(frozen=True, slots=True, eq=False)
class RequestSpec:
    """One request of a trace. Immutable; compares by identity (it may hold arrays).

    `block_size` is the trace's hash-block size for Mooncake requests, and the chunk size
    that `block_hashes()` uses for memcli requests. `line`: where the request is in its file,
    for error messages.
    """

    rid: str
    input_len: int
    output_len: int
    arrival_ms: float | None = None
    extra_key: str | None = None
    token_runs: tuple[TokenRun, ...] | None = None
    hash_ids: tuple[int, ...] | None = None
    block_size: int = 512
    line: int | None = None  # line of the trace file it was read from (1-based), if any
    priority: int = 0  # vLLM's request priority (smaller first; read by its priority policy only)
    ignore_eos: bool = False  # SGLang's sampling_params.ignore_eos (a fixed-length request)
    # SGLang's sampling_params.max_new_tokens when it exceeds output_len: the request then
    # finishes on a stop token (EOS) after output_len tokens; None: at output_len, by length.
    max_new_tokens: int | None = None

    @property
    def sampling_limit(self) -> int:
        """The request's max_new_tokens: the trace's, else output_len."""
        return self.output_len if self.max_new_tokens is None else self.max_new_tokens

    @property
    def eos_len(self) -> int | None:
        """The output length at which the request samples EOS, or None (it finishes by length)."""
        return self.output_len if self.sampling_limit > self.output_len else None

    def __post_init__(self) -> None:
        if (self.token_runs is None) == (self.hash_ids is None):
            raise ValueError(f"request {self.rid}: give exactly one of token_runs and hash_ids")
        if self.hash_ids is not None and len(self.hash_ids) != self.num_blocks:
            raise ValueError(
                f"request {self.rid}: {len(self.hash_ids)} hash ids for input_len {self.input_len}"
                f" at block_size {self.block_size} (need {self.num_blocks})"
            )
        if self.token_runs is not None and sum(len(r) for r in self.token_runs) != self.input_len:
            raise ValueError(f"request {self.rid}: token runs do not add up to input_len {self.input_len}")

    @classmethod
    def from_ids(cls, rid: str, ids, output_len: int, **kwargs) -> RequestSpec:
        """A request with explicit token ids (copied into a read-only int64 array)."""
        arr = np.array(ids, dtype=np.int64)
        arr.flags.writeable = False
        return cls(rid=rid, input_len=len(arr), output_len=output_len, token_runs=(arr,), **kwargs)

    @property
    def num_blocks(self) -> int:
        """Blocks of `block_size` tokens covering the input, the last one possibly partial."""
        return cdiv(self.input_len, self.block_size)

    @property
    def max_token_id(self) -> int:
        """Largest input token id of this request (an upper bound for Mooncake requests)."""
        if self.hash_ids is not None:
            return max(self.hash_ids) * self.block_size + self.block_size - 1
        return max(_run_max(run) for run in self.token_runs)

    def input_ids(self, room: int = 0) -> np.ndarray:
        """The prompt as a new int64 array of `input_len` tokens. Materialises this request only.

        With `room`, the array is the start of a new buffer with at least `room` entries after
        the prompt, where the request's outputs go (`Req` takes such a buffer as the one its
        `token_ids` read, so the prompt is never copied into another)."""
        if self.hash_ids is not None:
            return mooncake_token_ids(self.hash_ids, self.block_size, self.input_len, room)
        buf = np.empty(self.input_len + room, dtype=np.int64)
        pos = 0
        for run in self.token_runs:
            end = pos + len(run)
            buf[pos:end] = np.arange(run.start, run.stop, dtype=np.int64) if isinstance(run, range) else run
            pos = end
        return buf[: self.input_len] if room else buf

    def block_hashes(self) -> tuple[int, ...]:
        """One id per block of `block_size` tokens; equal prefixes give equal leading ids.

        Mooncake: the trace's `hash_ids`. memcli: each chunk is hashed together with the
        previous block's hash (a chain), so a block id identifies the whole prefix up to it.
        """
        if self.hash_ids is not None:
            return self.hash_ids
        return chained_block_hashes(self.input_ids(), self.block_size)


def mooncake_token_ids(hash_ids: tuple[int, ...], block_size: int, input_len: int, room: int = 0) -> np.ndarray:
    """Tokens of a Mooncake request: token k of a block with hash h is `h * block_size + k`.
    The first `input_len` of a new buffer with at least `room` entries after them."""
    span = len(hash_ids) * block_size
    buf = np.empty(max(span, input_len + room), dtype=np.int64)
    blocks = np.asarray(hash_ids, dtype=np.int64)[:, None] * block_size
    np.add(blocks, np.arange(block_size, dtype=np.int64), out=buf[:span].reshape(len(hash_ids), block_size))
    return buf[:input_len]


def chained_block_hashes(ids: np.ndarray, block_size: int) -> tuple[int, ...]:
    """Hash each `block_size` chunk of `ids` chained with the previous hash (63-bit ids)."""
    hashes = []
    prev = b""
    data = np.ascontiguousarray(ids, dtype="<i8")
    for start in range(0, len(data), block_size):
        digest = hashlib.blake2b(prev + data[start : start + block_size].tobytes(), digest_size=8).digest()
        prev = digest
        hashes.append(int.from_bytes(digest, "little") >> 1)
    return tuple(hashes)


def _run_max(run: TokenRun) -> int:
    return run.stop - 1 if isinstance(run, range) else int(run.max())


@dataclass(frozen=True)
class Trace:
    """A validated trace: requests in file order. Derived totals are properties.

    `ignored_fields`: unknown Mooncake fields that were present and ignored (sorted); empty
    for memcli traces, which reject unknown keys.
    """

    path: Path
    format: TraceFormat
    block_size: int
    requests: list[RequestSpec]
    ignored_fields: tuple[str, ...] = ()

    @property
    def num_requests(self) -> int:
        return len(self.requests)

    @property
    def input_tokens(self) -> int:
        return sum(r.input_len for r in self.requests)

    @property
    def output_tokens(self) -> int:
        return sum(r.output_len for r in self.requests)

    @property
    def has_timestamps(self) -> bool:
        """Every request has an arrival time (readers allow all or none)."""
        return bool(self.requests) and all(r.arrival_ms is not None for r in self.requests)

    @property
    def max_token_id(self) -> int:
        """No input token id of the trace is larger; -1 for an empty trace."""
        return max((r.max_token_id for r in self.requests), default=-1)


def output_token_base(trace: Trace) -> int:
    """First id a replay may give to output tokens: above every input token of the trace."""
    return trace.max_token_id + 1


def apply_sampling(req, spec: RequestSpec) -> None:
    """Give a scheduler request made from `spec` (with max_new_tokens = output_len) the
    trace's sampling fields: SGLang's requests (`eos_len`, `ignore_eos`) take max_new_tokens,
    the EOS position and ignore_eos; a request without them (vLLM's) keeps output_len."""
    if not hasattr(req, "eos_len"):
        return
    req.max_new_tokens = spec.sampling_limit
    req.eos_len = -1 if spec.eos_len is None else spec.eos_len
    req.ignore_eos = spec.ignore_eos
