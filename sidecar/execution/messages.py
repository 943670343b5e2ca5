"""The messages between rank 0 and the tensor-parallel workers: one frozen type per call, and the two replies.

A worker dispatches on the type, so rank 0 and a worker that disagree on a call fail at once with the call's name.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class MeasureMemory:
    shapes: object  # hybridkv.sizing.PoolShapes
    max_model_len: int


@dataclass(frozen=True, slots=True)
class BindPools:
    token_blocks: int
    state_slots: int
    checkpoint_slots: int
    max_model_len: int


@dataclass(frozen=True, slots=True)
class ExecuteStep:
    """Run one step's batch; the only call with no reply (the collectives keep the ranks together). With
    `sampled_rows` > 0 it starts with rank 0's broadcast of the ids it recorded from the previous step, which the
    worker keeps by that step's state slots."""

    batch: object  # StepBatch
    sampled_rows: int


@dataclass(frozen=True, slots=True)
class ReadPools:
    pass


@dataclass(frozen=True, slots=True)
class StopWorker:
    pass


@dataclass(frozen=True, slots=True)
class WorkerReply:
    value: object


@dataclass(frozen=True, slots=True)
class WorkerError:
    reason: str


WorkerCall = MeasureMemory | BindPools | ExecuteStep | ReadPools | StopWorker
