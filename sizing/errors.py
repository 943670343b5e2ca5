"""Errors of hybridkv.sizing: each one is a `UserError` whose message says what is wrong and what to do."""

from hybridkv.errors import UserError


class GeometryError(UserError):
    """A model config (or catalog name) that does not describe a hybrid model hybridkv can size."""


class UnknownModelError(GeometryError):
    """A model name that is neither in the catalog nor described by a config."""


class TensorParallelError(UserError):
    """A tensor-parallel size the model's heads or channels cannot be split by."""


class CapacityError(UserError):
    """A memory budget that cannot hold the requested pools."""


class SpecError(UserError):
    """A HybridModel resource that is malformed or out of bounds; the message names the field."""


class PlanError(UserError):
    """A target that no allowed GPU count and utilization can meet; the message says why."""


class WorkloadError(UserError):
    """A workload trace or generator setting that cannot be replayed."""


class GpuError(UserError):
    """An unknown GPU product or an impossible GPU memory size."""
