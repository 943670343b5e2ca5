"""Tensor-parallel execution: rank 0 in the engine's process, ranks 1..tp-1 in spawned worker processes.

Every rank builds its own `ModelRunner` shard (each loads only its rows and columns of the checkpoint), measures its
own memory and allocates its shard of both pools with the same number of token blocks and state slots, so the block
and slot ids rank 0's scheduler hands out mean the same thing everywhere. Each step, rank 0 sends the picklable
`StepBatch` down one pipe per worker and all ranks run the model in lockstep; the row-parallel all-reduces and the
logits all-gather keep them together. Rank 0 samples from the gathered logits; the ids it records
(`record_sampled`) are broadcast from the device as the next step starts, and every rank keeps them by state slot
(`ModelRunner.record_sampled`). So the next step's decode rows can carry PENDING_TOKEN on every rank, and rank 0
launches step n+1 before the host has read step n's ids, as a single rank does.

A dead worker is found three ways: the pipe to it breaks, a collective with it fails (gloo sees the closed socket; NCCL
collectives are aborted by a watcher thread, and `check_collectives()` finds that once the host has waited for the
step's ids), or `check_workers()` sees its exit code between steps. Each raises `WorkerFailedError`, after which the
engine serves nothing more.
"""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.connection
import os
import pickle
import signal
import threading
import traceback
from dataclasses import dataclass

import torch

from hybridkv.net import free_loopback_port
from hybridkv.sidecar import configure_logging
from hybridkv.sidecar.core.cache import CacheManager, PoolInvariantError
from hybridkv.sidecar.execution.distributed import (
    abort_tensor_parallel,
    broadcast_from_rank0,
    check_visible_devices,
    init_tensor_parallel,
    leave_tensor_parallel,
    rank_device,
)
from hybridkv.sidecar.core.sampler import Sampler
from hybridkv.sidecar.execution.messages import (
    BindPools,
    ExecuteStep,
    MeasureMemory,
    ReadPools,
    StopWorker,
    WorkerError,
    WorkerReply,
)
from hybridkv.sidecar.execution.parent_watch import exit_with_parent
from hybridkv.sidecar.execution.runner import MemoryMeasurement, ModelRunner, StepBatch

log = logging.getLogger(__name__)

# A collective that waits this long for a peer fails instead of hanging (a worker stuck rather than dead).
COLLECTIVE_TIMEOUT_S = 300.0
# Loading a shard, profiling and capturing graphs on one rank may take this long before the rank counts as lost.
SETUP_TIMEOUT_S = 1800.0
# How long a stopping worker may take to leave before it is terminated.
WORKER_STOP_TIMEOUT_S = 10.0
# How long a worker whose pipe or sentinel closed may take to report its exit code.
WORKER_EXIT_WAIT_S = 1.0


class WorkerFailedError(RuntimeError):
    """A tensor-parallel worker died or failed: the engine's ranks are no longer in step and it cannot serve."""


@dataclass(frozen=True)
class RankPools:
    """What one rank allocated for its shard of the two pools (usable counts; bytes include the null block/slot)."""

    token_blocks: int
    state_slots: int
    kv_heads: int
    token_pool_bytes: int
    state_pool_bytes: int
    null_slot_zero: bool  # GDN kernels never write the null slot 0
    checkpoint_slots: int = 0
    checkpoint_pool_bytes: int = 0

    @property
    def counts(self) -> tuple[int, int, int]:
        return self.token_blocks, self.state_slots, self.checkpoint_slots

    @classmethod
    def of(cls, cache: CacheManager) -> "RankPools":
        return cls(
            token_blocks=cache.blocks.token_blocks,
            state_slots=cache.slots.state_slots,
            kv_heads=cache.kv_caches[0][0].shape[2] if cache.kv_caches else 0,
            token_pool_bytes=cache.token_pool_bytes,
            state_pool_bytes=cache.state_pool_bytes,
            null_slot_zero=all(not conv[0].any() and not ssm[0].any() for conv, ssm in cache.state_caches),
            checkpoint_slots=cache.checkpoints.checkpoint_slots,
            checkpoint_pool_bytes=cache.checkpoint_pool_bytes,
        )


class RankWorker:
    """A worker rank: its model shard and its own tensors for both pools (rank 0's scheduler owns the bookkeeping)."""

    def __init__(self, config, geometry, device: torch.device, dtype: torch.dtype, tp_rank: int):
        self.config = config
        self.device = device
        self.runner = ModelRunner(config, geometry, device, dtype, tp_rank=tp_rank)
        self.cache: CacheManager | None = None
        self._shapes = None

    def measure_memory(self, shapes, max_model_len: int) -> MemoryMeasurement:
        self._shapes = shapes
        return self.runner.measure_memory(shapes, max_model_len, Sampler(self.device, self.config.seed))

    def bind(self, token_blocks: int, state_slots: int, checkpoint_slots: int, max_model_len: int) -> RankPools:
        self.cache = CacheManager(token_blocks, state_slots, self.config.block_size, self._shapes, self.device,
                                  checkpoint_slots)
        self.runner.bind(self.cache, max_model_len)
        return RankPools.of(self.cache)

    def pools(self) -> RankPools:
        return RankPools.of(self.cache)

    def execute(self, batch: StepBatch, sampled_rows: int) -> None:
        """Take the ids rank 0 sampled from the previous step (its broadcast, when it recorded `sampled_rows` > 0),
        keep them by that step's slots for this step's pending decode rows, then run the step."""
        if sampled_rows:
            tokens = torch.empty(sampled_rows, dtype=torch.long, device=self.device)
            broadcast_from_rank0(tokens)
            self.runner.record_sampled(tokens)
        self.runner.execute(batch)


def _worker_main(tp_rank: int, tp_size: int, port: int, config, geometry, device: torch.device, dtype: torch.dtype,
                 num_threads: int, conn: multiprocessing.connection.Connection, parent_pid: int,
                 log_level: int) -> None:
    """Entry point of a spawned worker: join the group, load the shard, then run what rank 0 sends until told to stop
    or until rank 0's end of the pipe closes. It logs at rank 0's level."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the engine's process decides when to stop
    exit_with_parent(parent_pid)  # also while loading its shard, when it reads no pipe
    configure_logging(log_level)
    torch.set_num_threads(num_threads)
    device = rank_device(device, tp_rank)
    exit_code = 0
    try:
        init_tensor_parallel(tp_rank, tp_size, port, device, COLLECTIVE_TIMEOUT_S, SETUP_TIMEOUT_S)
        torch.manual_seed(config.seed)
        worker = RankWorker(config, geometry, device, dtype, tp_rank)
        conn.send(WorkerReply(worker.runner.weights_bytes))
        while True:
            try:
                call = conn.recv()
            except EOFError:  # the engine's process is gone
                break
            match call:
                case ExecuteStep(batch=batch, sampled_rows=sampled_rows):
                    worker.execute(batch, sampled_rows)
                case MeasureMemory(shapes=shapes, max_model_len=max_model_len):
                    conn.send(WorkerReply(worker.measure_memory(shapes, max_model_len)))
                case BindPools(token_blocks=token_blocks, state_slots=state_slots, checkpoint_slots=checkpoint_slots,
                               max_model_len=max_model_len):
                    conn.send(WorkerReply(worker.bind(token_blocks, state_slots, checkpoint_slots, max_model_len)))
                case ReadPools():
                    conn.send(WorkerReply(worker.pools()))
                case StopWorker():
                    break
                case _:
                    raise TypeError(f"unknown call {type(call).__name__} from rank 0")
    except BaseException as exc:  # noqa: BLE001 - report any failure to rank 0 before leaving
        traceback.print_exc()
        exit_code = 1
        try:
            conn.send(WorkerError(f"{type(exc).__name__}: {exc}"))
        except OSError:
            pass
    finally:
        leave_tensor_parallel()
        conn.close()
    os._exit(exit_code)


@dataclass
class _Worker:
    tp_rank: int
    process: multiprocessing.process.BaseProcess
    conn: multiprocessing.connection.Connection


class TensorParallelExecutor:
    """Rank 0 of a tensor-parallel engine: the engine calls it exactly as it calls a single-rank `ModelRunner`."""

    def __init__(self, config, geometry, device: torch.device, dtype: torch.dtype):
        self._stopped = threading.Event()
        self._workers: list[_Worker] = []
        tp_size = config.tensor_parallel_size
        check_visible_devices(device, tp_size)
        self.tp_size = tp_size
        self.block_size = config.block_size
        self.rank_memory: list[MemoryMeasurement] = []
        self.rank_pools: list[RankPools] = []
        self._failure: str | None = None
        self._collectives_aborted = threading.Event()
        # Ids recorded from the last step, broadcast to the workers when the next step starts.
        self._recorded: torch.Tensor | None = None
        port = free_loopback_port()
        context = multiprocessing.get_context("spawn")
        num_threads = max(1, torch.get_num_threads() // tp_size)
        try:
            for tp_rank in range(1, tp_size):
                parent_conn, child_conn = context.Pipe()
                process = context.Process(
                    target=_worker_main, name=f"hybridkv-tp-rank{tp_rank}", daemon=True,
                    args=(tp_rank, tp_size, port, config, geometry, device, dtype, num_threads, child_conn, os.getpid(),
                          logging.getLogger().getEffectiveLevel()),
                )
                process.start()
                child_conn.close()  # so a dead worker reads as a closed pipe here
                self._workers.append(_Worker(tp_rank, process, parent_conn))
            self._join_group(port, rank_device(device, 0))
            self.runner = ModelRunner(config, geometry, device, dtype, tp_rank=0)
            self._gather()
        except BaseException:
            self.shutdown()
            raise
        self._watcher = threading.Thread(target=self._watch_workers, name="hybridkv-tp-watcher", daemon=True)
        self._watcher.start()

    @property
    def worker_processes(self) -> list[multiprocessing.process.BaseProcess]:
        """The spawned ranks 1..tp-1, in rank order."""
        return [worker.process for worker in self._workers]

    # --- what the engine calls ---
    @property
    def weights_bytes(self) -> int:
        return self.runner.weights_bytes

    @property
    def graphs(self) -> dict:
        return self.runner.graphs

    @property
    def piecewise(self):
        """Rank 0's piecewise graphs (every rank captures the same buckets)."""
        return self.runner.piecewise

    @property
    def graph_capture_s(self) -> float:
        """Rank 0's CUDA-graph capture time (every rank captures the same graphs at once)."""
        return self.runner.graph_capture_s

    @property
    def graph_memory_bytes(self) -> int:
        """Rank 0's CUDA-graph memory."""
        return self.runner.graph_memory_bytes

    def measure_memory(self, shapes, max_model_len: int, sampler: Sampler) -> MemoryMeasurement:
        """Every rank measures its own memory; the rank with the smallest cache budget sets the pools of all."""
        self._send(MeasureMemory(shapes, max_model_len))
        own = self._on_rank0(self.runner.measure_memory, shapes, max_model_len, sampler)
        self.rank_memory = [own, *self._gather()]
        return min(self.rank_memory, key=lambda measurement: measurement.budget_bytes)

    def bind(self, cache: CacheManager, max_model_len: int) -> None:
        """Every rank allocates the pools rank 0 allocated, with the same block and slot counts."""
        self._send(BindPools(cache.blocks.token_blocks, cache.slots.state_slots, cache.checkpoints.checkpoint_slots,
                             max_model_len))
        self._on_rank0(self.runner.bind, cache, max_model_len)
        self.rank_pools = [RankPools.of(cache), *self._gather()]
        counts = {pools.counts for pools in self.rank_pools}
        if len(counts) != 1:
            raise WorkerFailedError(
                f"ranks allocated different pools (token blocks, state slots, checkpoint slots): {sorted(counts)}")

    def execute(self, batch: StepBatch, between_layers=None) -> torch.Tensor:
        """Run one step on every rank, after handing the workers the ids recorded from the previous one. The engine
        reads a tensor-parallel step after its launch, so `between_layers` is always None here (the runner's
        signature)."""
        recorded, self._recorded = self._recorded, None
        self._send(ExecuteStep(batch, 0 if recorded is None else recorded.shape[0]))
        if recorded is not None and recorded.numel():
            self._on_rank0(broadcast_from_rank0, recorded)
        return self._on_rank0(self.runner.execute, batch)

    def record_sampled(self, tokens: torch.Tensor) -> None:
        """Keep the ids sampled from the last step's logits by state slot on rank 0 now, and on the workers from a
        broadcast as the next step starts: neither waits for the device, and a step whose ids are never recorded
        (warm-up, serial steps) costs the workers nothing."""
        self.runner.record_sampled(tokens)
        self._recorded = tokens.to(torch.long).contiguous()

    def check_collectives(self) -> None:
        """Raise WorkerFailedError if a collective was aborted because a worker died. An aborted NCCL collective ends
        without an error on the stream, so call this once the host has waited for a step's ids: if it passes, every
        collective up to that step completed."""
        if self._collectives_aborted.is_set():
            for worker in self._workers:
                worker.process.join(WORKER_EXIT_WAIT_S)
            dead = [worker for worker in self._workers if worker.process.exitcode is not None]
            self._fail(self._describe(dead) if dead else "a collective was aborted because a worker died")
        self.check_workers()

    def pools(self) -> list[RankPools]:
        """Each rank's pools as they are now, rank 0 first."""
        self._send(ReadPools())
        return [RankPools.of(self.runner.cache), *self._gather()]

    def check_pools(self) -> None:
        """Raise PoolInvariantError unless every rank holds the same blocks and slots as rank 0 and no rank's null
        slot was written."""
        for tp_rank, pools in enumerate(self.pools()):
            if pools.counts != self.rank_pools[0].counts:
                raise PoolInvariantError(
                    f"rank {tp_rank} holds (token blocks, state slots, checkpoint slots) {pools.counts}, "
                    f"rank 0 {self.rank_pools[0].counts}"
                )
            if not pools.null_slot_zero:
                raise PoolInvariantError(f"rank {tp_rank} wrote its null state slot 0")

    def per_rank_capacity(self) -> list[dict]:
        """Measured capacity of every rank in the CapacityReport layout, rank 0 first."""
        return [
            {
                "block_size": self.block_size,
                "token_blocks": pools.token_blocks,
                "token_capacity": pools.token_blocks * self.block_size,
                "state_slots": pools.state_slots,
                "token_pool_bytes": pools.token_pool_bytes,
                "state_pool_bytes": pools.state_pool_bytes,
                "checkpoint_slots": pools.checkpoint_slots,
                "checkpoint_pool_bytes": pools.checkpoint_pool_bytes,
                "budget_bytes": memory.budget_bytes,
                "weights_bytes": memory.weights_bytes,
                "reserve_bytes": memory.reserve_bytes,
            }
            for memory, pools in zip(self.rank_memory, self.rank_pools)
        ]

    def check_workers(self) -> None:
        """Raise WorkerFailedError if a worker has died or an earlier step failed; cheap enough to call often."""
        if self._failure is None:
            dead = [worker for worker in self._workers if worker.process.exitcode is not None]
            if dead:
                self._fail(self._describe(dead))
        if self._failure is not None:
            raise WorkerFailedError(self._failure)

    def shutdown(self) -> None:
        """Stop every worker (terminating those that do not leave in time) and leave the process group."""
        if self._stopped.is_set():
            return
        self._stopped.set()
        for worker in self._workers:
            try:
                worker.conn.send(StopWorker())
            except OSError:
                pass  # already gone
        for worker in self._workers:
            worker.process.join(WORKER_STOP_TIMEOUT_S)
            if worker.process.is_alive():
                worker.process.terminate()
                worker.process.join(WORKER_STOP_TIMEOUT_S)
            worker.conn.close()
        leave_tensor_parallel()

    def __del__(self) -> None:
        self.shutdown()

    # --- plumbing ---
    def _join_group(self, port: int, device: torch.device) -> None:
        """Join the process group as rank 0, failing at once if a worker dies before it joins (the rendezvous
        itself would only give up at its timeout)."""
        if device.type == "cuda":
            torch.cuda.set_device(device)  # the current device is per thread: set it here too
        errors: list[BaseException] = []

        def join() -> None:
            try:
                init_tensor_parallel(0, self.tp_size, port, device, COLLECTIVE_TIMEOUT_S, SETUP_TIMEOUT_S)
            except BaseException as exc:  # noqa: BLE001 - handed to the waiting thread
                errors.append(exc)

        joining = threading.Thread(target=join, name="hybridkv-tp-rendezvous", daemon=True)
        joining.start()
        while joining.is_alive():
            joining.join(0.1)
            dead = [worker for worker in self._workers if worker.process.exitcode is not None]
            if dead:
                self._fail("; ".join(self._describe([worker], self._error_sent_by(worker)) for worker in dead))
                raise WorkerFailedError(self._failure)
        if errors:
            raise errors[0]

    def _error_sent_by(self, worker: _Worker) -> str | None:
        try:
            if worker.conn.poll():
                reply = worker.conn.recv()
                return reply.reason if isinstance(reply, WorkerError) else None
        except (EOFError, OSError):
            pass
        return None

    def _send(self, call) -> None:
        self.check_workers()
        payload = pickle.dumps(call, protocol=pickle.HIGHEST_PROTOCOL)
        for worker in self._workers:
            try:
                worker.conn.send_bytes(payload)
            except OSError:
                worker.process.join(WORKER_EXIT_WAIT_S)
                self._fail(self._describe([worker]))
                raise WorkerFailedError(self._failure) from None

    def _on_rank0(self, function, *args):
        """Run rank 0's share of a collective step; a failure there usually means a peer died, so say which."""
        try:
            return function(*args)
        except RuntimeError as exc:
            for worker in self._workers:
                worker.process.join(WORKER_EXIT_WAIT_S)  # a dead peer is the usual cause: let its exit be seen
            dead = [worker for worker in self._workers if worker.process.exitcode is not None]
            self._fail(self._describe(dead) if dead else f"rank 0 failed in a collective step: {exc}")
            raise WorkerFailedError(self._failure) from exc

    def _gather(self) -> list:
        """Each worker's reply to the last message that asks for one, in rank order."""
        replies = []
        for worker in self._workers:
            ready = multiprocessing.connection.wait([worker.conn, worker.process.sentinel], SETUP_TIMEOUT_S)
            if worker.conn in ready:
                try:
                    reply = worker.conn.recv()
                except EOFError:
                    reply = WorkerError("its pipe closed")
                if isinstance(reply, WorkerReply):
                    replies.append(reply.value)
                    continue
                worker.process.join(WORKER_STOP_TIMEOUT_S)
                self._fail(self._describe([worker], reply.reason))
            elif ready:
                self._fail(self._describe([worker]))
            else:
                self._fail(f"tensor-parallel rank {worker.tp_rank} did not answer within {SETUP_TIMEOUT_S:.0f} s")
            raise WorkerFailedError(self._failure)
        return replies

    def _describe(self, workers: list[_Worker], error: str | None = None) -> str:
        parts = []
        for worker in workers:
            code = worker.process.exitcode
            if code is None:
                state = "failed"
            elif code < 0:
                state = f"was killed by {signal.Signals(-code).name}"
            else:
                state = f"exited with code {code}"
            parts.append(f"tensor-parallel rank {worker.tp_rank} (pid {worker.process.pid}) {state}"
                         + (f": {error}" if error else ""))
        return "; ".join(parts)

    def _fail(self, reason: str) -> None:
        if self._failure is None:
            self._failure = reason
            log.error("%s; the engine stops serving", reason)

    def _watch_workers(self) -> None:
        """Abort pending collectives as soon as a worker dies, so rank 0 never waits for the collective timeout.
        Only the stepping thread reaps workers and words the failure, so the exit code it reports is never lost."""
        sentinels = [worker.process.sentinel for worker in self._workers]
        while not self._stopped.is_set():
            if multiprocessing.connection.wait(sentinels, timeout=1.0):
                if not self._stopped.is_set():
                    self._collectives_aborted.set()
                    abort_tensor_parallel()
                return
