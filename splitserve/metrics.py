"""Prometheus helpers: a /metrics HTTP endpoint for workers and the shared metric names (splitserve_*)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)

# workers
LOCAL_PREFILL = Counter("splitserve_local_prefill", "Prompts the decode worker prefilled itself", ["reason"])
REMOTE_PREFILL = Counter("splitserve_remote_prefill", "Prompts whose KV came from a prefill worker", ["outcome"])
WORKER_REQUESTS = Counter("splitserve_worker_requests", "Requests handled by this worker", ["rpc", "status"])
WORKER_RUNNING = Gauge("splitserve_worker_running_requests", "Requests running in the engine")
WORKER_WAITING = Gauge("splitserve_worker_waiting_requests", "Requests waiting in the engine")
WORKER_KV_USAGE = Gauge("splitserve_worker_kv_blocks_used", "KV blocks in use")
WORKER_KV_TOTAL = Gauge("splitserve_worker_kv_blocks_total", "KV blocks in the cache")

# gateway
REQUESTS = Counter("splitserve_requests", "Requests by endpoint and HTTP status", ["endpoint", "status"])
TTFT = Histogram("splitserve_time_to_first_token_seconds", "Time to first token", buckets=LATENCY_BUCKETS)
ITL = Histogram("splitserve_inter_token_latency_seconds", "Time between output tokens",
                buckets=(0.001, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5))
E2E = Histogram("splitserve_e2e_request_latency_seconds", "End-to-end request latency", buckets=LATENCY_BUCKETS)
QUEUE_DEPTH = Gauge("splitserve_queue_depth", "Requests admitted by the gateway and not yet finished")
PROMPT_TOKENS = Counter("splitserve_prompt_tokens", "Prompt tokens")
GENERATION_TOKENS = Counter("splitserve_generation_tokens", "Generated tokens")
WORKER_HEALTHY = Gauge("splitserve_worker_healthy", "1 when the gateway sees the worker healthy", ["worker", "role"])
