"""The status the operator writes on a SplitServeCluster, as typed models (their JSON Schema is the CRD's status
schema, so the shape is declared once), and the conditions' bookkeeping: Ready, Progressing and Degraded, each
keeping its lastTransitionTime until its status flips.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel

CONDITION_TYPES = ("Ready", "Progressing", "Degraded")


class _Status(BaseModel):
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, use_attribute_docstrings=True,
                              extra="ignore")


class Condition(_Status):
    """One condition, as Kubernetes writes them (metav1.Condition)."""

    type: Literal["Ready", "Progressing", "Degraded"]
    """Ready: every component has its desired replicas ready; Progressing: a change is rolling out;
    Degraded: the spec is valid but cannot be realised (see reason)."""
    status: Literal["True", "False", "Unknown"]
    """True, False or Unknown."""
    reason: str = Field(pattern=r"^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$")
    """A CamelCase word machines can match on."""
    message: str = ""
    """What a person should know."""
    last_transition_time: str
    """When status last changed (RFC 3339)."""
    observed_generation: int | None = None
    """The spec generation this condition was computed from."""


class Replicas(_Status):
    """Replicas per component."""

    prefill: int = 0
    """Prefill workers (0 in colocated mode)."""
    decode: int = 0
    """Decode workers (colocated workers in colocated mode)."""
    gateway: int = 0
    """Gateway replicas."""


class Decision(_Status):
    """The replicas the operator last applied, and why."""

    prefill: int
    """Prefill replicas applied."""
    decode: int
    """Decode replicas applied."""
    reason: str
    """Where the numbers came from (spec, scale subresource, autoscaler) and which bound clamped them."""
    time: str
    """When the decision last changed (RFC 3339)."""


class ClusterStatus(_Status):
    """What the operator reports on a SplitServeCluster."""

    observed_generation: int | None = None
    """The spec generation the operator last reconciled."""
    model: str | None = None
    """The served model name."""
    prefill: str | None = None
    """Prefill workers ready/desired (a printer column)."""
    decode: str | None = None
    """Decode workers ready/desired (a printer column)."""
    ratio: float | None = None
    """prefill:decode of the desired replicas (none in colocated mode)."""
    ready_replicas: Replicas | None = None
    """Replicas ready per component."""
    desired_replicas: Replicas | None = None
    """Replicas desired per component (after the ratio and min/max clamps)."""
    last_decision: Decision | None = None
    """The last replica decision."""
    law_state: dict[str, Any] | None = None
    """The SLO control law's memory (slo and external modes; versioned JSON, autoscaler/law_state.py): a restarted
    operator continues from it instead of starting the law afresh."""
    conditions: list[Condition] = Field(default_factory=list)
    """Ready, Progressing and Degraded."""


class RoleStatus(_Status):
    """What the operator reports on a SplitServeRole (read by the scale subresource)."""

    replicas: int = 0
    """Pods that serve this role now (the scale subresource's status.replicas): its Deployment's, less those
    flipped to the other role, plus those flipped in."""
    ready_replicas: int = 0
    """Of those, the ready ones."""
    selector: str = ""
    """Label query matching this role's pods (the scale subresource's status.selector, read by HPA)."""
    serving_pods: list[str] | None = None
    """Pods that serve this role now, as the Redis registry lists them (role flips included); absent without a
    registry."""
    flipped_pods: list[str] | None = None
    """Of those, pods of the other role's Deployment that serve this role after a role flip (their Deployment
    keeps them)."""


def now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def set_condition(conditions: list[Condition], type_: str, status: bool, reason: str, message: str,
                  generation: int | None) -> list[Condition]:
    """`conditions` with `type_` set; its lastTransitionTime moves only when its status changes."""
    value = "True" if status else "False"
    old = next((c for c in conditions if c.type == type_), None)
    since = old.last_transition_time if old is not None and old.status == value else now()
    new = Condition(type=type_, status=value, reason=reason, message=message, last_transition_time=since,
                    observed_generation=generation)
    rest = [c for c in conditions if c.type != type_]
    return sorted([*rest, new], key=lambda c: CONDITION_TYPES.index(c.type))


def dump(status: BaseModel) -> dict:
    return status.model_dump(by_alias=True, exclude_none=True, mode="json")
