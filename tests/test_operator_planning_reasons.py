"""The Planned condition's reason names the kind of problem: each planner error has its own reason."""

from __future__ import annotations

import asyncio

import pytest

from hybridkv.operator.planning import PlanFailure, plan_hybridmodel


def _body(model="qwen3.5-9b", serving=None, gpu=None, overrides=None):
    spec = {"model": {"name": model, "source": {"pvc": {"claimName": "models"}}},
            "serving": serving or {"maxModelLen": 8192, "maxConcurrency": 16},
            "gpu": gpu or {"product": "NVIDIA-H200"}}
    if overrides:
        spec["overrides"] = overrides
    return {"apiVersion": "hybridkv.io/v1alpha1", "kind": "HybridModel",
            "metadata": {"name": "m", "namespace": "models"}, "spec": spec}


@pytest.mark.parametrize(("body", "reason", "text"), [
    (_body(overrides={"tensorParallelSize": 3}), "InvalidTensorParallelSize", "tp=3 does not divide"),
    (_body(gpu={"product": "NVIDIA-H200", "maxPerReplica": 1}, overrides={"tensorParallelSize": 2}),
     "InvalidTensorParallelSize", "gpu.maxPerReplica allows 1"),
    (_body(model="acme/unknown"), "UnknownModel", "unknown model 'acme/unknown'"),
    (_body(model="qwen3.5-27b", gpu={"product": "NVIDIA-L4", "maxPerReplica": 2}), "NoFeasiblePlan",
     "smallest change: raise gpu.maxPerReplica to 4"),
    (_body(overrides={"gpuMemoryUtilization": "0.01"}), "NoFeasiblePlan", "raise overrides.gpuMemoryUtilization to"),
    (_body(serving={"maxModelLen": 8192, "maxConcurrency": 16, "ssmStateDtype": "bfloat16"}),
     "UnsupportedSSMStateDtype", "spec.serving.ssmStateDtype bfloat16"),
])
def test_each_planner_error_has_its_own_reason(body, reason, text):
    with pytest.raises(PlanFailure) as failure:
        asyncio.run(plan_hybridmodel(body, kube=None, gpu_discovery=False))
    assert failure.value.reason == reason
    assert text in failure.value.message
