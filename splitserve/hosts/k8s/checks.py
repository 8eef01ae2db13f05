"""Specs the schema accepts but no deployment can realise, found before anything is applied. Each problem is an
`Unrealisable` (a CamelCase reason and a one-line message naming the field), reported as the Degraded condition.
"""

from __future__ import annotations

import re

from splitserve.common import engines
from splitserve.common.config import ClusterResource, RoleSpec
from splitserve.hosts.k8s.crd import NAME_MAX
from splitserve.hosts.k8s.replicas import Unrealisable

GPU = "nvidia.com/gpu"
_DNS_1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")


def gpus_per_pod(role: RoleSpec) -> int | None:
    """The GPUs a role's pod asks for (limits first, as the device plugin reads them); None: not said."""
    for section in ("limits", "requests"):
        value = role.resources.get(section, {}).get(GPU)
        if value is not None:
            return int(value)
    return None


def check(resource: ClusterResource) -> None:
    """Raise Unrealisable for the first problem found."""
    name, spec = resource.metadata.name, resource.spec
    if not _DNS_1035.match(name) or len(name) > NAME_MAX:
        raise Unrealisable("InvalidName", f"metadata.name: {name!r} must be a DNS label that starts with a letter, "
                                          f"at most {NAME_MAX} characters")
    redis = spec.redis
    if redis.mode == "external" and not redis.url and redis.url_secret is None:
        raise Unrealisable("RedisURLMissing", "redis.mode is external but neither redis.url nor redis.urlSecret is set")
    tp = spec.model.tensor_parallel_size
    if spec.mode == "disaggregated" and tp > 1 and not engines.get(spec.engine_of("decode")).shards_handover:
        raise Unrealisable("ShardedDisaggregationUnsupported",
                           f"model.tensorParallelSize {tp} needs mode: colocated (streaming KV between sharded prefill "
                           "and decode workers is not supported yet)")
    roles = [("decode", spec.decode)] + ([("prefill", spec.prefill)] if spec.mode == "disaggregated" else [])
    for role_name, role in roles:
        gpus, want = gpus_per_pod(role), spec.gpus_per_worker(role_name)
        if gpus is not None and gpus != want:
            dp = role.engine.data_parallel_size
            raise Unrealisable("GPUCountMismatch",
                               f"{role_name}.resources: {GPU} is {gpus} but model.tensorParallelSize is {tp}"
                               + (f" and {role_name}.engine.dataParallelSize {dp}" if dp > 1 else "")
                               + f": {want} (each pod runs one process per GPU)")
