"""The gateway's own Prometheus metrics (names start with splitserve_). Worker metrics live with the workers, so
a gateway's /metrics lists only what it measures."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)

REQUESTS = Counter("splitserve_requests", "Requests by endpoint and HTTP status", ["endpoint", "status"])
CLIENT_CLOSED = "499"  # REQUESTS' status of a request whose client left before its end (nginx's client-closed)
TTFT = Histogram("splitserve_time_to_first_token_seconds", "Time to first token", buckets=LATENCY_BUCKETS)
ITL = Histogram("splitserve_inter_token_latency_seconds", "Time between output tokens",
                buckets=(0.001, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5))
E2E = Histogram("splitserve_e2e_request_latency_seconds", "End-to-end request latency", buckets=LATENCY_BUCKETS)
QUEUE_DEPTH = Gauge("splitserve_queue_depth", "Requests running or waiting for a seat on this gateway")
INFLIGHT = Gauge("splitserve_gateway_inflight_requests", "Requests running on this gateway")
PROMPT_TOKENS = Counter("splitserve_prompt_tokens", "Prompt tokens")
GENERATION_TOKENS = Counter("splitserve_generation_tokens", "Generated tokens")
WORKER_HEALTHY = Gauge("splitserve_worker_healthy", "1 when the gateway sees the worker healthy", ["worker", "role"])
HEALTH_FLAPS = Counter("splitserve_health_flaps", "Times a worker this gateway saw healthy stopped being so",
                       ["worker", "role"])
DECISIONS = Counter("splitserve_router_decisions", "Routing decisions by reason", ["policy", "reason"])
SPILLS = Counter("splitserve_router_prefill_spills",
                 "Long prompts sent to their decode worker's own prefill because the prefill worker was backed up")
BUSY_RETRIES = Counter("splitserve_router_busy_retries",
                       "Requests a decode worker sent back before their first token (no KV room for the prompt within "
                       "decode.reserveWaitSeconds), routed again")
PREFIX_HIT_TOKENS = Counter("splitserve_router_prefix_hit_tokens",
                            "Prompt tokens the routing decision found cached on the chosen decode worker")
MIGRATIONS = Counter("splitserve_router_migrations",
                     "Requests moved to another decode worker after their stream failed mid-way, by why "
                     "(worker_gone, stall, drain, engine) and how the move ended (resumed, failed, limit, no_worker, "
                     "client_left)", ["reason", "outcome"])
MIGRATION_GAP = Histogram("splitserve_router_migration_gap_seconds",
                          "How long a moved stream's client waited between the last token before the failure and "
                          "the first one after it", buckets=LATENCY_BUCKETS)
