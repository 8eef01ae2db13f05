"""The KV pool for engine vllm, in plain Python: the connector's settings (what the worker hands vLLM in
`kv_connector_extra_config`), the scheduler side's planner (which of a request's blocks to load from the pool and
which to store, by our chained block hashes), the messages it hands the worker side, and the small synchronous
Redis store both sides use. No vLLM and no torch: `pool_connector` wraps this inside vLLM's processes, and the
tests drive it with hand-made requests.

Keys are our chained hashes of the token ids (`splitserve.common.hashing`, salted by the served model name), so
the router's index, the pool's keys and the native engine's hashes agree; the namespace (`PoolNamespace`) carries
vLLM's block size, dtype and KV shape and a layout tag (`vllm-<device>`), so vLLM's blocks never mix with the
native engine's, whose payload is laid out differently.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from splitserve.common.hashing import hash_token_blocks
from splitserve.common.redis_wire import Keys, check_name

EXTRA_KEY = "splitserve_pool"  # our settings' key in kv_connector_extra_config
REDIS_URL_ENV = "SPLITSERVE_REDIS_URL"  # the URL stays off the command line
# the connector's counters, flushed to a Redis hash per worker that the worker's /metrics mirrors
STAT_FIELDS = ("hit_tokens", "lookup_tokens", "bytes_written", "bytes_read", "read_seconds", "write_seconds",
               "blocks_written", "blocks_skipped", "errors_missing", "errors_checksum", "errors_header",
               "errors_timeout", "errors_redis", "errors_dropped")


@dataclass(frozen=True)
class PoolSettings:
    """What the connector needs to know that vLLM does not: the kvPool section and who writes events."""

    model: str  # the served model name: hash salt, key namespace and event stream
    worker: str  # the name on this worker's pool events and stats
    instance_id: str
    write: bool  # this role writes the blocks it computes (kvPool.writeFrom)
    min_load_tokens: int = 64
    read_timeout_seconds: float = 5.0
    lookup_timeout_seconds: float = 0.2  # the scheduler's EXISTS: it runs inside vLLM's scheduling loop
    write_queue_blocks: int = 4096
    ttl_seconds: int = 86400

    def to_extra(self) -> dict[str, Any]:
        return {EXTRA_KEY: dict(self.__dict__)}

    @classmethod
    def from_extra(cls, extra: dict[str, Any] | None) -> PoolSettings:
        """From kv_connector_extra_config; a missing worker name (a pod's server, rendered before the worker
        exists) becomes `<host name>.vllm-pool`, which is no registered worker's name."""
        raw = dict((extra or {}).get(EXTRA_KEY) or {})
        unknown = set(raw) - set(cls.__dataclass_fields__)
        if unknown:
            raise ValueError(f"{EXTRA_KEY}: unknown setting {sorted(unknown)[0]!r}")
        if "model" not in raw:
            raise ValueError(f"{EXTRA_KEY}: model is required")
        raw.setdefault("worker", f"{socket.gethostname()}.vllm-pool")
        raw.setdefault("instance_id", "vllm")
        raw.setdefault("write", True)
        s = cls(**raw)
        check_name(s.worker, f"{EXTRA_KEY}.worker")
        check_name(s.instance_id, f"{EXTRA_KEY}.instance_id")
        for name in ("min_load_tokens", "write_queue_blocks", "ttl_seconds"):
            if not isinstance(getattr(s, name), int) or getattr(s, name) < 1:
                raise ValueError(f"{EXTRA_KEY}.{name}: {getattr(s, name)!r} is not a positive integer")
        for name in ("read_timeout_seconds", "lookup_timeout_seconds"):
            if not isinstance(getattr(s, name), int | float) or getattr(s, name) <= 0:
                raise ValueError(f"{EXTRA_KEY}.{name}: {getattr(s, name)!r} is not a positive number")
        return s

    @property
    def stats_key(self) -> str:
        return Keys(self.model).pool_stats(self.worker)

    @property
    def events_key(self) -> str:
        return Keys(self.model).events


# -- messages: scheduler side -> worker side (inside vLLM's connector metadata) --------------------------------
@dataclass(frozen=True)
class BlockLoad:
    """Read these pool blocks into these of vLLM's blocks (a request's leading run beyond its local hit)."""

    req_id: str
    block_ids: tuple[int, ...]
    block_hashes: tuple[int, ...]


@dataclass
class PoolStep:
    """One engine step's pool work: loads before the forward, stores of blocks it completes after it."""

    loads: list[BlockLoad] = field(default_factory=list)
    save_block_ids: list[int] = field(default_factory=list)
    save_hashes: list[int] = field(default_factory=list)
    lookup_tokens: int = 0  # prompt tokens looked up since the last step (the worker side counts them)


@dataclass
class _Tracked:
    tokens: Sequence[int]  # the request's token ids, prompt and output (vLLM's live list)
    block_ids: list[int]
    hashes: list[int]  # our chained hashes of its leading full blocks, as far as computed
    handled: int = -1  # leading blocks loaded, found in vLLM's cache or stored (-1: not scheduled yet)


@dataclass
class _Pending:
    start: int  # first block beyond the local hit
    hashes: list[int]  # the prompt's block hashes
    run: int  # blocks in the pool from `start`
    lookup_tokens: int


class PoolPlanner:
    """The scheduler side: `lookup` when a request is first scheduled (how many tokens to load), `allocated`
    once vLLM reserved its blocks, `step` for every engine step (the `PoolStep` to hand the worker side),
    `finished` when it ends. `exists(hashes)` answers, for each block hash, whether the pool has it (None:
    the pool cannot be asked now)."""

    def __init__(self, block_size: int, salt: str, min_load_tokens: int, write: bool,
                 exists: Callable[[Sequence[int]], list[bool] | None]) -> None:
        self.block_size = block_size
        self.salt = salt
        self.min_load_tokens = min_load_tokens
        self.write = write
        self.exists = exists
        self._pending: dict[str, _Pending] = {}
        self._tracked: dict[str, _Tracked] = {}
        self._loads: list[BlockLoad] = []
        self._lookup_tokens = 0

    def lookup(self, req_id: str, prompt: Sequence[int], num_computed_tokens: int) -> int:
        """Tokens to load: the leading run of the prompt's full blocks in the pool beyond the
        `num_computed_tokens` vLLM holds (block-aligned), leaving the last prompt token to compute."""
        bs = self.block_size
        hashes = hash_token_blocks(prompt[: (len(prompt) - 1) // bs * bs], bs, self.salt)
        start = num_computed_tokens // bs
        candidates = hashes[start:]
        if len(candidates) * bs < self.min_load_tokens:
            return 0
        found = self.exists(candidates)
        if found is None:
            return 0
        run = 0
        for present in found:
            if not present:
                break
            run += 1
        self._pending[req_id] = _Pending(start, hashes, run, len(candidates) * bs)
        return run * bs if run * bs >= self.min_load_tokens else 0

    def allocated(self, req_id: str, tokens: Sequence[int], block_ids: Sequence[int], num_external_tokens: int) -> None:
        """vLLM reserved the request's blocks (`block_ids`: all of them, in order); `num_external_tokens` is what
        it will take from us (0: nothing to load)."""
        pending = self._pending.pop(req_id, None)
        tracked = _Tracked(tokens, list(block_ids), pending.hashes if pending is not None else [])
        self._tracked[req_id] = tracked
        if pending is None:
            return
        self._lookup_tokens += pending.lookup_tokens
        n = min(num_external_tokens // self.block_size, pending.run)
        if n > 0:
            ids = tracked.block_ids[pending.start : pending.start + n]
            self._loads.append(BlockLoad(req_id, tuple(ids), tuple(pending.hashes[pending.start : pending.start + n])))

    def step(self, scheduled: Sequence[tuple[str, int, int, Sequence[int] | None, bool]]) -> PoolStep:
        """This step's work. `scheduled`: per request (id, tokens computed before the step, tokens scheduled in
        it, new block ids or None, whether the new block ids replace the old ones: a request resumed after a
        preemption). Blocks the step completes are stored, except those loaded or already in vLLM's cache."""
        out = PoolStep(self._loads, lookup_tokens=self._lookup_tokens)
        self._loads, self._lookup_tokens = [], 0
        bs = self.block_size
        for req_id, computed, num_scheduled, new_block_ids, replace in scheduled:
            tracked = self._tracked.get(req_id)
            if tracked is None:
                continue
            if new_block_ids is not None:
                tracked.block_ids = list(new_block_ids) if replace else tracked.block_ids + list(new_block_ids)
            if tracked.handled < 0:  # first step: what vLLM already had (its prefix cache, our load) is not ours
                tracked.handled = computed // bs
            full = min(computed + num_scheduled, len(tracked.tokens), len(tracked.block_ids) * bs) // bs
            if not self.write or full <= tracked.handled:
                continue
            if len(tracked.hashes) < full:
                done = len(tracked.hashes)
                tracked.hashes += hash_token_blocks(list(tracked.tokens[done * bs : full * bs]), bs, self.salt,
                                                    parent_hash=tracked.hashes[-1] if done else None)
            out.save_block_ids += tracked.block_ids[tracked.handled : full]
            out.save_hashes += tracked.hashes[tracked.handled : full]
            tracked.handled = full
        return out

    def finished(self, req_id: str) -> None:
        self._pending.pop(req_id, None)
        self._tracked.pop(req_id, None)


# -- Redis, synchronously (vLLM's scheduler and model runner are threads, not an event loop) -------------------
def connect(url: str, timeout: float):
    """A redis client for `url` with `timeout` on every socket operation: a cluster client when the server runs
    in cluster mode."""
    import redis
    from redis.cluster import RedisCluster

    plain = redis.Redis.from_url(url, socket_timeout=timeout, socket_connect_timeout=timeout)
    if not plain.info("cluster").get("cluster_enabled"):
        return plain
    plain.close()
    return RedisCluster.from_url(url, socket_timeout=timeout, socket_connect_timeout=timeout)


def redis_errors() -> tuple[type[BaseException], ...]:
    """What a call raises when Redis cannot be reached or cannot serve now."""
    from redis import exceptions as rx

    return (rx.ConnectionError, rx.TimeoutError, OSError, rx.ClusterDownError, rx.TryAgainError,
            rx.SlotNotCoveredError, rx.BusyLoadingError)


class RedisHandle:
    """A lazily connected client that, after a failure, is not asked again for `backoff_s` (a lookup in vLLM's
    scheduling loop must not wait on a Redis that is down at every request)."""

    def __init__(self, url: str | None, timeout: float, backoff_s: float = 1.0) -> None:
        self.url = url or os.environ.get(REDIS_URL_ENV) or None
        self.timeout = timeout
        self.backoff_s = backoff_s
        self._client = None
        self._down_until = 0.0
        self._lock = threading.Lock()
        self.last_error = "redis"  # why the last call that failed did: "timeout" or "redis" (a metric's reason)

    def call(self, fn: Callable[[Any], Any], default: Any = None) -> Any:
        """`fn(client)`, or `default` when Redis is unreachable (or was a moment ago)."""
        if self.url is None or time.monotonic() < self._down_until:
            return default
        try:
            with self._lock:
                if self._client is None:
                    self._client = connect(self.url, self.timeout)
                client = self._client
            return fn(client)
        except redis_errors() as e:
            from redis.exceptions import TimeoutError as RedisTimeout

            self.last_error = "timeout" if isinstance(e, RedisTimeout | TimeoutError) else "redis"
            self._down_until = time.monotonic() + self.backoff_s
            with self._lock:
                self._client = None
            return default


def pipelined(client, op: str, keys: Sequence[str], *args: Any) -> list:
    pipe = client.pipeline(transaction=False)
    for key in keys:
        getattr(pipe, op)(key, *args)
    return pipe.execute()


# -- the worker's side of the stats: a Redis hash per worker, mirrored on the worker's /metrics ----------------
class StatsDelta:
    """Counters accumulated in a vLLM process and added to the worker's stats hash (HINCRBYFLOAT) by `flush`."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._values: dict[str, float] = {}

    def add(self, name: str, value: float = 1.0) -> None:
        assert name in STAT_FIELDS, name
        with self._lock:
            self._values[name] = self._values.get(name, 0.0) + value

    def take(self) -> dict[str, float]:
        with self._lock:
            values, self._values = self._values, {}
        return {k: v for k, v in values.items() if v}

    def flush(self, redis: RedisHandle, key: str) -> None:
        values = self.take()
        if not values:
            return

        def write(client) -> bool:
            pipe = client.pipeline(transaction=False)
            for name, value in values.items():
                pipe.hincrbyfloat(key, name, value)
            pipe.execute()
            return True

        if not redis.call(write, False):  # Redis down: keep them for the next flush
            for name, value in values.items():
                self.add(name, value)
