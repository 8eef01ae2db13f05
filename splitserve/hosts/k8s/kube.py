"""The operator's only door to the API server: JSON objects in and out over the official `kubernetes` client's
ApiClient (auth, TLS, in-cluster or kubeconfig credentials), for any kind in `names`. Handlers get it injected, so
tests point it at an emulator and production at the cluster.

Writes are server-side apply (field manager `splitserve-operator`, forced): fields the operator stops setting are
removed, fields others own (an HPA's replicas on a role, another controller's annotations) are kept. An API
server that answers the apply with 404 (one without server-side apply for a missing object) gets a create.
"""

from __future__ import annotations

import json
from typing import Any

import kubernetes

from splitserve.hosts.k8s import names

JSON = "application/json"
MERGE_PATCH = "application/merge-patch+json"
APPLY_PATCH = "application/apply-patch+yaml"
TIMEOUT_S = 30.0


class KubeError(Exception):
    """An API call failed; `status` is the HTTP status (0: no answer)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"{status}: {message}" if status else message)
        self.status = status

    @property
    def transient(self) -> bool:
        """Worth retrying as is: no answer, conflicts, throttling, server errors."""
        return self.status in (0, 409, 429) or self.status >= 500


class Kube:
    def __init__(self, api: kubernetes.client.ApiClient) -> None:
        self.api = api

    @classmethod
    def from_environment(cls) -> Kube:
        """In a pod: its service account; elsewhere: the current kubeconfig context."""
        config = kubernetes.client.Configuration()
        try:
            kubernetes.config.load_incluster_config(client_configuration=config)
        except kubernetes.config.ConfigException:
            kubernetes.config.load_kube_config(client_configuration=config)
        return cls(kubernetes.client.ApiClient(config))

    @classmethod
    def for_url(cls, url: str) -> Kube:
        """An unauthenticated client of `url` (a local proxy or an emulator)."""
        return cls(kubernetes.client.ApiClient(kubernetes.client.Configuration(host=url.rstrip("/"))))

    def _call(self, method: str, path: str, body: Any = None, query: list[tuple[str, str]] | None = None,
              content_type: str = JSON) -> dict[str, Any]:
        headers = {"Accept": JSON, "Content-Type": content_type}
        request = self.api.param_serialize(method, path, query_params=query or [], header_params=headers, body=body,
                                           auth_settings=["BearerToken"])
        try:
            response = self.api.call_api(*request, _request_timeout=TIMEOUT_S)
            raw = response.read()
        except kubernetes.client.exceptions.ApiException as e:  # the client's own retries gave up
            raise KubeError(e.status or 0, str(e.reason)) from None
        except OSError as e:
            raise KubeError(0, f"{method} {path}: {e}") from None
        except Exception as e:  # urllib3's errors are not OSErrors
            if type(e).__module__.startswith("urllib3"):
                raise KubeError(0, f"{method} {path}: {e}") from None
            raise
        data = json.loads(raw) if raw else {}
        if not 200 <= response.status < 300:
            raise KubeError(response.status, data.get("message") or f"{method} {path}")
        return data

    def get(self, kind: names.Kind, namespace: str, name: str) -> dict[str, Any] | None:
        try:
            return self._call("GET", kind.path(namespace, name))
        except KubeError as e:
            if e.status == 404:
                return None
            raise

    def list(self, kind: names.Kind, namespace: str, match: dict[str, str]) -> list[dict[str, Any]]:
        """Objects of `kind` in `namespace` whose labels include `match` (filtered here too: not every server does)."""
        query = [("labelSelector", ",".join(f"{k}={v}" for k, v in match.items()))]
        items = self._call("GET", kind.path(namespace), query=query).get("items", [])
        return [o for o in items if match.items() <= (o.get("metadata", {}).get("labels") or {}).items()]

    def create(self, obj: dict[str, Any]) -> dict[str, Any]:
        kind, meta = names.KINDS[obj["kind"]], obj["metadata"]
        return self._call("POST", kind.path(meta["namespace"]), obj, query=[("fieldManager", names.FIELD_MANAGER)])

    def apply(self, obj: dict[str, Any]) -> dict[str, Any]:
        """Server-side apply `obj` (create it if the server will not)."""
        kind, meta = names.KINDS[obj["kind"]], obj["metadata"]
        query = [("fieldManager", names.FIELD_MANAGER), ("force", "true")]
        try:
            return self._call("PATCH", kind.path(meta["namespace"], meta["name"]), obj, query, APPLY_PATCH)
        except KubeError as e:
            if e.status != 404:
                raise
        return self.create(obj)

    def patch(self, kind: names.Kind, namespace: str, name: str, patch: dict[str, Any],
              subresource: str | None = None) -> dict[str, Any]:
        """A JSON merge patch (None deletes a key); `subresource` e.g. "status"."""
        path = kind.path(namespace, name) + (f"/{subresource}" if subresource else "")
        return self._call("PATCH", path, patch, content_type=MERGE_PATCH)

    def delete(self, kind: names.Kind, namespace: str, name: str) -> bool:
        """Delete (pods and other dependents in the background); False if it was gone already."""
        try:
            self._call("DELETE", kind.path(namespace, name), {"propagationPolicy": "Background"})
        except KubeError as e:
            if e.status == 404:
                return False
            raise
        return True
