"""Role flips through a gateway (`POST /admin/flip`, what `splitserve flip` calls): the worker named in the
gateway's view (a name, never an address from the client) is asked over its `WorkerClient` to serve the other
role; the answer comes once this gateway's view has it serving that role. Other gateways follow from the
registry within a poll and a health check.

Body: `{"worker": NAME, "role": "prefill" | "decode", "drain_seconds": 1.0, "timeout_seconds": 60}`; answer:
`{"worker", "from", "to", "seconds", "worker_seconds", "moved_streams"}` (`seconds`: from the request to this
gateway's view serving the new role; `worker_seconds`: the worker's own drain, swap and registration).
"""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass
from typing import Any

from splitserve.common.role_flips import FLIP_DRAIN_SECONDS, FLIP_TIMEOUT_SECONDS
from splitserve.common.worker_messages import (
    MAX_FLIP_DRAIN_SECONDS,
    ROLE_FLIP_ROLES,
    FlipCall,
    WorkerCallError,
)
from splitserve.router.errors import APIError, bad
from splitserve.router.gateway import Gateway
from splitserve.router.workers import Worker

MAX_TIMEOUT_SECONDS = 3600.0
VIEW_POLL_S = 0.1  # how often the gateway looks at its own view while it follows a flip


@dataclass(frozen=True)
class FlipRequest:
    worker: str
    role: str
    drain_seconds: float = FLIP_DRAIN_SECONDS
    timeout_seconds: float = FLIP_TIMEOUT_SECONDS


def parse_flip(body: Any) -> FlipRequest:
    """The request body, validated; `APIError` 400 naming the field otherwise."""
    if not isinstance(body, dict):
        raise bad("the body must be a JSON object")
    unknown = sorted(set(body) - {"worker", "role", "drain_seconds", "timeout_seconds"})
    if unknown:
        raise bad(f"{unknown[0]}: unknown field (worker, role, drain_seconds, timeout_seconds)", unknown[0])
    worker = body.get("worker")
    if not isinstance(worker, str) or not 0 < len(worker) <= 256 or not worker.isprintable():
        raise bad("worker: the worker's name (1-256 printable characters), as /health lists it", "worker")
    role = body.get("role")
    if role not in ROLE_FLIP_ROLES:
        raise bad("role: prefill or decode", "role")
    drain = _seconds(body, "drain_seconds", FLIP_DRAIN_SECONDS, 0.0, MAX_FLIP_DRAIN_SECONDS)
    timeout = _seconds(body, "timeout_seconds", FLIP_TIMEOUT_SECONDS, 0.0, MAX_TIMEOUT_SECONDS)
    if timeout == 0:
        raise bad("timeout_seconds: must be more than 0", "timeout_seconds")
    return FlipRequest(worker, role, drain, timeout)


def _seconds(body: dict, name: str, default: float, low: float, high: float) -> float:
    value = body.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) \
            or not low <= value <= high:
        raise bad(f"{name}: seconds, a number within {low:g}..{high:g}", name)
    return float(value)


async def flip(gw: Gateway, req: FlipRequest) -> dict[str, Any]:
    """Flip the named worker and follow it in this gateway's view; `APIError` when it cannot or did not."""
    t0 = time.monotonic()
    deadline = t0 + req.timeout_seconds
    worker = _flippable(gw, req)
    call = FlipCall(req.role, req.drain_seconds)
    try:
        reply = await worker.client.flip(call, timeout_s=req.timeout_seconds)
    except WorkerCallError as e:
        raise _flip_error(req, e) from None
    await _follow(gw, req, deadline)
    return {"worker": req.worker, "from": reply.previous, "to": reply.role,
            "seconds": round(time.monotonic() - t0, 3), "worker_seconds": round(reply.seconds, 3),
            "moved_streams": reply.moved_streams}


def _flippable(gw: Gateway, req: FlipRequest) -> Worker:
    """The worker, when what the gateway knows allows the flip (the worker checks again, and its engine)."""
    if gw.spec.mode == "colocated":
        raise APIError(409, "the cluster is colocated: its workers serve both phases, there is no other role to "
                            "flip to", code="colocated")
    if gw.cluster is None:
        raise APIError(409, "flips need the Redis registry (redis.mode bundled or external): with static "
                            "membership a worker's role is the one membership.prefill/decode lists it under",
                       code="no_registry")
    worker = gw.workers.get(req.worker)
    if worker is None:
        known = ", ".join(sorted(gw.workers.by_name)[:20]) or "none"
        raise APIError(404, f"worker {req.worker!r}: no such worker (known: {known})", "worker", code="unknown_worker")
    if worker.info.role == req.role and not worker.info.draining:
        raise APIError(409, f"worker {req.worker!r} serves {req.role} already", "role", code="same_role")
    return worker


def _flip_error(req: FlipRequest, e: WorkerCallError) -> APIError:
    name = repr(req.worker)
    if e.kind == "timeout":
        return APIError(504, f"worker {name} did not serve {req.role} within {req.timeout_seconds:g} s (the flip "
                             "goes on; /health shows its role)", code="flip_timeout")
    if e.kind in ("refused", "invalid"):
        return APIError(409, f"worker {name} cannot flip: {e.details}", code="flip_refused")
    if e.kind == "unimplemented":
        return APIError(501, f"worker {name} does not flip (a release before role flips)", code="flip_unsupported")
    return APIError(502, f"worker {name}: the flip call failed ({e.kind}: {e.details})", code="worker_error")


async def _follow(gw: Gateway, req: FlipRequest, deadline: float) -> None:
    """Until this gateway's view has the worker up in its new role: the registry read and its health checked
    now, not at their next turn."""
    while True:
        if gw.cluster is not None:
            await gw.cluster.membership.refresh()
        worker = gw.workers.get(req.worker)
        if worker is not None:
            await gw.workers.check(worker)
            if worker.info.role == req.role and worker.state == "up" and worker.load.available:
                return
        if time.monotonic() >= deadline:
            raise APIError(504, f"worker {req.worker!r} serves {req.role}, but this gateway does not see it "
                                f"serving yet after the timeout", code="flip_timeout")
        await asyncio.sleep(VIEW_POLL_S)
