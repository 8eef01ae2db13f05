"""A decode worker's own metrics: where each prompt's KV came from."""

from __future__ import annotations

from prometheus_client import Counter

LOCAL_PREFILL = Counter("splitserve_local_prefill", "Prompts the decode worker prefilled itself", ["reason"])
REMOTE_PREFILL = Counter("splitserve_remote_prefill", "Prompts whose KV came from a prefill worker", ["outcome"])
LOCAL_PREFILL_REASONS = ("short_prompt", "fallback", "no_prefill_worker", "no_free_blocks", "unknown_prefill_worker")
