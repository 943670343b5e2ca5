"""The Planned condition's reason names the kind of problem: each planner error has its own reason."""

from __future__ import annotations

import asyncio
import json

import pytest

from hybridkv.operator.planning import PlanFailure, plan_hybridmodel
from hybridkv.sizing import catalog_entry


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


class _ConfigMapKube:
    """A KubeApi that knows one ConfigMap holding `config.json`."""

    def __init__(self, text: str):
        self.text = text

    async def get(self, kind, namespace, name):
        return {"data": {"config.json": self.text}} if kind == "ConfigMap" else None


def _configmap_body():
    body = _body()
    body["spec"]["model"] = {"name": "example-org/custom", "source": {"pvc": {"claimName": "models"}},
                             "configMapRef": {"name": "cfg"}}
    return body


@pytest.mark.parametrize(("text", "message"), [
    ("[" * 200_000 + "]" * 200_000, "nests its JSON too deeply"),
    ('{"model_type": "llama"}', "model_type 'llama' is not a hybrid"),
    (json.dumps({**catalog_entry("qwen3.5-4b").config, "hidden_size": "x"}), "'hidden_size' must be an integer"),
])
def test_a_configmap_model_config_that_is_wrong_is_invalid_and_looked_at_again(text, message):
    """Its content is checked as the ConfigMap's: reason InvalidModelConfig, and retried, since editing a
    ConfigMap does not change the HybridModel."""
    with pytest.raises(PlanFailure) as failure:
        asyncio.run(plan_hybridmodel(_configmap_body(), kube=_ConfigMapKube(text), gpu_discovery=False))
    assert (failure.value.reason, failure.value.retry) == ("InvalidModelConfig", True)
    assert message in failure.value.message and "ConfigMap cfg key 'config.json'" in failure.value.message


def test_an_inline_config_nested_past_json_limits_is_an_invalid_spec():
    deep = []
    for _ in range(5000):
        deep = [deep]
    body = _body()
    body["spec"]["model"] = {"name": "example-org/custom", "source": {"pvc": {"claimName": "models"}},
                             "config": {"model_type": "qwen3_5_text", "x": deep}}
    with pytest.raises(PlanFailure) as failure:
        asyncio.run(plan_hybridmodel(body, kube=None, gpu_discovery=False))
    assert failure.value.reason == "InvalidSpec" and "nests too deeply" in failure.value.message


def test_a_hybridmodel_describing_its_chats_gets_its_checkpoint_pool_sized_and_the_sidecars_told():
    serving = {"maxModelLen": 8192, "maxConcurrency": 16, "prefixCaching": {"enabled": True},
               "workload": {"promptTokens": {"mean": 200}, "outputTokens": {"mean": 200},
                            "conversations": {"systemPromptTokens": 1024, "turns": 3}}}
    planned = asyncio.run(plan_hybridmodel(_body(serving=serving), kube=None, gpu_discovery=False))
    status = planned.plan_status
    slots = status["predicted"]["checkpointSlots"]
    assert slots == planned.plan.checkpoint_sizing["slots"] == planned.settings.prefix_checkpoint_slots > 0
    assert any(f"prefix caching: {slots} GDN state checkpoint slots (sized from serving.workload.conversations"
               in reason for reason in status["reasons"])
