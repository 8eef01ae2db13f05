"""Who the workers are: the membership interface that the gateway's worker view and a decode worker's allowed
prefill peers both come from (never from a client).

`StaticMembership` is the Redis-free implementation: the endpoints written in the config. The Redis registry
(leases, instance ids, draining) implements the same interface.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

ROLES = ("prefill", "decode", "both")


@dataclass(frozen=True)
class WorkerInfo:
    """One worker as membership knows it."""

    name: str  # stable identity (a pod name, or the endpoint for static members)
    endpoint: str  # host:port of its gRPC server
    role: str  # prefill | decode | both
    model: str = ""  # served model name ("" when not known, as for static members)
    instance_id: str = ""  # new at every start of the process ("" for static members)
    block_size: int = 0  # tokens per KV block (0: not reported)
    kv_capacity_blocks: int = 0  # KV blocks in its cache (0: not reported)
    metrics_url: str = ""  # http://host:port of /metrics, /stats (empty: unknown)
    draining: bool = False  # finishing its requests in flight; gets nothing new
    # its load as it last reported it (registry members report every second; static members never)
    num_waiting: int = 0
    num_running: int = 0
    kv_blocks_used: int = 0
    waiting_prefill_tokens: int = 0

    def serves(self, role: str) -> bool:
        """Whether this worker can take `role`'s part of a request (a colocated worker decodes)."""
        return self.role == role or (role == "decode" and self.role == "both")


class Membership(Protocol):
    """A live view of the cluster's workers."""

    def workers(self) -> list[WorkerInfo]:
        """Every known worker, draining ones included."""
        ...

    def subscribe(self, callback: Callable[[], None]) -> None:
        """Call `callback` (on the event loop) whenever the set of workers or their state changes."""
        ...

    async def start(self) -> None: ...

    async def close(self) -> None: ...


class StaticMembership:
    """The endpoints written in the config; they never change."""

    def __init__(self, prefill: list[str], decode: list[str], decode_role: str = "decode") -> None:
        self._workers = [WorkerInfo(ep, ep, "prefill") for ep in prefill] + \
                        [WorkerInfo(ep, ep, decode_role) for ep in decode]

    def workers(self) -> list[WorkerInfo]:
        return list(self._workers)

    def subscribe(self, callback: Callable[[], None]) -> None:
        pass  # nothing ever changes

    async def start(self) -> None:
        pass

    async def close(self) -> None:
        pass


def endpoints_of(members: Membership, role: str) -> set[str]:
    """Endpoints of the live (not draining) workers that serve `role`."""
    return {w.endpoint for w in members.workers() if w.serves(role) and not w.draining}
