"""The few Kubernetes API calls the operator makes itself: server-side apply of children, reads of pods, nodes,
deployments and config maps, status patches of HybridModels, and events.

kopf's own client is private, so this one is built from the `kopf.ConnectionInfo` that the login handler obtains
(service account in a cluster, kubeconfig elsewhere). Everything here is asyncio and aiohttp, as kopf is.
"""

from __future__ import annotations

import asyncio
import json
import os
import ssl
import tempfile
from collections.abc import Mapping
from typing import Any
from urllib.parse import quote

import aiohttp
import yaml

from hybridkv.errors import UserError
from hybridkv.operator.manifests import FIELD_MANAGER

REQUEST_TIMEOUT_S = 30.0
# Pods and nodes listed per page: bounded memory on large clusters.
LIST_PAGE_LIMIT = 500

# (group/version, plural) of the kinds the operator touches; the core group has no group part.
API_PATHS = {
    "Deployment": ("apps/v1", "deployments"),
    "Service": ("v1", "services"),
    "Pod": ("v1", "pods"),
    "Node": ("v1", "nodes"),
    "ConfigMap": ("v1", "configmaps"),
    "HybridModel": ("hybridkv.io/v1alpha1", "hybridmodels"),
    "Event": ("v1", "events"),
    "Secret": ("v1", "secrets"),
    "HorizontalPodAutoscaler": ("autoscaling/v2", "horizontalpodautoscalers"),
    "NetworkPolicy": ("networking.k8s.io/v1", "networkpolicies"),
}


# Kubeconfig user fields that ask the client to impersonate someone else (kubectl's --as, --as-group, --as-uid).
IMPERSONATION_FIELDS = ("as", "as-groups", "as-uid", "as-user-extra")


class ImpersonationError(UserError):
    """The kubeconfig asks for impersonation, which kopf's client cannot send; running without it would be wrong."""


def kubeconfig_paths() -> list[str]:
    """The kubeconfig files kopf's kubeconfig login reads, in its order: $KUBECONFIG's list, else ~/.kube/config."""
    kubeconfig = os.environ.get("KUBECONFIG")
    if not kubeconfig and os.path.exists(os.path.expanduser("~/.kube/config")):
        kubeconfig = "~/.kube/config"
    return [os.path.expanduser(path.strip()) for path in (kubeconfig or "").split(os.pathsep) if path.strip()]


def refuse_impersonation() -> None:
    """ImpersonationError when the current context's user of the kubeconfig impersonates (`as:` and the like).

    kopf's own requests (watches, patches) would silently go out as the real user, so a permission check by
    impersonation would pass falsely: the operator refuses to start instead. The first value of a key wins, as in kopf.
    """
    current_context: str | None = None
    contexts: dict[str, dict] = {}
    users: dict[str, dict] = {}
    for path in kubeconfig_paths():
        try:
            with open(path, encoding="utf-8") as handle:
                config = yaml.safe_load(handle) or {}
        except (OSError, yaml.YAMLError):
            return  # kopf's login reports an unreadable kubeconfig itself
        if not isinstance(config, dict):
            return
        current_context = current_context or config.get("current-context")
        for item in config.get("contexts") or []:
            contexts.setdefault(item.get("name"), item.get("context") or {})
        for item in config.get("users") or []:
            users.setdefault(item.get("name"), item.get("user") or {})
    user_name = contexts.get(current_context, {}).get("user")
    asked = [key for key in IMPERSONATION_FIELDS if users.get(user_name, {}).get(key)]
    if asked:
        raise ImpersonationError(
            f"the kubeconfig user {user_name!r} of context {current_context!r} impersonates ({', '.join(asked)}), "
            "which the operator's Kubernetes client cannot do; use a kubeconfig with the identity's own credentials "
            "(for the chart's ServiceAccount: kubectl create token), or check permissions with kubectl auth can-i --as"
        )


class KubeApiError(Exception):
    """An API call failed; `status` is the HTTP status, `reason` the Kubernetes Status reason."""

    def __init__(self, status: int, reason: str, message: str):
        super().__init__(f"HTTP {status} {reason}: {message}")
        self.status = status
        self.reason = reason
        self.message = message


def resource_path(kind: str, namespace: str | None, name: str | None = None, subresource: str | None = None) -> str:
    group_version, plural = API_PATHS[kind]
    path = f"/api/{group_version}" if "/" not in group_version else f"/apis/{group_version}"
    if namespace is not None:
        path += f"/namespaces/{quote(namespace, safe='')}"
    path += f"/{plural}"
    if name is not None:
        path += f"/{quote(name, safe='')}"
    if subresource is not None:
        path += f"/{subresource}"
    return path


def _pem_file(directory: str, filename: str, data: str | bytes) -> str:
    # ssl loads client certificates only from files; they live in a private temporary folder.
    path = os.path.join(directory, filename)
    with open(path, "wb") as handle:
        handle.write(data.encode() if isinstance(data, str) else data)
    return path


class KubeApi:
    """An aiohttp session against one API server; `connect()` sets (and on re-login replaces) the credentials."""

    def __init__(self) -> None:
        self._server: str | None = None
        self._token: str | None = None
        self._token_file: str | None = None
        self._basic_auth: aiohttp.BasicAuth | None = None
        self._scheme = "Bearer"
        self._ssl: ssl.SSLContext | bool = False
        self._session: aiohttp.ClientSession | None = None

    def connect(self, connection: Any, token_file: str | None = None) -> None:
        """Use the credentials of a `kopf.ConnectionInfo`; `token_file` is re-read per call (rotating tokens)."""
        self._server = connection.server.rstrip("/")
        self._token = connection.token
        self._token_file = token_file
        self._basic_auth = (
            aiohttp.BasicAuth(connection.username, connection.password or "") if connection.username else None
        )
        self._scheme = connection.scheme or "Bearer"
        self._ssl = self._ssl_context(connection)

    @staticmethod
    def _ssl_context(connection: Any) -> ssl.SSLContext | bool:
        if not connection.server.startswith("https"):
            return False
        if connection.insecure:
            return False
        context = ssl.create_default_context(
            cafile=os.fspath(connection.ca_path) if connection.ca_path else None,
            cadata=(connection.ca_data.decode() if isinstance(connection.ca_data, bytes) else connection.ca_data)
            if connection.ca_data
            else None,
        )
        certificate_path, private_key_path = connection.certificate_path, connection.private_key_path
        if connection.certificate_data or connection.private_key_data:
            directory = tempfile.mkdtemp(prefix="hybridkv-operator-")
            if connection.certificate_data:
                certificate_path = _pem_file(directory, "client.crt", connection.certificate_data)
            if connection.private_key_data:
                private_key_path = _pem_file(directory, "client.key", connection.private_key_data)
        if certificate_path:
            context.load_cert_chain(os.fspath(certificate_path), os.fspath(private_key_path) if private_key_path else None)
        return context

    def _headers(self, content_type: str | None = None) -> dict[str, str]:
        headers = {"Accept": "application/json"}
        if content_type:
            headers["Content-Type"] = content_type
        token = self._token
        if self._token_file:
            # Projected service-account tokens rotate; the file always holds the current one.
            with open(self._token_file, encoding="utf-8") as handle:
                token = handle.read().strip()
        if token:
            headers["Authorization"] = f"{self._scheme} {token}"
        return headers

    async def _request(
        self, method: str, path: str, *, params: Mapping[str, str] | None = None, body: Any = None, content_type: str | None = None
    ) -> dict:
        if self._server is None:
            raise KubeApiError(503, "NotConnected", "the operator has not logged in to the API server yet")
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S))
        data = json.dumps(body) if body is not None else None
        try:
            async with self._session.request(
                method,
                self._server + path,
                params=params,
                data=data,
                headers=self._headers(content_type if data is not None else None),
                auth=self._basic_auth,
                ssl=self._ssl,
            ) as response:
                text = await response.text()
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            raise KubeApiError(0, "Unreachable", f"{method} {path}: {exc!r}") from exc
        if response.status >= 400:
            try:
                status = json.loads(text)
            except ValueError:
                status = {}
            raise KubeApiError(response.status, str(status.get("reason", response.reason)), str(status.get("message", text[:500])))
        return json.loads(text) if text else {}

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def apply(self, manifest: Mapping[str, Any]) -> dict:
        """Server-side apply of `manifest` with the operator's field manager, forcing conflicts on fields it owns."""
        meta = manifest["metadata"]
        path = resource_path(manifest["kind"], meta.get("namespace"), meta["name"])
        # JSON is YAML, so the apply patch is sent as JSON with the apply content type.
        return await self._request(
            "PATCH",
            path,
            params={"fieldManager": FIELD_MANAGER, "force": "true"},
            body=manifest,
            content_type="application/apply-patch+yaml",
        )

    async def get(self, kind: str, namespace: str | None, name: str) -> dict | None:
        """The object, or None when it does not exist."""
        try:
            return await self._request("GET", resource_path(kind, namespace, name))
        except KubeApiError as exc:
            if exc.status == 404:
                return None
            raise

    async def delete(self, kind: str, namespace: str, name: str) -> bool:
        """Delete the object; False when it did not exist."""
        try:
            await self._request("DELETE", resource_path(kind, namespace, name))
        except KubeApiError as exc:
            if exc.status == 404:
                return False
            raise
        return True

    async def list(self, kind: str, namespace: str | None, label_selector: str | None = None) -> list[dict]:
        """Every object of `kind` (in `namespace`, or cluster-wide for None) matching `label_selector`."""
        items: list[dict] = []
        params: dict[str, str] = {"limit": str(LIST_PAGE_LIMIT)}
        if label_selector:
            params["labelSelector"] = label_selector
        while True:
            page = await self._request("GET", resource_path(kind, namespace), params=params)
            items.extend(page.get("items") or [])
            next_token = (page.get("metadata") or {}).get("continue")
            if not next_token:
                return items
            params["continue"] = next_token

    async def patch_status(self, kind: str, namespace: str, name: str, status: Mapping[str, Any]) -> dict:
        """JSON merge-patch of the status subresource (None deletes a field)."""
        return await self._request(
            "PATCH",
            resource_path(kind, namespace, name, "status"),
            body={"status": status},
            content_type="application/merge-patch+json",
        )

    async def create(self, manifest: Mapping[str, Any]) -> dict:
        """POST a new object (names from `metadata.generateName` are the server's to choose)."""
        return await self._request(
            "POST", resource_path(manifest["kind"], manifest["metadata"].get("namespace")), body=manifest, content_type="application/json"
        )
