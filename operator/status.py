"""HybridModel status as pure functions: conditions from the facts in status, and measured capacity from reports.

Two writers share `status`: the reconcile handler (facts `plan`, `planFailure`, `observedGeneration`, `selector`)
and the capacity timer (facts `replicas`, `readyReplicas`, `capacity`). They write disjoint facts, and each
recomputes the whole `conditions` list from all facts it sees, so a list written from a stale view is corrected
by the next write.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
import dataclasses
from dataclasses import dataclass

PLANNED = "Planned"
DEPLOYED = "Deployed"
READY = "Ready"
CAPACITY_VERIFIED = "CapacityVerified"
CONDITION_TYPES = (READY, PLANNED, DEPLOYED, CAPACITY_VERIFIED)

# A condition message is bounded like metav1.Condition's.
MAX_MESSAGE_CHARS = 32768


@dataclass(frozen=True)
class Condition:
    type: str
    status: str  # "True", "False" or "Unknown"
    reason: str  # CamelCase
    message: str
    # The generation of the spec the condition was computed from (metav1.Condition's observedGeneration).
    observed_generation: int = 0


def _plural(count: int, noun: str) -> str:
    return f"{count} {noun}" if count == 1 else f"{count} {noun}s"


def planned_condition(status: Mapping, generation: int) -> Condition:
    # A plan or a failure of an older generation says nothing about the spec as it is now.
    if status.get("observedGeneration") != generation:
        return Condition(PLANNED, "Unknown", "Planning", "the operator has not planned this generation of the spec yet")
    failure = status.get("planFailure")
    if failure:
        return Condition(PLANNED, "False", failure["reason"], failure["message"])
    if status.get("plan"):
        return Condition(PLANNED, "True", "PlanComputed", plan_summary(status["plan"]))
    return Condition(PLANNED, "Unknown", "Planning", "the operator has not planned this generation of the spec yet")


def deployed_condition(status: Mapping) -> Condition:
    if not status.get("plan"):
        return Condition(DEPLOYED, "False", "NotPlanned", "no plan, so no Deployment or Services were created")
    if status.get("planFailure"):
        return Condition(
            DEPLOYED,
            "True",
            "PreviousPlanKept",
            "the sidecars keep running with the last plan that succeeded; fix the spec to change them",
        )
    return Condition(DEPLOYED, "True", "ChildrenApplied", "the sidecar Deployment and its Services are applied")


def ready_condition(status: Mapping, desired_replicas: int) -> Condition:
    if not status.get("plan"):
        return Condition(READY, "False", "NotDeployed", "nothing is deployed until the spec can be planned")
    if desired_replicas == 0:
        return Condition(READY, "False", "ScaledToZero", "spec.replicas is 0")
    ready = int(status.get("readyReplicas") or 0)
    message = f"{ready}/{desired_replicas} replicas ready"
    if ready >= desired_replicas:
        return Condition(READY, "True", "ReplicasReady", message)
    return Condition(READY, "False", "ReplicasNotReady", message)


def capacity_condition(status: Mapping) -> Condition:
    plan = status.get("plan") or {}
    capacity = status.get("capacity") or {}
    reports = capacity.get("replicas") or []
    unreachable = capacity.get("unreachable") or []
    if not plan or not (reports or unreachable):
        return Condition(
            CAPACITY_VERIFIED, "Unknown", "AwaitingMeasurement", "no ready sidecar has reported its capacity yet"
        )
    target_tokens = int(plan["targetTokens"])
    target_slots = int(plan["maxNumSeqs"])
    short = [
        f"{report['name']} measured {report['tokenCapacity']:,} tokens and {_plural(report['stateSlots'], 'slot')}"
        for report in reports
        if report["tokenCapacity"] < target_tokens or report["stateSlots"] < target_slots
    ]
    target = f"the target is {target_tokens:,} tokens and {_plural(target_slots, 'slot')} per replica"
    if short:
        return Condition(CAPACITY_VERIFIED, "False", "CapacityBelowTarget", f"{'; '.join(short)}; {target}")
    if unreachable:
        return Condition(
            CAPACITY_VERIFIED,
            "False",
            "CapacityUnavailable",
            f"GetCapacity failed for {', '.join(unreachable)}; {target}"
            + (f"; {_plural(len(reports), 'replica')} that reported meet it" if reports else ""),
        )
    return Condition(
        CAPACITY_VERIFIED,
        "True",
        "CapacityMeetsTarget",
        f"{_plural(len(reports), 'replica')} measured at least {target_tokens:,} tokens and "
        f"{_plural(target_slots, 'slot')} each; {capacity['tokenCapacity']:,} tokens and "
        f"{_plural(capacity['stateSlots'], 'slot')} in total",
    )


def plan_summary(plan: Mapping) -> str:
    gpu = plan.get("gpu") or {}
    budget = (
        f"a KV cache budget of {plan['kvCacheMemoryBytes']:,} bytes"
        if plan.get("kvCacheMemoryBytes")
        else f"gpu-memory-utilization {plan['gpuMemoryUtilization']}"
    )
    predicted = plan["predicted"]
    return (
        f"tensor parallel {plan['tensorParallelSize']} on {gpu.get('product') or str(gpu.get('memoryMiB')) + ' MiB'} "
        f"GPUs with {budget}: {predicted['tokenCapacity']:,} tokens and {_plural(predicted['stateSlots'], 'slot')} "
        f"predicted per replica"
    )


def desired_conditions(status: Mapping, generation: int, desired_replicas: int) -> list[Condition]:
    """Planned and Deployed follow the generation the operator last handled; Ready and CapacityVerified the spec now."""
    handled = status.get("observedGeneration")
    handled = generation if handled is None else int(handled)
    return [
        dataclasses.replace(ready_condition(status, desired_replicas), observed_generation=generation),
        dataclasses.replace(planned_condition(status, generation), observed_generation=handled),
        dataclasses.replace(deployed_condition(status), observed_generation=handled),
        dataclasses.replace(capacity_condition(status), observed_generation=generation),
    ]


def merge_conditions(previous: Sequence[Mapping], desired: Sequence[Condition], now: str) -> list[dict]:
    """The full `conditions` list: lastTransitionTime moves only when a condition's status flips."""
    before = {condition.get("type"): condition for condition in previous}
    merged = []
    for condition in desired:
        old = before.get(condition.type)
        flipped = old is None or old.get("status") != condition.status
        merged.append(
            {
                "type": condition.type,
                "status": condition.status,
                "reason": condition.reason,
                "message": condition.message[:MAX_MESSAGE_CHARS],
                "observedGeneration": condition.observed_generation,
                "lastTransitionTime": now if flipped else old.get("lastTransitionTime", now),
            }
        )
    return merged


def conditions_for(body: Mapping, status_changes: Mapping, desired_replicas: int, now: str) -> list[dict]:
    """Conditions of `body` once `status_changes` (a merge patch of status facts) is applied."""
    status = {**(body.get("status") or {}), **status_changes}
    generation = int((body.get("metadata") or {}).get("generation") or 0)
    desired = desired_conditions(status, generation, desired_replicas)
    return merge_conditions((body.get("status") or {}).get("conditions") or [], desired, now)


def measured_capacity(reports: Mapping[str, Mapping], unreachable: Sequence[str], now: str) -> dict:
    """`status.capacity` from the CapacityReport dicts of ready pods (keyed by pod name) and the pods that failed.

    A replica's capacity is what its engine allocated (already the minimum over its ranks); the total is the sum over
    the replicas that reported.
    """
    replicas = [
        {
            "name": pod_name,
            "tokenBlocks": int(report["token_blocks"]),
            "blockSize": int(report["block_size"]),
            "tokenCapacity": int(report["token_capacity"]),
            "stateSlots": int(report["state_slots"]),
            "tokenPoolBytes": int(report["token_pool_bytes"]),
            "statePoolBytes": int(report["state_pool_bytes"]),
            # A sidecar without prefix caching reports no checkpoint pool.
            "checkpointSlots": int(report.get("checkpoint_slots", 0)),
            "checkpointPoolBytes": int(report.get("checkpoint_pool_bytes", 0)),
            "budgetBytes": int(report["budget_bytes"]),
            "weightsBytes": int(report["weights_bytes"]),
            "reserveBytes": int(report["reserve_bytes"]),
            "tensorParallelSize": int(report["tensor_parallel_size"]),
        }
        for pod_name, report in sorted(reports.items())
    ]
    return {
        "replicas": replicas,
        "unreachable": sorted(unreachable),
        "reportedReplicas": len(replicas),
        "tokenCapacity": sum(replica["tokenCapacity"] for replica in replicas),
        "tokenBlocks": sum(replica["tokenBlocks"] for replica in replicas),
        "stateSlots": sum(replica["stateSlots"] for replica in replicas),
        "lastReportTime": now,
    }
