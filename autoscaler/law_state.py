"""The control law's memory between decisions (`ControllerState`) and its one wire format: versioned JSON, so
an actuator can keep it somewhere durable (the operator: the SplitServeCluster's `status.lawState`) and a
restarted actuator continues where the last one stopped. Times are the actuator's clock in seconds (the operator
uses wall-clock time, so they stay meaningful across processes); JSON has no infinity, so "never" is null.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields
from typing import Any

ROLES = ("prefill", "decode")
STATE_VERSION = 1  # bump when a field changes meaning; an older or newer state is refused, not guessed at
_TIMES = ("last_up", "last_change", "planned_at", "last_down", "last_burst", "peak_at", "floor_at")  # s; -inf = never (null in JSON)
_SERIES = ("history", "recent", "levels")  # [[s, value], ...]


@dataclass(frozen=True)
class RoleState:
    """The law's memory of one role between calls."""

    last_up: float = -math.inf  # s, last scale-up
    last_change: float = -math.inf  # s, last change either way
    history: tuple[tuple[float, float], ...] = ()  # (s, need in replicas) over the trend window
    planned: float | None = None  # the planner's need at its last run (replicas, before utilisation)
    planned_at: float = -math.inf  # s
    recent: tuple[tuple[float, int], ...] = ()  # (s, target) over the stabilisation window
    correction: float = 1.0  # measured prefill busy time / the profile's prediction (smoothed)
    slo_factor: float = 1.0  # the role's utilisation target is scaled by this, lowered while the SLO is missed
    mean_input: float = 0.0  # prompt tokens per request, smoothed over minutes (prefill's queueing headroom)
    last_down: float = -math.inf  # s, last scale-down
    last_burst: float = -math.inf  # s, last burst the fast loop answered
    hold_s: float = 0.0  # s, the stabilisation window now (0: the scale-down cooldown); grows on regret
    peak_need: float = 0.0  # replicas, the largest burst need seen (at peak_at; it decays from there)
    peak_at: float = -math.inf  # s
    down_from: int = 0  # replicas the role had before its last scale-down
    floor: float = 0.0  # replicas a burst after a scale-down proved standing (decode), learned at floor_at; decays
    floor_at: float = -math.inf  # s
    levels: tuple[tuple[float, float], ...] = ()  # (s, need in replicas) over the level window (bursts held)


@dataclass(frozen=True)
class ControllerState:
    """The law's whole memory: an actuator passes back what the last decision returned."""

    prefill: RoleState = field(default_factory=RoleState)
    decode: RoleState = field(default_factory=RoleState)
    load: tuple[tuple[float, float], ...] = ()  # (s, prompt tokens/s both pools computed) over the smoothness window

    def role(self, name: str) -> RoleState:
        return self.prefill if name == "prefill" else self.decode

    def to_json(self) -> dict[str, Any]:
        def enc(v: Any) -> Any:
            if isinstance(v, tuple):
                return [list(x) for x in v]
            return None if isinstance(v, float) and math.isinf(v) else v

        return {"version": STATE_VERSION, "load": enc(self.load),
                **{role: {k: enc(v) for k, v in asdict(self.role(role)).items()} for role in ROLES}}

    @classmethod
    def from_json(cls, data: Any) -> ControllerState:
        """The state `to_json` wrote; ValueError naming what is wrong (another version, an unknown field, a value
        that is not a finite number), so an actuator can start afresh instead of deciding from garbage."""
        if not isinstance(data, dict):
            raise ValueError("law state: not an object")
        if data.get("version") != STATE_VERSION:
            raise ValueError(f"law state: version {data.get('version')!r}, this law reads {STATE_VERSION}")
        unknown = set(data) - {"version", "load", *ROLES}
        if unknown:
            raise ValueError(f"law state: unknown keys {sorted(unknown)}")
        return cls(**{role: _role(role, data.get(role, {})) for role in ROLES},
                   load=_series(data.get("load", []), "law state: load"))


def _role(role: str, d: Any) -> RoleState:
    if not isinstance(d, dict):
        raise ValueError(f"law state: {role} is not an object")
    known = {f.name for f in fields(RoleState)}
    unknown = set(d) - known
    if unknown:
        raise ValueError(f"law state: {role}: unknown fields {sorted(unknown)}")
    out: dict[str, Any] = {}
    for k, v in d.items():
        where = f"law state: {role}.{k}"
        if k in _SERIES:
            out[k] = _series(v, where)
        elif k in _TIMES:
            out[k] = -math.inf if v is None else _number(v, where)
        elif k == "planned" and v is None:
            out[k] = None
        else:
            out[k] = _number(v, where)
    return RoleState(**out)


def _series(v: Any, where: str) -> tuple[tuple[float, float], ...]:
    if not isinstance(v, list) or not all(isinstance(x, list) and len(x) == 2 for x in v):
        raise ValueError(f"{where}: not a list of [s, value] pairs")
    return tuple((_number(x[0], where), _number(x[1], where)) for x in v)


def _number(v: Any, where: str) -> float:
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
        raise ValueError(f"{where}: {v!r} is not a finite number")
    return v
