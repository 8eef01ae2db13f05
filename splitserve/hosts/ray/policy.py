"""The control law on Ray Serve: an application-level autoscaling policy (`LawPolicy`), the fourth actuator of
the one law next to the operator, `splitserve up --autoscale` and the simulator. Serve's controller calls it with
an `AutoscalingContext` per deployment; it observes the cluster as every actuator does (`Observer`: the Redis
registry, the gateways' and workers' /metrics), calls `law.decide` through the shared `Autoscaler`, and returns
each role's replicas. The law's `ControllerState` is its only memory: the deployments' own delays are zero
(`app` sets them), so Serve adds no second hysteresis, only each role's minReplicas..maxReplicas.

Role flips: the decision's flip goes to the least loaded workers of its source role (their gRPC Flip call, on a
thread of its own: Serve's control loop does not wait). A flipped worker stays a replica of its deployment,
serving the other role; each deployment is sized for the replicas it holds (`Placement.group_size`), and the
policy state of each deployment lists the workers serving its role and those flipped in. Serve picks which
replica a scale-down stops: it may be a flipped one, which the next decision then sees gone from its role.

`Directory` owns the one thing Ray adds to the wire: where an application's Redis and its gateways' /metrics
are, in Ray's internal key-value store, so the policy (in Serve's controller) finds what replicas started.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Mapping
from typing import Any

from splitserve.autoscaler.actuator import Autoscaler, default_profile, load_profile
from splitserve.autoscaler.flips import RoleFlip
from splitserve.autoscaler.law import ROLES, ScalingDecision
from splitserve.autoscaler.observer import Observer
from splitserve.common.config import ClusterResource, ClusterSpec
from splitserve.hosts.common import Placement, flip_candidates, flip_workers

log = logging.getLogger("ray.serve")  # the controller's log (logs/serve/controller_*.log)

# Deployment names: the pools the law sizes are the deployments of the same name.
DEPLOYMENTS = {"prefill": "prefill", "decode": "decode"}


def pool_of(name: str) -> str | None:
    """A worker's deployment from its registry name (`app.Worker` names it `<pool>-<replica id>`)."""
    return next((pool for pool in DEPLOYMENTS if name.startswith(pool + "-")), None)


class Directory:
    """An application's Redis URL and gateway /metrics URLs in Ray's internal KV (namespace `splitserve`, keys
    `v1/<app>/redis` and `v1/<app>/gateway/<replica>`; values are UTF-8 URLs). Needs a connected Ray worker."""

    NAMESPACE = "splitserve"
    VERSION = "v1"

    def __init__(self, app: str) -> None:
        self.prefix = f"{self.VERSION}/{app}/"

    @staticmethod
    def _kv():
        from ray.experimental import internal_kv  # the store Ray's own components share; no public equivalent

        return internal_kv

    def _put(self, key: str, value: str) -> None:
        self._kv()._internal_kv_put(self.prefix + key, value.encode(), overwrite=True, namespace=self.NAMESPACE)

    def put_redis(self, url: str) -> None:
        self._put("redis", url)

    def redis(self) -> str | None:
        raw = self._kv()._internal_kv_get(self.prefix + "redis", namespace=self.NAMESPACE)
        return raw.decode() if raw else None

    def put_gateway(self, replica: str, metrics_url: str) -> None:
        self._put(f"gateway/{replica}", metrics_url)

    def drop_gateway(self, replica: str) -> None:
        self._kv()._internal_kv_del(self.prefix + f"gateway/{replica}", namespace=self.NAMESPACE)

    def gateways(self) -> list[str]:
        kv = self._kv()
        keys = kv._internal_kv_list(self.prefix + "gateway/", namespace=self.NAMESPACE) or []
        urls = [kv._internal_kv_get(k, namespace=self.NAMESPACE) for k in sorted(keys)]
        return [u.decode() for u in urls if u]

    def clear(self) -> None:
        kv = self._kv()
        for key in kv._internal_kv_list(self.prefix, namespace=self.NAMESPACE) or []:
            kv._internal_kv_del(key, namespace=self.NAMESPACE)


def policy_config(resource: ClusterResource, profile: str | None = None) -> dict[str, Any]:
    """The application's `autoscaling_policy` (a Serve config's field): this class, built once in Serve's
    controller from the cluster document."""
    doc = resource.model_dump(by_alias=True, mode="json", exclude_none=True, exclude={"status"})
    kwargs: dict[str, Any] = {"cluster": doc}
    if profile:
        kwargs["profile"] = profile
    return {"policy_function": f"{__name__}:LawPolicy", "policy_kwargs": kwargs}


class LawPolicy:
    """`(contexts by deployment) -> (replicas by deployment, policy state)`, as Serve's application-level policy
    API asks. Serve calls it every control-loop iteration; the `Autoscaler` decides at most once per
    `autoscaling.intervalSeconds` and the policy holds the current targets in between. `observer` and `app`
    are for tests (an observation source and the application name; by default the live cluster's)."""

    def __init__(self, cluster: Mapping[str, Any], profile: str | None = None, *, observer: Any = None,
                 clock: Any = None) -> None:
        self.resource = ClusterResource.model_validate(cluster)
        self.spec: ClusterSpec = self.resource.spec
        self.profile = load_profile(profile or default_profile(self.spec))
        self._observer = observer
        self._clock = clock
        self.autoscaler: Autoscaler | None = None
        self.last: ScalingDecision | None = None
        self.flipper = flip_workers  # (name -> endpoint, role) -> name -> why not (None: flipped)
        self.flipping: threading.Thread | None = None  # the last flip's calls

    def _make(self, app: str) -> Autoscaler | None:
        """The shared Autoscaler, once the Redis registry it observes is known (a Redis deployment publishes its
        URL when it is up)."""
        observer = self._observer
        if observer is None:
            directory = Directory(app)
            url = self.spec.redis.resolved_url() or directory.redis()
            if url is None:
                return None
            observer = Observer(url, self.spec.model.served_name, directory.gateways,
                                colocated=self.spec.mode == "colocated", timeout_s=1.0)
            self._observer = observer
        kwargs = {"clock": self._clock} if self._clock is not None else {}
        return Autoscaler(self.resource.metadata.name, self.spec, observer, self.profile, **kwargs)

    def __call__(self, contexts: Mapping[Any, Any]) -> tuple[dict[Any, int], dict[Any, dict]]:
        by_role = {role: dep for dep in contexts for role, name in DEPLOYMENTS.items() if dep.name == name}
        targets = {role: contexts[dep].target_num_replicas for role, dep in by_role.items()}
        hold = {dep: targets[role] for role, dep in by_role.items()}
        if self.autoscaler is None:
            app = next(iter(contexts.values())).app_name if contexts else ""
            self.autoscaler = self._make(app)
            if self.autoscaler is None:
                return hold, {}
        where = self._placement()
        expected = {role: targets.get(role, 0) if where is None else max(
            0, targets.get(role, 0) - len(where.flipped_out(role)) + len(where.flipped_in.get(role, [])))
            for role in ROLES}  # replicas serving each role: a flipped replica counts where it serves
        decision = self.autoscaler.tick(expected)  # logs the decision with its reason; None between intervals
        if decision is None:
            return hold, {}
        self.last = decision
        if decision.changed:
            log.info("splitserve control law: %s", decision.reason)
        if decision.flip is not None and where is not None:
            where = self._flip(decision.flip, where)
        status = decision.as_status()
        desired = {role: getattr(decision, role).desired for role in ROLES}
        out = {dep: desired[role] if where is None else where.group_size(role, desired[role])
               for role, dep in by_role.items()}
        placed = {role: {} if where is None else where.as_status(role) for role in ROLES}
        state = {dep: {"splitserve": json.dumps(status[role] | placed[role])} for role, dep in by_role.items()}
        return out, state

    def _placement(self) -> Placement | None:
        """Which workers serve which role, from the registry as the observer last read it (disaggregated)."""
        entries = getattr(self._observer, "entries", None)
        if self.spec.mode != "disaggregated" or entries is None:
            return None
        return Placement.of(entries.values(), pool_of)

    def _flip(self, flip: RoleFlip, where: Placement) -> Placement:
        """Start the flip's calls (least loaded workers of its source role) and return the placement they make;
        one that fails leaves its worker where it is, which the next decision sees."""
        entries = self._observer.entries
        chosen = flip_candidates(entries.values(), flip.source)[:flip.workers]
        endpoints = {n: entries[n].endpoint for n in chosen}

        def run() -> None:
            for name, problem in self.flipper(endpoints, flip.target).items():
                if problem is None:
                    log.info("splitserve: %s serves %s (flipped from %s)", name, flip.target, flip.source)
                else:
                    log.warning("splitserve: %s did not flip to %s: %s", name, flip.target, problem)

        self.flipping = threading.Thread(target=run, name="role-flips", daemon=True)
        self.flipping.start()
        return where.moved(chosen, flip.source, flip.target, pool_of)
