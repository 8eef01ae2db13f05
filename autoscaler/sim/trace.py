"""Requests for the simulator: read from ../shared/traces (Azure CSV, Mooncake JSONL) or drawn as Poisson
arrivals, with time scaling (stretch or compress inter-arrival times) and rate scaling (more requests over
the same time: each request is replayed `rate_scale` times on average, copies shifted by a small random
offset, so the trace's rate curve keeps its shape).

Lengths and arrivals follow `splitserve bench`'s reading of the same files (timestamps in s from the first
request, prompts clipped to `max_input`, outputs to `max_output`), so a simulated run and a measured one see
the same requests. Prompts are not materialised: `PromptTokens` makes token ids on demand, from Mooncake hash
ids (one fixed 512-token block per id, so equal ids are equal prefixes) or from the request id.
"""

from __future__ import annotations

import csv
import enum
import json
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import overload

HASH_BLOCK = 512  # tokens per Mooncake hash id
VOCAB = (1000, 30000)  # token ids used in synthetic prompts (as `splitserve bench`)


class Status(enum.Enum):
    """Where a request is (one status per external wait, no flags)."""

    ARRIVING = "arriving"
    WAITING_PREFILL = "waiting_prefill"  # queued on a prefill worker
    PREFILLING = "prefilling"  # chunks being computed on a prefill worker
    TRANSFERRING = "transferring"  # KV streaming to its decode worker
    WAITING_ROOM = "waiting_room"  # on its decode worker, waiting for KV room to reserve for a remote prefill
    WAITING_DECODE = "waiting_decode"  # on its decode worker, waiting for a seat or to prefill locally
    LOCAL_PREFILLING = "local_prefilling"  # its decode worker computes the prompt itself
    DECODING = "decoding"
    FINISHED = "finished"
    FAILED = "failed"  # killed by a scale-down, or no decode worker


@dataclass(slots=True, eq=False)
class SimRequest:
    rid: int
    arrival: float  # s
    prompt: int  # prompt tokens
    output: int  # output tokens (max_tokens, ignore_eos: every request generates all of them)
    hash_ids: tuple[int, ...] = ()  # prefix blocks: equal ids, equal tokens (Mooncake: 512 tokens each)
    hash_block: int = HASH_BLOCK  # tokens per hash id
    status: Status = Status.ARRIVING
    remote: bool = False  # prefilled on a prefill worker
    cached: int = 0  # prompt tokens found in the computing worker's prefix cache
    transfer_tokens: int = 0  # prompt tokens whose KV goes from the prefill worker (the decode worker lacks them)
    computed: int = 0  # prompt (or recompute) tokens computed on the current worker
    to_compute: int = 0  # tokens the current prefill must reach (prompt, or prompt + generated on recompute)
    generated: int = 0  # output tokens produced so far (before the current decode stint)
    enqueued: float = -1.0  # s, put in its current worker's prompt queue
    prefill_start: float = -1.0  # s, first chunk scheduled
    first_token: float = -1.0  # s
    last_token: float = -1.0  # s (set when a stint ends)
    finish: float = -1.0  # s
    slow_itls: int = 0  # inter-token gaps above the ITL objective
    join_clock: int = 0  # decode worker's step clock when this stint began
    join_slow: int = 0  # decode worker's slow-step count when this stint began (step 0 counted apart)
    stint: int = 0  # bumps on preemption: heap entries of an older stint are stale
    kv_held: int = 0  # tokens of KV this request holds on its decode worker
    bounces: int = 0  # times a decode worker sent it back to the gateway as busy (no KV room in time)
    busy_since: float = -1.0  # s of its first bounce (-1: none)
    counted: bool = False  # its arrival is in the metrics window (once, however often it is routed)
    prefill_worker: object = None
    decode_worker: object = None

    @property
    def done(self) -> bool:
        return self.status in (Status.FINISHED, Status.FAILED)

    @property
    def ttft(self) -> float:
        return self.first_token - self.arrival if self.first_token >= 0 else float("inf")

    def meets(self, ttft_s: float, itl_s: float) -> bool:
        """Within both objectives: TTFT, and the request's p99 inter-token gap (as `splitserve bench` counts)."""
        if self.status != Status.FINISHED or self.ttft > ttft_s:
            return False
        n = self.output - 1  # gaps
        if n <= 0:
            return True
        k = min(n - 1, max(0, int(round(0.99 * (n - 1)))))  # bench's p99 index into the sorted gaps
        return self.slow_itls <= n - 1 - k


class PromptTokens(Sequence[int]):
    """A request's prompt token ids, made on demand (the router's policies may hash them; most only count)."""

    __slots__ = ("_n", "_hash_ids", "_salt")

    def __init__(self, n: int, hash_ids: tuple[int, ...], salt: int) -> None:
        self._n, self._hash_ids, self._salt = n, hash_ids, salt

    def __len__(self) -> int:
        return self._n

    def _token(self, i: int) -> int:
        block = i // HASH_BLOCK
        key = self._hash_ids[block] * 7919 + 17 if block < len(self._hash_ids) else -(self._salt * 1_000_003 + block)
        h = ((key * 0x9E3779B1) ^ ((i % HASH_BLOCK) * 0x85EBCA77)) & 0xFFFFFFFF
        return VOCAB[0] + h % (VOCAB[1] - VOCAB[0])

    @overload
    def __getitem__(self, i: int) -> int: ...
    @overload
    def __getitem__(self, i: slice) -> list[int]: ...
    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self._token(j) for j in range(*i.indices(self._n))]
        if not -self._n <= i < self._n:
            raise IndexError(i)
        return self._token(i % self._n)

    def __iter__(self) -> Iterator[int]:
        return (self._token(j) for j in range(self._n))


@dataclass(frozen=True)
class TraceRow:
    arrival: float  # s from the trace's start
    prompt: int
    output: int
    hash_ids: tuple[int, ...] = ()


def read_trace(path: str | Path, max_input: int = 1 << 20, max_output: int = 1 << 20) -> list[TraceRow]:
    """Rows of an Azure CSV or Mooncake JSONL trace, arrivals from 0, lengths clipped like `splitserve bench`."""
    p = Path(path)
    rows: list[TraceRow] = []
    if p.suffix == ".jsonl":
        with open(p) as f:
            for line in f:
                r = json.loads(line)
                rows.append(TraceRow(r["timestamp"] / 1000.0, max(1, min(r["input_length"], max_input)),
                                     max(1, min(r["output_length"], max_output)), tuple(r.get("hash_ids", ()))))
    elif p.suffix == ".csv":
        with open(p) as f:
            for r in csv.DictReader(f):
                rows.append(TraceRow(float(r["arrived_at"]), max(1, min(int(r["num_prefill_tokens"]), max_input)),
                                     max(1, min(int(r["num_decode_tokens"]), max_output))))
    else:
        raise ValueError(f"unknown trace format {p.suffix!r} (use .jsonl Mooncake or .csv Azure)")
    if not rows:
        raise ValueError(f"trace {path} has no requests")
    t0 = rows[0].arrival
    return [TraceRow(r.arrival - t0, r.prompt, r.output, r.hash_ids) for r in rows]


def scale(rows: list[TraceRow], time_scale: float = 1.0, rate_scale: float = 1.0, start_s: float = 0.0,
          duration_s: float | None = None, seed: int = 0) -> list[SimRequest]:
    """Requests from trace rows: the slice [start_s, start_s + duration_s) of the trace (trace seconds), its
    times multiplied by `time_scale`, each row replayed `rate_scale` times on average (copies after the first
    shifted by up to one mean inter-arrival gap). Sorted by arrival, ids 0..n-1."""
    return [SimRequest(i, t, rows[k].prompt, rows[k].output, rows[k].hash_ids)
            for i, (t, k) in enumerate(_replayed(rows, time_scale, rate_scale, start_s, duration_s, seed))]


def scale_sources(rows: list[TraceRow], time_scale: float = 1.0, rate_scale: float = 1.0, start_s: float = 0.0,
                  duration_s: float | None = None, seed: int = 0) -> list[int]:
    """For each request `scale` makes with the same arguments (by id), the index of the row it replays."""
    return [k for _, k in _replayed(rows, time_scale, rate_scale, start_s, duration_s, seed)]


def _replayed(rows: list[TraceRow], time_scale: float, rate_scale: float, start_s: float, duration_s: float | None,
              seed: int) -> list[tuple[float, int]]:
    if time_scale <= 0 or rate_scale <= 0:
        raise ValueError("time_scale and rate_scale must be > 0")
    rng = random.Random(seed)
    end = float("inf") if duration_s is None else start_s + duration_s
    chosen = [k for k, r in enumerate(rows) if start_s <= r.arrival < end]
    if not chosen:
        raise ValueError(f"no requests in [{start_s}, {end}) s of the trace")
    span = max(rows[chosen[-1]].arrival - rows[chosen[0]].arrival, 1e-9)
    gap = span / max(1, len(chosen)) * time_scale  # s, mean inter-arrival after time scaling
    out: list[tuple[float, int]] = []
    for k in chosen:
        t = (rows[k].arrival - start_s) * time_scale
        copies = int(rate_scale) + (1 if rng.random() < rate_scale - int(rate_scale) else 0)
        for c in range(copies):
            out.append((t if c == 0 else t + rng.random() * gap, k))
    out.sort(key=lambda x: x[0])
    return out


def poisson(n: int, rate: float, input_len: int, output_len: int, seed: int = 0) -> list[SimRequest]:
    """`n` requests of fixed lengths, Poisson arrivals at `rate` requests/s."""
    rng = random.Random(seed)
    t, out = 0.0, []
    for i in range(n):
        out.append(SimRequest(i, t, input_len, output_len))
        t += rng.expovariate(rate) if rate > 0 else 0.0
    return out


def from_token_jobs(jobs: Sequence[tuple[float, Sequence[int], int]], block: int = 16) -> list[SimRequest]:
    """Requests from (arrival s, prompt token ids, output tokens), e.g. the jobs `splitserve bench` sent: each
    full `block` of the prompt gets a hash id chained on the ones before it, as the engine's prefix cache keys
    its blocks, so shared prefixes hit the simulated caches where they would hit the real ones."""
    out = []
    for i, (arrival, tokens, output) in enumerate(sorted(jobs, key=lambda j: j[0])):
        ids, h = [], 0
        for start in range(0, len(tokens) - block + 1, block):
            h = hash((h, tuple(tokens[start:start + block])))
            ids.append(h)
        out.append(SimRequest(i, arrival, len(tokens), output, tuple(ids), block))
    return out


@dataclass(frozen=True)
class Clump:
    start: float  # s, the first bin's start
    length_s: float  # whole bins
    requests: int


def per_bin(requests: Sequence[SimRequest], bin_s: float) -> tuple[list[int], list[int]]:
    """Prompt tokens and requests arriving in each `bin_s` bin, from 0 to the last arrival's bin."""
    n = int(max((r.arrival for r in requests), default=0.0) // bin_s) + 1
    tokens, counts = [0] * n, [0] * n
    for r in requests:
        k = int(r.arrival // bin_s)
        tokens[k] += r.prompt
        counts[k] += 1
    return tokens, counts


def clumps(requests: Sequence[SimRequest], bin_s: float, factor: float = 2.0) -> list[Clump]:
    """Runs of `bin_s` bins whose prompt tokens exceed `factor` x the mean bin's (the trace's span cut into
    bins from 0): the clumps a law would call bursts, each with its start, length and requests."""
    if not requests:
        return []
    tokens, counts = per_bin(requests, bin_s)
    n = len(tokens)
    high = [t > factor * sum(tokens) / n for t in tokens]
    out: list[Clump] = []
    k = 0
    while k < n:
        if not high[k]:
            k += 1
            continue
        first = k
        while k < n and high[k]:
            k += 1
        out.append(Clump(first * bin_s, (k - first) * bin_s, sum(counts[first:k])))
    return out
