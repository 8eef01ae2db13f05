"""Test helper: the Kubernetes `restricted` Pod Security Standard (which includes `baseline`), checked rule by rule
as https://kubernetes.io/docs/concepts/security/pod-security-standards/ states it for Kubernetes 1.33, plus
splitserve's own rules for every container (a numeric runAsUser, a read-only root filesystem, cpu and memory
requests and limits so a ResourceQuota admits the pod). `violations` returns one line per broken rule."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

WORKLOADS = ("Deployment", "StatefulSet", "DaemonSet", "ReplicaSet", "Job")

SAFE_SYSCTLS = {"kernel.shm_rmid_forced", "net.ipv4.ip_local_port_range", "net.ipv4.ip_unprivileged_port_start",
                "net.ipv4.tcp_syncookies", "net.ipv4.ping_group_range", "net.ipv4.ip_local_reserved_ports",
                "net.ipv4.tcp_keepalive_time", "net.ipv4.tcp_fin_timeout", "net.ipv4.tcp_keepalive_intvl",
                "net.ipv4.tcp_keepalive_probes"}
SELINUX_TYPES = {"", "container_t", "container_init_t", "container_kvm_t", "container_engine_t"}
RESTRICTED_VOLUMES = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim",
                      "projected", "secret"}
APPARMOR_ANNOTATION = "container.apparmor.security.beta.kubernetes.io/"


def pod_templates(objects: list[dict[str, Any]]) -> Iterator[tuple[str, dict[str, Any]]]:
    """(`Kind/name`, pod template) of every workload in `objects` (a Pod is its own template)."""
    for obj in objects:
        name = f"{obj['kind']}/{obj['metadata']['name']}"
        if obj["kind"] == "Pod":
            yield name, obj
        elif obj["kind"] in WORKLOADS:
            yield name, obj["spec"]["template"]
        elif obj["kind"] == "CronJob":
            yield name, obj["spec"]["jobTemplate"]["spec"]["template"]


def _containers(spec: dict[str, Any]) -> list[dict[str, Any]]:
    return [*spec.get("initContainers", []), *spec.get("containers", []), *spec.get("ephemeralContainers", [])]


def _effective(pod_sc: dict[str, Any], sc: dict[str, Any], key: str) -> Any:
    """A setting as the kubelet applies it: the container's, else the pod's."""
    return sc[key] if sc.get(key) is not None else pod_sc.get(key)


def violations(template: dict[str, Any]) -> list[str]:
    """Every rule of the restricted standard (and splitserve's extras) that a pod template breaks."""
    meta, spec = template.get("metadata") or {}, template["spec"]
    pod_sc = spec.get("securityContext") or {}
    out: list[str] = []
    # -- baseline ------------------------------------------------------------------------------------------
    for key in ("hostNetwork", "hostPID", "hostIPC"):
        if spec.get(key):
            out.append(f"baseline/host namespaces: {key} is true")
    if (pod_sc.get("windowsOptions") or {}).get("hostProcess"):
        out.append("baseline/HostProcess: pod windowsOptions.hostProcess")
    for volume in spec.get("volumes", []):
        if "hostPath" in volume:
            out.append(f"baseline/hostPath volumes: volume {volume['name']}")
    for key, value in (meta.get("annotations") or {}).items():
        if key.startswith(APPARMOR_ANNOTATION) and not (value == "runtime/default" or value.startswith("localhost/")):
            out.append(f"baseline/AppArmor: annotation {key}={value}")
    for name in (s["name"] for s in pod_sc.get("sysctls", [])):
        if name not in SAFE_SYSCTLS:
            out.append(f"baseline/sysctls: {name}")
    out += _selinux("pod", pod_sc)
    out += _apparmor("pod", pod_sc)
    # -- restricted: the pod ---------------------------------------------------------------------------------
    for volume in spec.get("volumes", []):
        kinds = set(volume) - {"name"}
        if not kinds <= RESTRICTED_VOLUMES:
            out.append(f"restricted/volume types: volume {volume['name']} is {sorted(kinds)}")
    if pod_sc.get("runAsNonRoot") is False:
        out.append("restricted/running as non-root: pod runAsNonRoot is false")
    if pod_sc.get("runAsUser") == 0:
        out.append("restricted/running as non-root user: pod runAsUser is 0")
    pod_seccomp = (pod_sc.get("seccompProfile") or {}).get("type")
    if pod_seccomp is not None and pod_seccomp not in ("RuntimeDefault", "Localhost"):
        out.append(f"restricted/seccomp: pod seccompProfile is {pod_seccomp}")
    # -- every container ------------------------------------------------------------------------------------
    for c in _containers(spec):
        sc, who = c.get("securityContext") or {}, f"container {c['name']}"
        if (sc.get("windowsOptions") or {}).get("hostProcess"):
            out.append(f"baseline/HostProcess: {who}")
        if sc.get("privileged"):
            out.append(f"baseline/privileged: {who}")
        for port in c.get("ports", []):
            if port.get("hostPort"):
                out.append(f"baseline/host ports: {who} hostPort {port['hostPort']}")
        if sc.get("procMount", "Default") != "Default":
            out.append(f"baseline/proc mount: {who} procMount {sc['procMount']}")
        out += _selinux(who, sc)
        out += _apparmor(who, sc)
        if sc.get("allowPrivilegeEscalation") is not False:
            out.append(f"restricted/privilege escalation: {who} does not set allowPrivilegeEscalation false")
        if _effective(pod_sc, sc, "runAsNonRoot") is not True:
            out.append(f"restricted/running as non-root: {who} runAsNonRoot is not true (pod or container)")
        if sc.get("runAsUser") == 0:
            out.append(f"restricted/running as non-root user: {who} runAsUser is 0")
        seccomp = (sc.get("seccompProfile") or {}).get("type") or pod_seccomp
        if seccomp not in ("RuntimeDefault", "Localhost"):
            out.append(f"restricted/seccomp: {who} seccompProfile is {seccomp} (pod or container)")
        caps = sc.get("capabilities") or {}
        if "ALL" not in caps.get("drop", []):
            out.append(f"restricted/capabilities: {who} does not drop ALL")
        if set(caps.get("add", [])) - {"NET_BIND_SERVICE"}:
            out.append(f"restricted/capabilities: {who} adds {sorted(set(caps['add']) - {'NET_BIND_SERVICE'})}")
        # -- splitserve's own rules ------------------------------------------------------------------------
        user = _effective(pod_sc, sc, "runAsUser")
        if not isinstance(user, int) or isinstance(user, bool):
            out.append(f"splitserve/numeric user: {who} has no numeric runAsUser (pod or container)")
        if sc.get("readOnlyRootFilesystem") is not True:
            out.append(f"splitserve/read-only root: {who} readOnlyRootFilesystem is not true")
        resources = c.get("resources") or {}
        for side in ("requests", "limits"):
            missing = {"cpu", "memory"} - set(resources.get(side) or {})
            if missing:
                out.append(f"splitserve/resources: {who} has no {side} for {sorted(missing)}")
    return out


def _selinux(who: str, sc: dict[str, Any]) -> list[str]:
    options = sc.get("seLinuxOptions") or {}
    out = []
    if options.get("type", "") not in SELINUX_TYPES:
        out.append(f"baseline/SELinux: {who} type {options['type']}")
    if options.get("user") or options.get("role"):
        out.append(f"baseline/SELinux: {who} sets user or role")
    return out


def _apparmor(who: str, sc: dict[str, Any]) -> list[str]:
    kind = (sc.get("appArmorProfile") or {}).get("type")
    return [] if kind in (None, "RuntimeDefault", "Localhost") else [f"baseline/AppArmor: {who} profile {kind}"]
