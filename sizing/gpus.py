"""GPU catalog: memory in MiB as NVIDIA GPU Feature Discovery reports it (`nvidia.com/gpu.memory`), keyed by the
`nvidia.com/gpu.product` label, a short name ("h200") or an alias, with the CUDA compute capability GFD labels
`nvidia.com/gpu.compute.major`/`.minor` carry (it decides which kernels vLLM runs, hence its block alignment). A GPU
the catalog does not know is described by its memory alone (`GpuSpec.from_memory_mib`), its architecture by the
labels when they are there."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, replace
from functools import cache
from importlib import resources

from hybridkv.sizing.errors import GpuError

MIB = 1 << 20
GIB = 1 << 30
# Largest GPU memory accepted from a spec or a node label: bounded input.
MAX_GPU_MEMORY_MIB = 2_097_152
COMPUTE_CAPABILITY_PATTERN = r"^([1-9][0-9]?)\.([0-9])$"
# Highest compute major accepted from a label or a spec: bounded input.
MAX_COMPUTE_MAJOR = 99


def parse_compute_capability(text: str, what: str = "compute capability") -> tuple[int, int]:
    """(9, 0) from "9.0"; GpuError for anything else."""
    match = re.match(COMPUTE_CAPABILITY_PATTERN, str(text).strip())
    if not match:
        raise GpuError(f"{what} must look like 9.0 (major.minor), got {text!r}")
    return int(match.group(1)), int(match.group(2))


@dataclass(frozen=True)
class GpuSpec:
    name: str  # short name ("h200"), or "gpu-<MiB>mib" for a GPU known only by its memory
    product: str  # GFD product string ("NVIDIA-H200"); empty when unknown
    memory_mib: int
    compute_capability: tuple[int, int] | None = None  # (major, minor); None when neither catalog nor labels say
    # The total CUDA reports (torch.cuda.mem_get_info), where measured: what utilization multiplies in the engine and
    # in vLLM. GFD's figure also counts memory the driver keeps (614 MiB more on an H200).
    cuda_total_bytes: int | None = None

    @property
    def compute_capability_text(self) -> str:
        return "unknown" if self.compute_capability is None else "{}.{}".format(*self.compute_capability)

    def with_compute_capability(self, capability: tuple[int, int] | None) -> GpuSpec:
        """This GPU with the capability its node labels (or the spec) state; the catalog's when they state none."""
        return self if capability is None else replace(self, compute_capability=capability)

    @property
    def memory_bytes(self) -> int:
        """The memory a utilization is a share of: CUDA's total where measured, else the GFD memory."""
        return self.cuda_total_bytes or self.memory_mib * MIB

    @property
    def display_name(self) -> str:
        return self.product.removeprefix("NVIDIA-").replace("-", " ") if self.product else f"{self.memory_mib} MiB GPU"

    @classmethod
    def from_memory_mib(cls, memory_mib: int, product: str = "") -> GpuSpec:
        """A GPU known only by its memory (a node label without a catalog product, or `gpu.memoryMiB`)."""
        if isinstance(memory_mib, bool) or not isinstance(memory_mib, int) or not 1 <= memory_mib <= MAX_GPU_MEMORY_MIB:
            raise GpuError(
                f"GPU memory must be an integer number of MiB in [1, {MAX_GPU_MEMORY_MIB}], got {memory_mib!r}"
            )
        known = _by_product().get(product.lower()) if product else None
        if known is not None and known.memory_mib == memory_mib:
            return known
        # A known product with other memory (a MIG slice, a variant) still has the product's architecture.
        capability = known.compute_capability if known is not None else None
        return cls(name=f"gpu-{memory_mib}mib", product=product, memory_mib=memory_mib, compute_capability=capability)


@cache
def _gpus() -> tuple[GpuSpec, ...]:
    raw = json.loads(resources.files("hybridkv.sizing").joinpath("data/gpus.json").read_text())
    return tuple(
        GpuSpec(g["name"], g["product"], g["memory_mib"], parse_compute_capability(g["compute_capability"]),
                g.get("cuda_total_bytes"))
        for g in raw["gpus"]
    )


@cache
def _by_product() -> dict[str, GpuSpec]:
    return {gpu.product.lower(): gpu for gpu in _gpus()}


@cache
def _lookup() -> dict[str, GpuSpec]:
    raw = json.loads(resources.files("hybridkv.sizing").joinpath("data/gpus.json").read_text())
    keys = {}
    for gpu, item in zip(_gpus(), raw["gpus"], strict=True):
        for key in (gpu.name, gpu.product, *item["aliases"]):
            keys[key.lower()] = gpu
    return keys


def gpu_catalog() -> tuple[GpuSpec, ...]:
    return _gpus()


def gpu_spec(name_or_product: str) -> GpuSpec:
    """The catalog GPU for a short name ("h200"), an alias or a GFD product string ("NVIDIA-H200")."""
    gpu = _lookup().get(str(name_or_product).strip().lower())
    if gpu is None:
        known = ", ".join(f"{g.name} ({g.product})" for g in _gpus())
        raise GpuError(f"unknown GPU {name_or_product!r}; known: {known}; or give its memory in MiB instead")
    return gpu
