"""Process-group set-up for tensor parallelism: NCCL between GPUs, gloo on CPU, rendezvous on loopback.

All ranks of one engine live on one host, so the rendezvous is a TCP store on 127.0.0.1 at a port rank 0 picks free.
The model's row-parallel layers and vocabulary-parallel embedding and head use the default process group.
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

from hybridkv.errors import UserError
from hybridkv.net import LOOPBACK_HOST


class DeviceCountError(UserError):
    """More tensor-parallel ranks than GPUs visible to the process."""


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def rank_device(device: torch.device, tp_rank: int) -> torch.device:
    """Rank r of an engine on `cuda:i` uses `cuda:i+r`; every rank of a CPU engine uses the CPU."""
    if device.type != "cuda":
        return device
    return torch.device("cuda", (device.index or 0) + tp_rank)


def check_visible_devices(device: torch.device, tp_size: int) -> None:
    """Raise DeviceCountError unless `tp_size` GPUs starting at `device` are visible; CPU ranks always fit."""
    if device.type != "cuda":
        return
    first = device.index or 0
    visible = torch.cuda.device_count()
    if first + tp_size > visible:
        raise DeviceCountError(
            f"--tensor-parallel-size {tp_size} needs {tp_size} GPUs (cuda:{first}..cuda:{first + tp_size - 1}) but "
            f"{visible} are visible; lower --tensor-parallel-size or give the process more GPUs "
            "(nvidia.com/gpu limit, CUDA_VISIBLE_DEVICES)"
        )


def init_tensor_parallel(tp_rank: int, tp_size: int, port: int, device: torch.device, timeout_s: float,
                         rendezvous_timeout_s: float) -> None:
    """Join the engine's process group as `tp_rank`. The ranks may take up to `rendezvous_timeout_s` to meet (a
    worker's start-up on a busy machine); after that a collective that waits longer than `timeout_s` fails."""
    if dist.is_initialized():
        raise RuntimeError("this process already belongs to a process group: one tensor-parallel engine per process")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    store = dist.TCPStore(LOOPBACK_HOST, port, tp_size, is_master=tp_rank == 0,
                          timeout=timedelta(seconds=rendezvous_timeout_s))
    dist.init_process_group(
        backend_for(device), store=store, rank=tp_rank, world_size=tp_size,
        timeout=timedelta(seconds=timeout_s), device_id=device if device.type == "cuda" else None,
    )


def broadcast_from_rank0(tensor: torch.Tensor) -> None:
    """Rank 0's `tensor` into every rank's, in place. Under NCCL the host only queues it: the current stream waits for
    the copy, so a rank reads the values in stream order without the host waiting for the device."""
    dist.broadcast(tensor, src=0)


def abort_tensor_parallel() -> None:
    """Make collectives blocked on a dead peer fail now instead of at the timeout (NCCL; gloo fails by itself)."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        dist.distributed_c10d._abort_process_group()


def leave_tensor_parallel() -> None:
    """Leave the process group without waiting on the other ranks. NCCL communicators are aborted, not destroyed:
    a graceful destroy waits on the peers' ends, which may be gone by then (on two H200s, rank 0's destroy hung for
    good once its worker had left). At shutdown nothing more is exchanged, so the abort loses nothing."""
    abort_tensor_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
