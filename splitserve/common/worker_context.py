"""What a worker process hands its role when the role builds its service: who the worker is, whom it knows
(membership), and its Redis link (None without Redis)."""

from __future__ import annotations

from dataclasses import dataclass

from splitserve.common.membership import Membership
from splitserve.common.redis_link import RedisLink
from splitserve.common.redis_wire import Keys


@dataclass(frozen=True)
class WorkerContext:
    name: str  # this worker's name in the registry
    instance_id: str  # new at every start
    host: str  # the address its servers bind
    membership: Membership
    link: RedisLink | None
    keys: Keys
