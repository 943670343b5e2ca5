"""Tensor parallelism on 2 GPUs (NCCL, Triton kernels, CUDA graphs) against one GPU, in float32, on the tiny
checkpoint and the chunked-prefill-and-preemption scenario of `test_sidecar_tp.py`; a killed worker under NCCL; and a
clean shutdown in the middle of overlapped steps.

Each test runs under `GPU_TEST_LIMIT_S` (`tp_checks.time_limit`): a hang in Python fails that test, a hang in C++
(NCCL) dumps every thread's stack; `scripts/two_gpu_run.sh` also runs each test in its own bounded process.

Tolerance: logits agree to `GPU_LOGITS_ATOL` = 2e-2 absolute (logits have a standard deviation of about 8): on
GPUs the float32 Triton kernels multiply in TF32, so the split sums differ more than on CPU. Greedy tokens must
be identical.
"""

from __future__ import annotations

import os
import signal

import pytest
import torch
from engine_fixtures import tiny_checkpoint  # noqa: F401 - pytest fixture
from test_sidecar_tp import run_scenario, start_engine
from tp_checks import assert_clean_shutdown, time_limit

from hybridkv.sidecar.core.sampling import SamplingParams
from hybridkv.sidecar.execution.workers import WorkerFailedError

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs"),
]

GPU_LOGITS_ATOL = 2e-2
GPU = {"device": "cuda", "enforce_eager": False}
# Two engines' start-up (graph capture, Triton compiles on a cold cache) and the scenario fit well inside this.
GPU_TEST_LIMIT_S = 300
# close() aborts the NCCL communicators and stops each worker, which waits on no peer.
CLEAN_SHUTDOWN_BOUND_S = 15.0


@pytest.fixture(autouse=True)
def gpu_test_limit(request):
    with time_limit(GPU_TEST_LIMIT_S, request.node.name):
        yield


def test_two_gpus_produce_the_single_gpu_greedy_tokens_and_logits(tiny_checkpoint):  # noqa: F811
    expected_tokens, expected_logits, expected_preemptions = run_scenario(start_engine(tiny_checkpoint, 1, **GPU))
    engine = start_engine(tiny_checkpoint, 2, **GPU)
    try:
        assert engine.runner.graphs, "decode steps should replay CUDA graphs holding NCCL all-reduces"
        tokens, logits, preemptions = run_scenario(engine)
        report = engine.capacity().to_dict()
    finally:
        engine.close()
    assert expected_preemptions > 0
    assert (tokens, preemptions) == (expected_tokens, expected_preemptions)
    differences = [(ours - reference).abs().max().item()
                   for ours, reference in zip(logits, expected_logits) if reference.numel()]
    print(f"max |logit difference| tp=2 vs tp=1 on GPU: {max(differences):.2e}")
    assert max(differences) <= GPU_LOGITS_ATOL
    assert [rank["token_blocks"] for rank in report["per_rank"]] == [report["token_blocks"]] * 2
    assert all(rank["reserve_bytes"] > 0 for rank in report["per_rank"]), "each GPU measures its own memory"


def test_a_killed_worker_fails_the_step_under_nccl_instead_of_hanging(tiny_checkpoint):  # noqa: F811
    engine = start_engine(tiny_checkpoint, 2, **GPU)
    try:
        engine.add_request("after", [1, 2, 3], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
        os.kill(engine.executor.worker_processes[0].pid, signal.SIGKILL)
        with pytest.raises(WorkerFailedError, match="rank 1"):
            while engine.has_unfinished_requests():
                engine.step()
    finally:
        engine.close()
    assert not torch.distributed.is_initialized()


def test_close_in_the_middle_of_overlapped_steps_returns_promptly_and_leaves_nothing(tiny_checkpoint):  # noqa: F811
    engine = start_engine(tiny_checkpoint, 2, **GPU)
    engine.add_request("running", [1, 2, 3], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    engine.step()
    engine.step()
    assert engine._launched is not None  # a step is on the devices, its ids unread
    took_s = assert_clean_shutdown(engine, CLEAN_SHUTDOWN_BOUND_S)
    print(f"engine.close() with NCCL took {took_s:.2f} s")
