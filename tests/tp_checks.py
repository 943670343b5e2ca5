"""Checks shared by the tensor-parallel tests on CPU (gloo) and on GPUs (NCCL): a per-test time limit and a clean
shutdown.

The time limit raises `TimeLimitExceeded` in the test when it is waiting in Python (a pipe, a process join, a poll
loop) and dumps every thread's stack when it is not: a hang inside a collective or a process-group teardown holds the
main thread in C++, where no Python exception can reach it, so a runner that must survive such hangs also bounds each
test's process from outside (`scripts/two_gpu_run.sh` runs every GPU test in its own process under `timeout`).
"""

from __future__ import annotations

import contextlib
import faulthandler
import multiprocessing
import signal
import sys
import threading
import time

import torch


class TimeLimitExceeded(Exception):
    """A test ran past its time limit."""


@contextlib.contextmanager
def time_limit(seconds: int, what: str = "the test"):
    def expire(signum, frame):
        raise TimeLimitExceeded(f"{what} ran past its {seconds} s limit")

    previous = signal.signal(signal.SIGALRM, expire)
    # A little later than the alarm: only when the alarm could not interrupt the main thread.
    faulthandler.dump_traceback_later(seconds + 5, exit=False, file=sys.stderr)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        faulthandler.cancel_dump_traceback_later()
        signal.signal(signal.SIGALRM, previous)


def assert_clean_shutdown(engine, bound_s: float) -> float:
    """Close a tensor-parallel engine and assert that `close()` returned within `bound_s`, every worker left by itself
    (exit code 0, so not terminated), no child process of this one is left and the process group is gone. Returns the
    seconds `close()` took."""
    workers = engine.executor.worker_processes
    children_before = set(multiprocessing.active_children()) - set(workers)
    done = threading.Event()
    started = time.monotonic()
    closing = threading.Thread(target=lambda: (engine.close(), done.set()), name="close-engine", daemon=True)
    closing.start()
    closing.join(bound_s)
    took_s = time.monotonic() - started
    assert done.is_set(), f"engine.close() did not return within {bound_s} s"
    assert [process.exitcode for process in workers] == [0] * len(workers)
    assert set(multiprocessing.active_children()) == children_before
    assert not torch.distributed.is_initialized()
    return took_s
