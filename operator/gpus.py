"""GPU choice from NVIDIA GPU Feature Discovery node labels, for HybridModels whose spec names no GPU.

Nodes are grouped into GPU classes by (`nvidia.com/gpu.product`, `nvidia.com/gpu.memory`, and the compute capability
from `nvidia.com/gpu.compute.major`/`.minor` when a node carries them, which picks vLLM's rule for that architecture in
the plan's vLLM columns); a class offers at most the largest `nvidia.com/gpu.count` of its nodes to one replica
(tensor parallelism stays inside a node).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from hybridkv.sizing.gpus import MAX_GPU_MEMORY_MIB

GPU_PRODUCT_LABEL = "nvidia.com/gpu.product"
GPU_MEMORY_LABEL = "nvidia.com/gpu.memory"
GPU_COUNT_LABEL = "nvidia.com/gpu.count"
GPU_COMPUTE_MAJOR_LABEL = "nvidia.com/gpu.compute.major"
GPU_COMPUTE_MINOR_LABEL = "nvidia.com/gpu.compute.minor"
# Compute capabilities run from 1.0 to 12.x today; larger label values are not GFD's.
MAX_COMPUTE_MAJOR = 99
# More GPUs than this on one node is not a label GFD writes; bounded input.
MAX_GPUS_PER_NODE = 64


@dataclass(frozen=True)
class GpuNodeClass:
    """Nodes with the same GPU: its GFD product string, memory per GPU, and the most GPUs any one of them has."""

    product: str
    memory_mib: int
    max_gpus_per_node: int
    nodes: int
    compute_capability: tuple[int, int] | None = None  # from the nodes' labels; None: the catalog's, if it knows it


def _label_int(labels: Mapping[str, str], key: str, upper: int) -> int | None:
    value = labels.get(key, "")
    if not value.isdigit():
        return None
    number = int(value)
    return number if 1 <= number <= upper else None


def _compute_capability(labels: Mapping[str, str]) -> tuple[int, int] | None:
    major = _label_int(labels, GPU_COMPUTE_MAJOR_LABEL, MAX_COMPUTE_MAJOR)
    minor = labels.get(GPU_COMPUTE_MINOR_LABEL, "")
    if major is None or not minor.isdigit() or int(minor) > MAX_COMPUTE_MAJOR:
        return None
    return major, int(minor)


def _schedulable(node: Mapping) -> bool:
    if (node.get("spec") or {}).get("unschedulable"):
        return False
    conditions = (node.get("status") or {}).get("conditions") or []
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)


def gpu_node_classes(nodes: Iterable[Mapping]) -> list[GpuNodeClass]:
    """GPU classes of the Ready, schedulable nodes that carry all three GFD labels with valid values.

    Ordered by memory, then product, so that the same cluster always gives the same order.
    """
    grouped: dict[tuple[str, int, tuple[int, int] | None], list[int]] = {}
    for node in nodes:
        labels = (node.get("metadata") or {}).get("labels") or {}
        product = labels.get(GPU_PRODUCT_LABEL, "")
        memory_mib = _label_int(labels, GPU_MEMORY_LABEL, MAX_GPU_MEMORY_MIB)
        count = _label_int(labels, GPU_COUNT_LABEL, MAX_GPUS_PER_NODE)
        if not product or memory_mib is None or count is None or not _schedulable(node):
            continue
        grouped.setdefault((product, memory_mib, _compute_capability(labels)), []).append(count)
    return sorted(
        (
            GpuNodeClass(product=product, memory_mib=memory_mib, max_gpus_per_node=max(counts), nodes=len(counts),
                         compute_capability=capability)
            for (product, memory_mib, capability), counts in grouped.items()
        ),
        key=lambda gpu_class: (gpu_class.memory_mib, gpu_class.product, gpu_class.compute_capability or (0, 0)),
    )
