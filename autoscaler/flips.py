"""Role flips: a worker that can run either role moves from prefill to decode or back without a restart. It stops
taking its old role's work, drains what it holds, and serves the other role `flip_s` later. `RoleFlip` is what
a law asks of its actuator (before any start or stop); `flip_seconds` is what the law expects one to take;
`flips_between` is the rule an actuator applies to the targets of a law that plans no flips. Plain Python.
"""

from __future__ import annotations

from dataclasses import dataclass

from splitserve.autoscaler.observations import Observation
from splitserve.autoscaler.planner import Needs

ROLES = ("prefill", "decode")


@dataclass(frozen=True)
class RoleFlip:
    """Workers to move from `source` to `target` before the actuator starts or stops any: the desired replicas
    of the decision already count them in their new role."""

    source: str  # the role they leave: prefill | decode
    target: str
    workers: int
    reason: str
    seconds: float  # s the law expects one flip to take: its drain, then flip_s

    def as_status(self) -> dict[str, object]:
        return {"from": self.source, "to": self.target, "workers": self.workers, "reason": self.reason,
                "seconds": round(self.seconds, 2)}


def other(role: str) -> str:
    return "decode" if role == "prefill" else "prefill"


def flip_seconds(source: str, obs: Observation, n: Needs, flip_s: float) -> float:
    """s a worker leaving `source` takes to serve the other role: the drain of what it holds, then `flip_s`.
    The actuator flips the least loaded worker; its drain is priced at a whole request, as if it had just
    joined: a decode worker's at the mean output's steps at the SLO batch, a prefill worker's at its share of
    the queue and the mean prompt's prefill."""
    if source == "decode":
        drain = obs.decode.mean_output_tokens * n.capacity.decode_step_s
    else:
        p = obs.prefill
        drain = n.prefill_backlog_s + p.mean_input_tokens / max(1e-9, n.capacity.prefill_raw_tokens_per_s)
    return drain + flip_s


def flips_between(current: tuple[int, int], target: tuple[int, int]) -> tuple[str, str, int] | None:
    """(source, target, workers) when one role is to grow while the other shrinks: that many move by flips,
    and only the rest start or stop. `current` and `target`: (prefill, decode) replicas."""
    (p, d), (tp, td) = current, target
    if tp > p and td < d:
        return "decode", "prefill", min(tp - p, d - td)
    if td > d and tp < p:
        return "prefill", "decode", min(td - d, p - tp)
    return None
