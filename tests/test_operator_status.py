"""HybridModel status as pure functions: conditions, their transition times, measured capacity; GPU node classes."""

from __future__ import annotations

import dataclasses

from hybridkv.operator import status
from hybridkv.operator.gpus import gpu_node_classes

PLAN = {
    "gpu": {"product": "NVIDIA-H200", "memoryMiB": 143771},
    "tensorParallelSize": 1,
    "gpuMemoryUtilization": "0.90",
    "maxNumSeqs": 64,
    "maxModelLen": 8192,
    "targetTokens": 100_000,
    "predicted": {"tokenCapacity": 120_000, "stateSlots": 64},
}


def report(token_blocks: int, state_slots: int, block_size: int = 16) -> dict:
    """A CapacityReport dict as hybridkv.api.client.fetch_capacity returns it."""
    return {
        "block_size": block_size,
        "token_blocks": token_blocks,
        "token_capacity": token_blocks * block_size,
        "state_slots": state_slots,
        "token_pool_bytes": (token_blocks + 1) * block_size * 32768,
        "state_pool_bytes": (state_slots + 1) * 51_511_296,
        "budget_bytes": 10 << 30,
        "weights_bytes": 8 << 30,
        "reserve_bytes": 1 << 30,
        "tensor_parallel_size": 1,
    }


def by_type(conditions):
    return {c["type"]: c for c in conditions}


def body(generation=1, **status_fields):
    return {"metadata": {"name": "qwen", "generation": generation}, "spec": {"replicas": 2}, "status": status_fields}


def test_first_visit_sets_every_condition_with_the_generation():
    conditions = status.conditions_for(body(generation=3), {}, 2, "2026-11-29T13:00:00Z")
    assert [c["type"] for c in conditions] == ["Ready", "Planned", "Deployed", "CapacityVerified"]
    assert all(c["observedGeneration"] == 3 and c["lastTransitionTime"] == "2026-11-29T13:00:00Z" for c in conditions)
    assert by_type(conditions)["Planned"]["status"] == "Unknown"
    assert by_type(conditions)["CapacityVerified"]["reason"] == "AwaitingMeasurement"


def test_a_plan_failure_is_planned_false_with_the_planners_reason_and_message():
    failure = {"reason": "InsufficientGPUMemory", "message": "qwen3.5-27b does not fit one L4 at tp <= 1"}
    conditions = by_type(status.conditions_for(body(), {"planFailure": failure, "observedGeneration": 1}, 2, "t0"))
    assert conditions["Planned"]["status"] == "False"
    assert conditions["Planned"]["reason"] == "InsufficientGPUMemory"
    assert conditions["Planned"]["message"] == failure["message"]
    assert conditions["Deployed"]["status"] == "False"
    assert conditions["Ready"]["status"] == "False"


def test_a_failed_replan_keeps_the_running_plan_deployed():
    failure = {"reason": "InvalidSpec", "message": "serving.maxModelLen exceeds the model's limit"}
    conditions = by_type(status.conditions_for(body(generation=2, plan=PLAN, observedGeneration=1), {"planFailure": failure, "observedGeneration": 2}, 2, "t"))
    assert conditions["Planned"]["status"] == "False"
    assert (conditions["Deployed"]["status"], conditions["Deployed"]["reason"]) == ("True", "PreviousPlanKept")


def test_lasttransitiontime_moves_only_when_the_status_flips():
    first = status.conditions_for(body(), {"plan": PLAN, "observedGeneration": 1, "readyReplicas": 1}, 2, "t1")
    second = status.conditions_for({**body(), "status": {"plan": PLAN, "observedGeneration": 1, "conditions": first}}, {"readyReplicas": 1}, 2, "t2")
    assert by_type(second)["Ready"]["lastTransitionTime"] == "t1"  # still False: 1/2
    third = status.conditions_for({**body(), "status": {"plan": PLAN, "observedGeneration": 1, "conditions": second}}, {"readyReplicas": 2}, 2, "t3")
    assert by_type(third)["Ready"]["status"] == "True"
    assert by_type(third)["Ready"]["lastTransitionTime"] == "t3"
    assert by_type(third)["Planned"]["lastTransitionTime"] == "t1"


def test_a_failure_of_an_older_generation_is_not_reported_as_current():
    failure = {"reason": "ModelConfigUnavailable", "message": "ConfigMap missing does not exist in models"}
    conditions = by_type(status.conditions_for(body(generation=3, plan=PLAN, planFailure=failure, observedGeneration=2), {}, 2, "t"))
    assert (conditions["Planned"]["status"], conditions["Planned"]["observedGeneration"]) == ("Unknown", 2)
    assert conditions["Deployed"]["observedGeneration"] == 2 and conditions["Ready"]["observedGeneration"] == 3


def test_planned_is_unknown_until_the_new_generation_is_planned():
    conditions = by_type(status.conditions_for(body(generation=2, plan=PLAN, observedGeneration=1), {}, 2, "t"))
    assert conditions["Planned"]["status"] == "Unknown"
    conditions = by_type(status.conditions_for(body(generation=2, plan=PLAN, observedGeneration=1), {"observedGeneration": 2}, 2, "t"))
    assert conditions["Planned"]["status"] == "True"
    assert "120,000 tokens and 64 slots predicted per replica" in conditions["Planned"]["message"]


def test_measured_capacity_per_replica_and_total():
    capacity = status.measured_capacity({"qwen-b": report(7000, 64), "qwen-a": report(6500, 64)}, ["qwen-c"], "t")
    assert [r["name"] for r in capacity["replicas"]] == ["qwen-a", "qwen-b"]
    assert capacity["replicas"][0]["tokenCapacity"] == 6500 * 16
    assert capacity["tokenCapacity"] == (7000 + 6500) * 16
    assert capacity["stateSlots"] == 128
    assert capacity["reportedReplicas"] == 2 and capacity["unreachable"] == ["qwen-c"]


def test_capacity_below_target_names_the_pod_and_the_numbers():
    capacity = status.measured_capacity({"qwen-a": report(7000, 64), "qwen-b": report(6000, 48)}, [], "t")
    condition = status.capacity_condition({"plan": PLAN, "capacity": capacity})
    assert (condition.status, condition.reason) == ("False", "CapacityBelowTarget")
    assert condition.message == "qwen-b measured 96,000 tokens and 48 slots; the target is 100,000 tokens and 64 slots per replica"


def test_capacity_meeting_the_target_is_verified_and_an_unreachable_pod_is_not():
    capacity = status.measured_capacity({"qwen-a": report(7000, 64)}, [], "t")
    condition = status.capacity_condition({"plan": PLAN, "capacity": capacity})
    assert (condition.status, condition.reason) == ("True", "CapacityMeetsTarget")
    assert "112,000 tokens and 64 slots in total" in condition.message
    capacity = status.measured_capacity({"qwen-a": report(7000, 64)}, ["qwen-b"], "t")
    condition = status.capacity_condition({"plan": PLAN, "capacity": capacity})
    assert (condition.status, condition.reason) == ("False", "CapacityUnavailable")
    assert "qwen-b" in condition.message


def node(name, product=None, memory=None, count=None, ready=True, unschedulable=False, compute=None):
    labels = {"kubernetes.io/hostname": name}
    major, minor = compute.split(".") if compute else (None, None)
    for key, value in (("nvidia.com/gpu.product", product), ("nvidia.com/gpu.memory", memory), ("nvidia.com/gpu.count", count),
                       ("nvidia.com/gpu.compute.major", major), ("nvidia.com/gpu.compute.minor", minor)):
        if value is not None:
            labels[key] = value
    return {
        "metadata": {"name": name, "labels": labels},
        "spec": {"unschedulable": unschedulable},
        "status": {"conditions": [{"type": "Ready", "status": "True" if ready else "False"}]},
    }


def test_gpu_node_classes_group_ready_labelled_nodes():
    nodes = [
        node("h200-a", "NVIDIA-H200", "143771", "8"),
        node("h200-b", "NVIDIA-H200", "143771", "4"),
        node("l4-a", "NVIDIA-L4", "23034", "1"),
        node("cpu"),
        node("h100-down", "NVIDIA-H100-80GB-HBM3", "81559", "8", ready=False),
        node("h100-cordoned", "NVIDIA-H100-80GB-HBM3", "81559", "8", unschedulable=True),
        node("bad-memory", "NVIDIA-B200", "lots", "8"),
        node("zero-gpus", "NVIDIA-B200", "183359", "0"),
    ]
    classes = gpu_node_classes(nodes)
    assert [(c.product, c.memory_mib, c.max_gpus_per_node, c.nodes) for c in classes] == [
        ("NVIDIA-L4", 23034, 1, 1),
        ("NVIDIA-H200", 143771, 8, 2),
    ]


def test_gpu_node_classes_carry_the_compute_capability_gfd_labels_and_the_plan_uses_its_vllm_rule():
    from hybridkv.operator.planning import choose_gpu_class
    from hybridkv.sizing import load_hybridmodel_file

    # A GPU the catalog does not know, labelled as an SM90 part: vLLM's align mode takes its FlashInfer rule there.
    (gpu_class,) = gpu_node_classes([node("new-a", "NVIDIA-X1", "143771", "8", compute="9.0"),
                                     node("new-b", "NVIDIA-X1", "143771", "8", compute="9.0")])
    assert gpu_class.compute_capability == (9, 0) and gpu_class.nodes == 2
    assert gpu_node_classes([node("odd", "NVIDIA-X1", "143771", "8", compute="x.0")])[0].compute_capability is None
    spec = load_hybridmodel_file("examples/qwen3.5-4b-h200.yaml")
    spec = dataclasses.replace(spec, gpu=dataclasses.replace(spec.gpu, product=None, memory_mib=None))
    planned = choose_gpu_class(spec, [gpu_class], None)
    assert planned.gpu.compute_capability == (9, 0)
    assert any("SM90" in reason for reason in planned.reasons)


def test_an_unknown_gpu_product_has_its_own_reason():
    from hybridkv.operator.planning import PlanFailure
    from hybridkv.errors import UserError
    from hybridkv.sizing import load_hybridmodel_file, plan

    spec = load_hybridmodel_file("examples/qwen3.5-4b-h200.yaml")
    spec_with_t4 = dataclasses.replace(spec, gpu=dataclasses.replace(spec.gpu, product="NVIDIA-T4"))
    try:
        plan(spec_with_t4)
    except UserError as exc:
        failure = PlanFailure.from_user_error(exc)
    else:
        raise AssertionError("a product outside the GPU catalog was planned")
    assert failure.reason == "UnknownGPU"
    assert "unknown GPU 'NVIDIA-T4'" in failure.message and "spec.gpu.memoryMiB" in failure.message

