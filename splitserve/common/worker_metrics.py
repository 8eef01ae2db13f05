"""Metrics every worker process reports, whatever its role (names start with splitserve_). Imported by worker
code only, so a gateway's /metrics never lists them."""

from __future__ import annotations

from prometheus_client import Counter, Gauge

WORKER_REQUESTS = Counter("splitserve_worker_requests", "Requests handled by this worker", ["rpc", "status"])
WORKER_ENGINE = Gauge("splitserve_worker_engine_info", "This worker's engine and role (always 1)",
                      ["engine", "role"])
WORKER_RUNNING = Gauge("splitserve_worker_running_requests", "Requests running in the engine")
WORKER_WAITING = Gauge("splitserve_worker_waiting_requests", "Requests waiting in the engine")
WORKER_KV_USAGE = Gauge("splitserve_worker_kv_blocks_used", "KV blocks in use")
WORKER_KV_TOTAL = Gauge("splitserve_worker_kv_blocks_total", "KV blocks in the cache")
HEALTH_FLAPS = Counter("splitserve_worker_health_flaps",
                       "Times this worker, once serving, reported itself unable to serve")
PROMPT_TOKENS = Counter("splitserve_worker_prompt_tokens", "Prompt tokens of requests this worker served")
PREFIX_HIT_TOKENS = Counter("splitserve_worker_prefix_hit_tokens",
                            "Prompt tokens this worker found in its own prefix cache (not computed, not received)")
