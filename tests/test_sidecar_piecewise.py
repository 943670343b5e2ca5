"""Mixed and prefill steps through the piecewise executor (sidecar/execution/piecewise.py), checked on CPU.

CUDA graphs need a GPU; here each captured piece is a recorder that runs its function again on replay. That runs
exactly what a graph replays, on the same static buffers: the token buckets, the arenas pieces hand on through, the
padding rows and each layer's mix between pieces. The gpu-marked test at the end replays real graphs.
"""

from __future__ import annotations

import pytest
import torch
from engine_fixtures import make_engine, tiny_checkpoint  # noqa: F401 (fixtures)
from hypothesis import given
from hypothesis import strategies as st

from hybridkv.errors import UserError
from hybridkv.sidecar.core.config import EngineConfig
from hybridkv.sidecar.core.sampling import SamplingParams
from hybridkv.sidecar.execution.piecewise import PiecewiseGraphs, token_buckets
from hybridkv.sizing.prediction import piecewise_arena_bytes


class RerunPiece:
    """A captured piece that replays by running its function again."""

    def __init__(self, pool):
        self.fn = None

    def capture(self, fn) -> None:
        self.fn = fn

    def replay(self) -> None:
        self.fn()


@given(st.integers(1, 1 << 15))
def test_every_step_size_up_to_the_limit_has_a_bucket_with_little_padding(max_tokens):
    buckets = token_buckets(max_tokens)
    assert buckets == sorted(set(buckets)) and buckets[-1] == max_tokens and buckets[0] == min(16, max_tokens)
    for smaller, larger in zip(buckets, buckets[1:]):
        # Any step between two buckets pads at most an eighth of its bucket (at most 15 rows below 256).
        assert larger - smaller <= max(16, larger // 8)
        if larger <= 256 and larger != max_tokens:
            assert larger % 16 == 0  # Triton's integer specialization is the same for every one of them


def _generate(engine, prompts, max_tokens=6) -> dict[str, tuple[list[int], list]]:
    """Greedy tokens and their top-3 logprobs per request; request i arrives before step i, so after the first
    step each prompt is prefilled beside the decodes of those before it (mixed steps)."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=3)
    tokens, logprobs, waiting = {}, {}, list(enumerate(prompts))
    while waiting or engine.has_unfinished_requests():
        if waiting:
            index, prompt = waiting.pop(0)
            engine.add_request(f"r{index}", prompt, params)
        for output in engine.step():
            tokens.setdefault(output.request_id, []).extend(output.new_token_ids)
            logprobs.setdefault(output.request_id, []).extend(output.logprobs or [])
    return {request_id: (tokens[request_id], logprobs[request_id]) for request_id in tokens}


def _piecewise_engine(folder, buckets, **settings):
    engine = make_engine(folder, **settings)
    runner = engine.runner
    runner.piecewise = PiecewiseGraphs(runner.model.model, buckets, engine.device, new_piece=RerunPiece)
    runner.piecewise.capture()
    return engine


@pytest.mark.parametrize("settings", [{}, {"max_num_batched_tokens": 24, "max_num_seqs": 4}],
                         ids=["one-step-prefill", "chunked-prefill"])
def test_steps_through_the_pieces_give_the_eager_tokens_and_logprobs(tiny_checkpoint, settings):
    """Prefill, mixed and decode steps of 1-100 tokens: buckets 16/48/64 pad most of them, and the 100-token
    prefill runs eagerly past the largest bucket."""
    generator = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 500, (length,), generator=generator).tolist() for length in (3, 17, 40, 100, 9)]
    eager = _generate(make_engine(tiny_checkpoint, **settings), prompts)
    engine = _piecewise_engine(tiny_checkpoint, [16, 48, 64], **settings)
    runs, execute = [], engine.runner.piecewise.run
    engine.runner.piecewise.run = lambda ids, *rest: runs.append(ids.shape[0]) or execute(ids, *rest)
    # Stale arena rows are padding: NaN there must reach no real row.
    for storage in engine.runner.piecewise.arena_storages():
        storage.fill_(0xFF)
    pieced = _generate(engine, prompts)
    assert runs and max(runs) <= 64 and any(size not in (16, 48, 64) for size in runs)
    assert pieced.keys() == eager.keys()
    for request_id, (tokens, logprobs) in eager.items():
        assert pieced[request_id][0] == tokens and len(logprobs) == len(tokens)
        for ours, theirs in zip(pieced[request_id][1], logprobs):
            assert [token for token, _ in ours.top] == [token for token, _ in theirs.top]
            assert abs(ours.logprob - theirs.logprob) < 1e-4
            assert all(abs(a - b) < 1e-4 for (_, a), (_, b) in zip(ours.top, theirs.top))


def test_a_step_beyond_the_largest_bucket_is_refused_by_the_pieces(tiny_checkpoint):
    engine = _piecewise_engine(tiny_checkpoint, [16])
    ids = torch.zeros(17, dtype=torch.long)
    with pytest.raises(ValueError, match="a step of 17 tokens has no captured bucket"):
        engine.runner.piecewise.run(ids, ids, None)
    assert engine.runner.piecewise.bucket_for(17) is None and engine.runner.piecewise.bucket_for(3) == 16


def test_arenas_are_the_bytes_the_planner_reserves_for_them(tiny_checkpoint):
    """Two arena sets (pieces alternate, so none writes what it reads), each as wide as the widest tensor carried at
    each position by its pieces, and one for the mix outputs, at the largest bucket's rows and nothing per bucket:
    what `sizing.prediction.piecewise_arena_bytes` counts before start-up (checked by hand for Qwen3.5-9B in
    tests/test_sizing_policy.py)."""
    engine = _piecewise_engine(tiny_checkpoint, [16, 32])
    assert engine.runner.piecewise.arena_bytes == piecewise_arena_bytes(engine.geometry, 1, 32)
    assert engine.runner.piecewise.arena_bytes > 0


@pytest.mark.parametrize("value", [-1, 1.5, True, 1 << 21])
def test_an_invalid_piecewise_token_limit_fails_at_start(tiny_checkpoint, value):
    with pytest.raises(UserError, match="piecewise_cuda_graph_max_tokens must be an integer"):
        EngineConfig(model=tiny_checkpoint, piecewise_cuda_graph_max_tokens=value).validate()


@pytest.mark.gpu
def test_gpu_piecewise_graphs_give_the_eager_tokens(tiny_checkpoint):
    """On the GPU the engine captures the buckets at start-up and replays real CUDA graphs for prefill and mixed
    steps: tokens equal to the same engine launching those steps eagerly, logprobs within float32 GEMM rounding
    (cuBLAS may pick another algorithm for a padded row count)."""
    generator = torch.Generator().manual_seed(6)
    prompts = [torch.randint(0, 500, (length,), generator=generator).tolist() for length in (3, 17, 40, 100, 9)]
    settings = dict(device="cuda", enforce_eager=False, min_prefill_tokens_with_decodes=0)
    eager_engine = make_engine(tiny_checkpoint, piecewise_cuda_graph_max_tokens=0, **settings)
    assert eager_engine.runner.piecewise is None
    eager = _generate(eager_engine, prompts)
    engine = make_engine(tiny_checkpoint, **settings)
    assert engine.runner.piecewise.buckets == token_buckets(256)  # make_engine's max_num_batched_tokens
    assert engine.model_info()["piecewise_cuda_graph_max_tokens"] == 256
    runs, execute = [], engine.runner.piecewise.run
    engine.runner.piecewise.run = lambda ids, *rest: runs.append(ids.shape[0]) or execute(ids, *rest)
    pieced = _generate(engine, prompts)
    assert runs and 103 in runs  # three decodes beside the 100-token prompt
    for request_id, (tokens, logprobs) in eager.items():
        assert pieced[request_id][0] == tokens
        for ours, theirs in zip(pieced[request_id][1], logprobs):
            assert abs(ours.logprob - theirs.logprob) < 1e-3


# bfloat16 rounding of one padded GEMM against another: a token may differ only where the eager run's two best
# candidates are this close, and the logprobs of the tokens both runs took agree to it.
BF16_LOGPROB_TOLERANCE = 0.05


@pytest.mark.gpu
@pytest.mark.parametrize("catalog, quantize", [("qwen3.5-35b-a3b", None), ("qwen3-next-80b-a3b", None),
                                               ("qwen3.5-4b", "fp8"), ("qwen3.5-4b", "w4a16")])
def test_gpu_moe_and_quantized_models_replay_piecewise(tmp_path, catalog, quantize):
    """The routed experts' fused kernel and the FP8 / 4-bit GEMMs captured inside the pieces (bf16 checkpoints, the
    dtype they serve in) give the eager engine's greedy tokens."""
    from hybridkv.sidecar.random_checkpoint import make_model
    from hybridkv.sizing import catalog_geometry

    folder = str(make_model(tmp_path / catalog, catalog_geometry(catalog), 7, tiny=True, dtype="bfloat16",
                            quantize=quantize))
    generator = torch.Generator().manual_seed(8)
    prompts = [torch.randint(0, 500, (length,), generator=generator).tolist() for length in (5, 70, 130, 12)]
    settings = dict(device="cuda", dtype="bfloat16", enforce_eager=False, min_prefill_tokens_with_decodes=0,
                    kv_cache_memory_bytes=64 * 2**20)
    eager = _generate(make_engine(folder, piecewise_cuda_graph_max_tokens=0, **settings), prompts)
    engine = make_engine(folder, **settings)
    assert engine.runner.piecewise is not None
    pieced = _generate(engine, prompts)
    for request_id, (tokens, logprobs) in eager.items():
        ours_tokens, ours_logprobs = pieced[request_id]
        for position, (token, ours) in enumerate(zip(tokens, ours_tokens)):
            theirs = logprobs[position]
            if token != ours:  # only at a near tie, and then the two runs go on from different tokens
                (_, best), (_, second) = theirs.top[:2]
                assert best - second < BF16_LOGPROB_TOLERANCE, (request_id, position)
                break
            assert abs(ours_logprobs[position].logprob - theirs.logprob) < BF16_LOGPROB_TOLERANCE
