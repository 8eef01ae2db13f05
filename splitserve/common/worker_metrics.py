"""Metrics every worker process reports, whatever its role (names start with splitserve_). Imported by worker
code only, so a gateway's /metrics never lists them."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

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
ROLE_FLIPS = Counter("splitserve_role_flips", "Role flips this worker made, by the role it left and the one it took "
                     "(outcome ok, or failed: the new role's service could not be built and it serves the old one)",
                     ["source", "target", "outcome"])
ROLE_FLIP_SECONDS = Histogram("splitserve_role_flip_seconds",
                              "Seconds from a flip's call to serving the new role (its drain included)", ["target"],
                              buckets=(0.25, 0.5, 1.0, 2.0, 3.0, 5.0, 7.5, 10.0, 20.0, 30.0, 60.0, 120.0))
