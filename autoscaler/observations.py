"""What the control law sees: one `Observation` per decision, a `RoleObservation` per pool over the last window.

Every field comes from metrics the gateways and workers already report or can report (queue depth, KV usage,
TTFT/ITL histograms, membership's ready/starting/draining counts); the simulator fills the same dataclasses
from its own workers. Plain data, no behaviour beyond small derived values.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Percentiles:
    """Latency percentiles over the window (s); None when the window saw no sample."""

    p50: float | None = None
    p90: float | None = None
    p99: float | None = None
    count: int = 0  # samples behind them

    @classmethod
    def of(cls, values: Sequence[float]) -> Percentiles:
        if not values:
            return cls()
        s = sorted(values)

        def q(x: float) -> float:
            return s[min(len(s) - 1, int(round(x * (len(s) - 1))))]

        return cls(q(0.5), q(0.9), q(0.99), len(s))

    def over(self, objective: float) -> bool:
        """The p90 misses the objective (p90 is what SLOSpec declares)."""
        return self.p90 is not None and self.p90 > objective


@dataclass(frozen=True)
class RoleObservation:
    """One pool (prefill, or decode) over the window."""

    role: str  # prefill | decode
    replicas_ready: int  # serving (healthy, not draining)
    replicas_starting: int = 0  # asked for, still loading the model
    replicas_draining: int = 0  # finishing their requests before they exit
    replicas_flipping: int = 0  # coming from the other role by a flip (draining its work there, or switching)
    idle_replicas: int = 0  # ready replicas with nothing running or waiting now
    arrival_rate: float = 0.0  # requests/s this pool received
    input_tokens_per_s: float = 0.0  # prompt tokens/s this pool had to compute (after prefix-cache hits)
    output_tokens_per_s: float = 0.0  # output tokens/s asked of this pool (decode; max_tokens of arrivals)
    mean_input_tokens: float = 0.0  # per request this pool received
    mean_output_tokens: float = 0.0
    num_waiting: int = 0  # requests queued on this pool's workers now (not yet running)
    waiting_prefill_tokens: int = 0  # prompt tokens not yet computed on this pool's workers now
    num_running: int = 0  # requests running on this pool's workers now
    kv_usage: float = 0.0  # mean fraction of KV blocks in use over ready replicas
    busy_fraction: float = 0.0  # fraction of the window the ready replicas spent in engine steps
    ttft: Percentiles = field(default_factory=Percentiles)  # of requests whose first token came in the window
    itl: Percentiles = field(default_factory=Percentiles)  # of inter-token gaps in the window (decode)
    queue_wait: Percentiles = field(default_factory=Percentiles)  # s prompts waited for their first step here

    @property
    def replicas(self) -> int:
        """Replicas the law counts as this pool's (ready, starting and flipping in; draining ones, and ones
        flipping out, are on their way out)."""
        return self.replicas_ready + self.replicas_starting + self.replicas_flipping

    @property
    def replicas_arriving(self) -> int:
        """Replicas asked for that do not serve yet (loading, or flipping in)."""
        return self.replicas_starting + self.replicas_flipping


@dataclass(frozen=True)
class Observation:
    """Everything the law sees at one decision."""

    time: float  # s, any monotonic clock (the simulator's, or time.monotonic())
    window_seconds: float  # s the rates and percentiles cover
    prefill: RoleObservation
    decode: RoleObservation

    def role(self, name: str) -> RoleObservation:
        return self.prefill if name == "prefill" else self.decode
