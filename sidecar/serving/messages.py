"""The messages between the server process and the engine process: small frozen types, one per kind.

Both sides dispatch on the type, so a renamed field or a new kind fails at once (`UnknownMessageError`) instead of
unpacking into the wrong names. Everything here pickles with plain data only: an exception object might not unpickle
on the other side, so failures travel as strings.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class MessageKind(enum.Enum):
    ADD = "add"
    ABORT = "abort"
    CAPACITY_QUERY = "capacity_query"
    STOP = "stop"
    READY = "ready"
    STEP = "step"
    STATS = "stats"
    CAPACITY = "capacity"
    REJECTED = "rejected"
    FAILED = "failed"
    STOPPED = "stopped"


class UnknownMessageError(RuntimeError):
    """A message of a type the receiver does not handle: the two processes disagree on the protocol."""


# --- server -> engine process ------------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class AddRequest:
    kind = MessageKind.ADD
    request_id: str
    prompt_token_ids: list[int]
    params: object  # hybridkv.sidecar.core.sampling.SamplingParams, validated by the sender


@dataclass(frozen=True, slots=True)
class AbortRequest:
    kind = MessageKind.ABORT
    request_id: str


@dataclass(frozen=True, slots=True)
class CapacityQuery:
    kind = MessageKind.CAPACITY_QUERY
    query_id: int


@dataclass(frozen=True, slots=True)
class StopEngine:
    """Finish the requests still live (the server aborts them first) and exit."""

    kind = MessageKind.STOP


# --- engine process -> server ------------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class EngineReady:
    kind = MessageKind.READY
    capacity: dict  # CapacityReport.to_dict()
    model_info: dict
    stats: object  # EngineStats
    worker_pids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class StepDone:
    """One engine step: its outputs (possibly none yet, while a prefill runs) and the stats after it."""

    kind = MessageKind.STEP
    outputs: list  # RequestOutput
    stats: object


@dataclass(frozen=True, slots=True)
class StatsChanged:
    """Stats changed between steps (an abort while idle); also how a dead worker is noticed between requests."""

    kind = MessageKind.STATS
    stats: object


@dataclass(frozen=True, slots=True)
class CapacityAnswer:
    kind = MessageKind.CAPACITY
    query_id: int
    capacity: dict


@dataclass(frozen=True, slots=True)
class RequestRejected:
    """An add that only the engine could refuse (an id still held by an aborted request)."""

    kind = MessageKind.REJECTED
    request_id: str
    reason: str


@dataclass(frozen=True, slots=True)
class EngineFailed:
    kind = MessageKind.FAILED
    error_type: str
    reason: str
    user_error: bool  # a configuration the user can fix: the CLI exits 2 with `reason`


@dataclass(frozen=True, slots=True)
class EngineStopped:
    kind = MessageKind.STOPPED
    stats: object


Command = AddRequest | AbortRequest | CapacityQuery | StopEngine
Event = EngineReady | StepDone | StatsChanged | CapacityAnswer | RequestRejected | EngineFailed | EngineStopped
