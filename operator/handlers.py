"""kopf handlers of the HybridModel resource. Thin: read, call the pure functions, apply, patch status.

- create/update/resume: plan with hybridkv.sizing, server-side apply the sidecar Deployment and Services, write
  the plan and the conditions. A spec that cannot be planned gets Planned=False and changes nothing it owns.
- a collector every capacity interval (one asyncio task, fed by a watch of the HybridModels): children that were
  scaled, edited or deleted are put back, GetCapacity from every ready sidecar pod into `status.capacity`, replica
  counts from the Deployment, the conditions recomputed; a round that changes nothing writes nothing.
  A kopf timer would add a finalizer to every HybridModel; a watch does not.
Deletion is left to the garbage collector through owner references: no finalizer.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import datetime
import itertools
import logging
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import kopf

from hybridkv.operator import manifests
from hybridkv.operator import status as hm_status
from hybridkv.operator.kube import ImpersonationError, KubeApi, KubeApiError, refuse_impersonation
from hybridkv.operator.planning import PlanFailure, plan_hybridmodel
from hybridkv.sizing.spec import DEFAULT_AUTH_SECRET_KEY

GROUP, VERSION, PLURAL = "hybridkv.io", "v1alpha1", "hybridmodels"
ANNOTATION_PREFIX = "hybridkv.io"
SERVICE_ACCOUNT_TOKEN = "/var/run/secrets/kubernetes.io/serviceaccount/token"
CAPACITY_TIMEOUT_S = 5.0
# HybridModels collected at once in one round.
COLLECT_CONCURRENCY = 8
# kopf's API retries: these first, then every API_RETRY_CEILING_S for as long as the API server stays away.
API_RETRY_BACKOFFS_S = (1.0, 1.0, 2.0, 3.0, 5.0, 8.0, 13.0, 21.0)
API_RETRY_CEILING_S = 30.0
# kopf's log lines whose level says too much: retried failures are warnings (something to watch, not yet to fix), and
# the watch feeding the collector succeeds on every event of every HybridModel (each re-list and status write).
KOPF_LOG_LEVELS = (
    ("failed temporarily:", logging.ERROR, logging.WARNING),
    ("failed; will retry:", logging.ERROR, logging.WARNING),
    ("Handler 'track' succeeded.", logging.INFO, logging.DEBUG),
)


@dataclass(frozen=True)
class OperatorConfig:
    sidecar_image: str
    capacity_interval_s: float = 30.0
    gpu_discovery: bool = True
    # API failures, a missing ConfigMap or missing GPU nodes: the reconcile is retried after this many seconds.
    retry_delay_s: float = 60.0
    scrape_annotations: bool = False
    # Who a HybridModel's NetworkPolicy admits besides the peers in its spec.
    operator_pods: manifests.PodSelector | None = None
    metrics_scrapers: manifests.PodSelector | None = None

    def child_options(self) -> manifests.ChildOptions:
        return manifests.ChildOptions(
            default_image=self.sidecar_image,
            scrape_annotations=self.scrape_annotations,
            operator_pods=self.operator_pods,
            metrics_scrapers=self.metrics_scrapers,
        )


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _desired_replicas(body: Mapping) -> int:
    """spec.replicas (unset: 1); a value the spec's validation refuses wants no replica, and is reported there."""
    replicas = (body.get("spec") or {}).get("replicas")
    if replicas is None:
        return 1
    return replicas if isinstance(replicas, int) and not isinstance(replicas, bool) and replicas >= 0 else 0


def _write_status(patch: kopf.Patch, body: Mapping, facts: Mapping) -> list[dict]:
    conditions = hm_status.conditions_for(body, facts, _desired_replicas(body), _now())
    patch.status.update(facts)
    patch.status["conditions"] = conditions
    return conditions


def _key(body: Mapping) -> tuple[str, str]:
    return body["metadata"]["namespace"], body["metadata"]["name"]


def _condition(conditions: list[Mapping], condition_type: str) -> Mapping:
    return next((c for c in conditions if c.get("type") == condition_type), {})


async def _post_event(kube: KubeApi, body: Mapping, event_type: str, reason: str, message: str, logger) -> None:
    """A Kubernetes event on the HybridModel; a failure to post is logged, never fatal."""
    try:
        await kube.create(manifests.event(body, event_type, reason, message, _now()))
    except KubeApiError as exc:
        logger.warning("event %s not posted: %s", reason, exc)


async def _post_flips(kube: KubeApi, body: Mapping, before: list[Mapping], after: list[dict], types: tuple[str, ...], logger) -> None:
    """One event per condition whose status or reason changed (Unknown is no news), with its reason and message."""
    for condition_type in types:
        old, new = _condition(before, condition_type), _condition(after, condition_type)
        if (old.get("status"), old.get("reason")) == (new["status"], new["reason"]) or new["status"] == "Unknown":
            continue
        event_type = "Normal" if new["status"] == "True" else "Warning"
        await _post_event(kube, body, event_type, new["reason"], new["message"], logger)


async def reconcile(body, meta, spec, patch, memo, logger, **_) -> None:
    config: OperatorConfig = memo.config
    kube: KubeApi = memo.kube
    previous = (body.get("status") or {}).get("conditions") or []
    try:
        planned = await plan_hybridmodel(body, kube, gpu_discovery=config.gpu_discovery)
        if spec.get("networkPolicy") is not None and config.operator_pods is None:
            raise PlanFailure(
                "OperatorIdentityUnknown",
                "spec.networkPolicy needs the operator's own namespace and pod labels so that the policy admits its "
                "GetCapacity calls; start the operator with --operator-namespace and --operator-pod-label (the chart does)",
            )
    except PlanFailure as failure:
        logger.info("no plan: %s", failure.message)
        facts = {"planFailure": {"reason": failure.reason, "message": failure.message}, "observedGeneration": meta["generation"]}
        after = _write_status(patch, body, facts)
        await _post_flips(kube, body, previous, after, (hm_status.PLANNED,), logger)
        if failure.retry:
            raise kopf.TemporaryError(failure.message, delay=config.retry_delay_s) from None
        return
    except KubeApiError as exc:
        raise kopf.TemporaryError(f"reading the cluster failed: {exc}", delay=config.retry_delay_s) from exc

    children = manifests.build_children(body, planned.settings, config.child_options())
    try:
        for child in children:
            await kube.apply(child)
        for kind, field in manifests.OPTIONAL_CHILDREN:
            if spec.get(field) is None and await kube.delete(kind, meta["namespace"], meta["name"]):
                logger.info("deleted %s %s: spec.%s is gone", kind, meta["name"], field)
    except KubeApiError as exc:
        raise kopf.TemporaryError(f"applying the children of {meta['name']} failed: {exc}", delay=config.retry_delay_s) from exc
    logger.info("applied %s", ", ".join(f"{c['kind']} {c['metadata']['name']}" for c in children))
    # What the collector puts back when a child drifts; the children of a failed later spec stay the last good ones.
    memo.children[_key(body)] = children

    facts = {
        "plan": planned.plan_status,
        "planFailure": None,
        "observedGeneration": meta["generation"],
        "selector": manifests.selector_string(meta["name"]),
    }
    after = _write_status(patch, body, facts)
    if (body.get("status") or {}).get("plan") != planned.plan_status:
        await _post_event(kube, body, "Normal", "PlanComputed", _condition(after, hm_status.PLANNED)["message"], logger)
    await _post_flips(kube, body, previous, after, (hm_status.DEPLOYED,), logger)


def _ready_pods(pods: list[Mapping]) -> list[Mapping]:
    def ready(pod: Mapping) -> bool:
        pod_status = pod.get("status") or {}
        return (
            not (pod.get("metadata") or {}).get("deletionTimestamp")
            and bool(pod_status.get("podIP"))
            and any(c.get("type") == "Ready" and c.get("status") == "True" for c in pod_status.get("conditions") or [])
        )

    return [pod for pod in pods if ready(pod)]


def capacity_target(pod: Mapping) -> str:
    """host:port of a pod's sidecar gRPC server: its container port named "grpc"."""
    port = manifests.GRPC_PORT
    for container in (pod.get("spec") or {}).get("containers") or []:
        for container_port in container.get("ports") or []:
            if container_port.get("name") == "grpc":
                port = int(container_port["containerPort"])
    ip = pod["status"]["podIP"]
    return f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"


async def repair_children(body: Mapping, kube: KubeApi, children: list[dict], logger: logging.Logger) -> dict | None:
    """Re-apply every child that is missing or lost a field the operator set (kubectl scale, edit, delete); the live
    Deployment afterwards. A re-apply the API server finds to change nothing (a value it only normalised) is no news."""
    repaired = []
    deployment = None
    for child in children:
        kind, namespace, name = child["kind"], child["metadata"]["namespace"], child["metadata"]["name"]
        live = await kube.get(kind, namespace, name)
        if live is None or manifests.drifted(child, live):
            applied = await kube.apply(child)
            if live is None:
                repaired.append(f"{kind} {name} (deleted)")
            elif applied["metadata"].get("resourceVersion") != live["metadata"].get("resourceVersion"):
                repaired.append(f"{kind} {name}")
            else:
                logger.debug("%s %s differs only in form from what was applied", kind, name)
            live = applied
        if kind == "Deployment":
            deployment = live
    if repaired:
        message = f"put back {', '.join(repaired)}: the operator owns them; change the HybridModel instead"
        logger.warning("%s", message)
        await _post_event(kube, body, "Warning", "ChildrenRepaired", message, logger)
    return deployment


def _status_unchanged(status: Mapping, facts: Mapping, conditions: list[dict]) -> bool:
    """Whether writing `facts` and `conditions` would change nothing but the time of the report."""

    def figures(capacity: Mapping | None) -> dict:
        return {key: value for key, value in (capacity or {}).items() if key != "lastReportTime"}

    return (
        all(status.get(key) == value for key, value in facts.items() if key != "capacity")
        and figures(status.get("capacity")) == figures(facts.get("capacity"))
        and list(status.get("conditions") or []) == conditions
    )


async def auth_token(body: Mapping, kube: KubeApi, logger: logging.Logger) -> str | None:
    """The bearer token of `spec.auth`'s Secret (what the sidecars require), or None without spec.auth. A Secret that
    is missing or holds no such key is logged; the GetCapacity calls then fail as unauthenticated."""
    ref = ((body.get("spec") or {}).get("auth") or {}).get("secretRef")
    if not ref:
        return None
    where = f"Secret {body['metadata']['namespace']}/{ref['name']}"
    secret = await kube.get("Secret", body["metadata"]["namespace"], ref["name"])
    key = ref.get("key", DEFAULT_AUTH_SECRET_KEY)
    encoded = ((secret or {}).get("data") or {}).get(key)
    if encoded is None:
        logger.warning("%s (spec.auth.secretRef) %s", where, "has no key " + repr(key) if secret else "does not exist")
        return None
    try:
        return base64.b64decode(encoded, validate=True).decode().strip()
    except (binascii.Error, UnicodeDecodeError):
        logger.warning("%s key %r is not base64 of UTF-8 text", where, key)
        return None


async def collect_capacity(body: Mapping, kube: KubeApi, children: list[dict], logger: logging.Logger) -> None:
    """One round for one HybridModel: drifted children put back, replica counts, GetCapacity of its ready pods,
    conditions, into status (only when something changed)."""
    # Imported here: grpc and its stubs load only when the collector first runs.
    import grpc

    from hybridkv.api.client import fetch_capacity

    status = body.get("status") or {}
    if not status.get("plan"):
        return
    name, namespace = body["metadata"]["name"], body["metadata"]["namespace"]
    if children:
        deployment = await repair_children(body, kube, children, logger) or {}
    else:  # planned by an earlier operator run whose spec no longer plans: nothing to compare against
        deployment = await kube.get("Deployment", namespace, name) or {}
    pods = _ready_pods(await kube.list("Pod", namespace, manifests.selector_string(name)))
    token = await auth_token(body, kube, logger) if pods else None

    async def report(pod: Mapping) -> tuple[str, dict | None]:
        pod_name = pod["metadata"]["name"]
        try:
            return pod_name, await fetch_capacity(capacity_target(pod), timeout_s=CAPACITY_TIMEOUT_S, token=token)
        except grpc.RpcError as exc:
            logger.warning("GetCapacity of pod %s/%s failed: %s", namespace, pod_name, exc)
            return pod_name, None

    answers = await asyncio.gather(*(report(pod) for pod in pods))
    reports = {pod_name: answer for pod_name, answer in answers if answer is not None}
    unreachable = [pod_name for pod_name, answer in answers if answer is None]
    deployment_status = deployment.get("status") or {}
    facts = {
        "replicas": int(deployment_status.get("replicas") or 0),
        "readyReplicas": int(deployment_status.get("readyReplicas") or 0),
        "capacity": hm_status.measured_capacity(reports, unreachable, _now()),
    }
    conditions = hm_status.conditions_for(body, facts, _desired_replicas(body), _now())
    if _status_unchanged(status, facts, conditions):
        logger.debug("capacity of %s/%s unchanged: %d replicas reported", namespace, name, len(reports))
        return
    try:
        await kube.patch_status("HybridModel", namespace, name, {**facts, "conditions": conditions})
    except KubeApiError as exc:
        if exc.status == 404:  # deleted since the last event
            return
        raise
    await _post_flips(
        kube, body, status.get("conditions") or [], conditions, (hm_status.READY, hm_status.CAPACITY_VERIFIED), logger
    )


async def track(event, body, memo, **_) -> None:
    """Keep the latest body of every HybridModel for the collector (watching needs no finalizer; timers would)."""
    key = (body["metadata"]["namespace"], body["metadata"]["name"])
    if event["type"] == "DELETED":
        memo.models.pop(key, None)
        memo.children.pop(key, None)
    else:
        memo.models[key] = dict(body)


async def collect_forever(memo: kopf.Memo, logger: logging.Logger) -> None:
    """Every capacity interval, one collection round over every known HybridModel, a few at a time."""
    concurrency = asyncio.Semaphore(COLLECT_CONCURRENCY)

    async def one(body: Mapping) -> None:
        async with concurrency:
            where = f"{body['metadata']['namespace']}/{body['metadata']['name']}"
            try:
                await collect_capacity(body, memo.kube, memo.children.get(_key(body), []), logger)
            except KubeApiError as exc:
                logger.warning("capacity of %s not collected: %s", where, exc)
            except Exception:
                # One model's unexpected failure must not end collection for all of them.
                logger.exception("capacity of %s not collected", where)

    while True:
        await asyncio.sleep(memo.config.capacity_interval_s)
        await asyncio.gather(*(one(body) for body in list(memo.models.values())))


async def collector_running(memo, **_) -> bool:
    """Part of the liveness endpoint: a collector that stopped fails the probe, so the kubelet restarts the pod."""
    if memo.collector.done():
        raise kopf.PermanentError("the capacity collector has stopped")
    return True


async def start_collector(memo, logger, **_) -> None:
    memo.collector = asyncio.create_task(collect_forever(memo, logger), name="hybridkv-capacity-collector")


async def login(memo, logger, **kwargs) -> kopf.ConnectionInfo | None:
    """kopf's own logins (service account in a pod, kubeconfig elsewhere), shared with the operator's client."""
    connection = kopf.login_with_service_account(**kwargs)
    if connection is None:
        try:
            refuse_impersonation()
        except ImpersonationError as exc:
            raise kopf.PermanentError(str(exc)) from None
        connection = kopf.login_with_kubeconfig(**kwargs)
    if connection is None:
        return None
    token_file = SERVICE_ACCOUNT_TOKEN if connection.server == "https://kubernetes.default.svc" and os.path.exists(SERVICE_ACCOUNT_TOKEN) else None
    memo.kube.connect(connection, token_file=token_file)
    logger.info("logged in to %s", connection.server)
    return connection


class GenerationDiffBaseStorage(kopf.AnnotationsDiffBaseStorage):
    """The last handled spec together with its generation: a spec reverted to the last handled one after a failed
    update is still a change to handle (the failure in status belongs to the generation in between)."""

    def build(self, *, body, extra_fields=None):
        return super().build(body=body, extra_fields=[*(extra_fields or ()), "metadata.generation"])


class ApiRetryBackoffs:
    """kopf's API request backoffs, without an end: an API server away for minutes is waited for (an exhausted list
    makes kopf escalate, and the operator exits)."""

    def __iter__(self) -> Iterator[float]:
        return itertools.chain(API_RETRY_BACKOFFS_S, itertools.repeat(API_RETRY_CEILING_S))


def _relevel_kopf_logs() -> None:
    """kopf's records of KOPF_LOG_LEVELS get the level that matches what they mean (kopf has no setting for it)."""
    base = logging.getLogRecordFactory()
    if getattr(base, "relevels_kopf_logs", False):
        return

    def factory(*args, **kwargs) -> logging.LogRecord:
        record = base(*args, **kwargs)
        if record.name.startswith("kopf"):
            for marker, level, meant in KOPF_LOG_LEVELS:
                if record.levelno == level and marker in str(record.msg):
                    record.levelno, record.levelname = meant, logging.getLevelName(meant)
                    break
        return record

    factory.relevels_kopf_logs = True  # type: ignore[attr-defined]
    logging.setLogRecordFactory(factory)


def configure(settings: kopf.OperatorSettings, **_) -> None:
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=ANNOTATION_PREFIX)
    settings.persistence.diffbase_storage = GenerationDiffBaseStorage(
        prefix=ANNOTATION_PREFIX, key="last-handled-configuration"
    )
    settings.networking.error_backoffs = ApiRetryBackoffs()
    _relevel_kopf_logs()
    # The operator may not list CRDs (least privilege); the API groups it serves are discovered instead.
    settings.scanning.disabled = True
    # kopf turns log lines into Kubernetes events; the handlers post their own, so only warnings go there too.
    settings.posting.level = logging.WARNING


async def cleanup(memo, **_) -> None:
    memo.collector.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await memo.collector
    await memo.kube.close()


def build_registry(config: OperatorConfig) -> kopf.OperatorRegistry:
    """The handlers, registered for one operator configuration (the capacity interval is fixed per registry)."""
    registry = kopf.OperatorRegistry()
    kopf.on.startup(registry=registry)(configure)
    kopf.on.startup(registry=registry)(start_collector)
    kopf.on.login(registry=registry)(login)
    kopf.on.cleanup(registry=registry)(cleanup)
    kopf.on.probe(registry=registry, id="capacityCollector")(collector_running)
    for on_change in (kopf.on.create, kopf.on.update, kopf.on.resume):
        on_change(GROUP, VERSION, PLURAL, registry=registry, id="reconcile")(reconcile)
    kopf.on.event(GROUP, VERSION, PLURAL, registry=registry, id="track")(track)
    return registry


def operator_memo(config: OperatorConfig) -> kopf.Memo:
    return kopf.Memo(config=config, kube=KubeApi(), models={}, children={})
