"""The KV pool's metrics (docs/kv_pool.md), one set per worker process whichever engine runs: the native
engine's pool counts into them directly, a vLLM worker mirrors its pool connector's counters into them."""

from __future__ import annotations

from prometheus_client import Counter, Gauge

HIT_TOKENS = Counter("splitserve_kv_pool_hit_tokens", "Prompt tokens loaded from the KV pool instead of computed")
LOOKUP_TOKENS = Counter("splitserve_kv_pool_lookup_tokens",
                        "Prompt tokens looked up in the KV pool (beyond the worker's own cache)")
BYTES_WRITTEN = Counter("splitserve_kv_pool_bytes_written", "Bytes of KV blocks written to the pool")
BYTES_READ = Counter("splitserve_kv_pool_bytes_read", "Bytes of KV blocks read from the pool")
# bandwidth = bytes / seconds (benchmarks/kv_pool.py)
READ_SECONDS = Counter("splitserve_kv_pool_read_seconds",
                       "Seconds spent reading KV blocks from the pool (pipelined GETs, header and checksum checks)")
WRITE_SECONDS = Counter("splitserve_kv_pool_write_seconds",
                        "Seconds spent storing KV blocks in the pool (pipelined SETs and their pool-tier event)")
BLOCKS_WRITTEN = Counter("splitserve_kv_pool_blocks_written", "KV blocks written to the pool")
BLOCKS_SKIPPED = Counter("splitserve_kv_pool_blocks_skipped", "KV blocks not written: already in the pool")
ERRORS = Counter("splitserve_kv_pool_errors", "KV pool reads or writes that failed, by reason", ["reason"])
POOL_REDIS_UP = Gauge("splitserve_kv_pool_redis_up",
                      "1 while the KV pool's own Redis link (deadline kvPool.readTimeoutSeconds) is up")
POOL_BYTES = Gauge("splitserve_kv_pool_redis_bytes", "Memory the pool's Redis reports in use (bytes)")
ERROR_REASONS = ("missing", "checksum", "header", "timeout", "redis", "dropped")
