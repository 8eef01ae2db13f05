"""What a role flip needs, checked alike by the gateway that is asked for one and the worker that makes it
(`flip_problem`), and the drain a flip gives the requests in flight unless told otherwise.

A flip moves a worker between prefill and decode on the engine it has loaded: it needs a disaggregated
cluster (whose roles run one engine: the configuration model holds to it) and the Redis registry (every gateway
and decode worker learns roles from it; with static membership a worker's role is the one the config lists it
under). Engine vllm qualifies:
every disaggregated vLLM server runs its NixlConnector with `kv_role: kv_both`, so the same server sends and
receives KV, and a flip swaps only the splitserve service in front of it.
"""

from __future__ import annotations

from splitserve.common.config import ClusterSpec

FLIP_DRAIN_SECONDS = 1.0  # s the requests in flight may finish before a decode worker's streams move elsewhere
FLIP_TIMEOUT_SECONDS = 60.0  # s a caller waits for a flip (drain, the other role's service, registration)


def flip_problem(spec: ClusterSpec, role: str, target: str, has_registry: bool) -> str | None:
    """Why a worker of `role` cannot serve `target` by a flip (one line), or None when it can."""
    if spec.mode == "colocated" or role == "both":
        return "the cluster is colocated: its workers serve both phases, there is no other role to flip to"
    if role == target:
        return f"it serves {target} already"
    if not has_registry:
        return ("flips need the Redis registry (redis.mode bundled or external): with static membership a "
                "worker's role is the one membership.prefill/decode lists it under")
    return None
