"""The sidecar model against Hugging Face transformers' Qwen3_5ForCausalLM on the same random checkpoint.

On CPU both sides run in float32 on a tiny checkpoint. Tolerance: logits agree to `LOGITS_ATOL` = 1e-3 absolute, where the checkpoint's logits
have a standard deviation of about 8 (so ~1e-4 relative); the residual difference is the order of float32 sums
(chunked vs recurrent gated delta rule, paged vs dense attention). Greedy tokens must be identical. The GPU tests
(`-m gpu`) run the Triton kernels in bf16 on the full Qwen3.5-4B geometry.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass

import pytest
import torch
import torch.multiprocessing as mp
from sidecar_model_harness import TF32_SPREADS, HfReference, PagedHarness, load_model, tf32_spread

from hybridkv.sidecar.random_checkpoint import make_model
from hybridkv.sidecar.model.qwen3_5 import Qwen3_5ForCausalLM
from hybridkv.sizing import catalog_geometry, geometry_from_config
from hybridkv.sizing.errors import TensorParallelError

LOGITS_ATOL = 1e-3
# The 4B geometry on the GPU: 32 layers and a 248k vocabulary in float32. fla's chunk kernel (the GDN prefill) runs
# float32 dots in TF32 (some explicitly); where that moves logits further than this, the bound is what
# TF32 matmuls do to transformers itself on the same tokens (see Pair.atol_for).
GPU_LOGITS_ATOL = 1e-2
CHECKPOINT_SEED = 7
# Prompts draw from the first ids of the vocabulary, which every checkpoint here has.
PROMPT_VOCAB = 512


def assert_logits_close(ours: torch.Tensor, reference: torch.Tensor, what: str, atol: float = LOGITS_ATOL) -> None:
    difference = (ours - reference).abs().max().item()
    assert difference <= atol, f"{what}: max |logit difference| {difference:.2e} > {atol}"


@pytest.fixture(scope="module", params=["tied", "untied"])
def checkpoint(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(f"tiny-{request.param}")
    make_model(folder, catalog_geometry("qwen3.5-4b"), CHECKPOINT_SEED, tiny=True, dtype="float32",
               overrides={"tie_word_embeddings": request.param == "tied"})
    return folder


@pytest.fixture(scope="module")
def tied_checkpoint(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-tied")
    make_model(folder, catalog_geometry("qwen3.5-4b"), CHECKPOINT_SEED, tiny=True, dtype="float32")
    return folder


@pytest.fixture(scope="module")
def model(tied_checkpoint):
    return load_model(tied_checkpoint)


@dataclass
class Pair:
    """Our model and transformers' on the same checkpoint, same device, float32."""

    model: Qwen3_5ForCausalLM
    reference: HfReference
    atol: float
    tf32_bound: bool = False

    def atol_for(self, tokens: list[int]) -> float:
        """The logits bound for `tokens` (teacher-forced): `atol`, or on the GPU, if larger, how far transformers'
        own logits move when its matmuls run in TF32 — TF32 is all the engine's kernels add over float32."""
        if not self.tf32_bound:
            return self.atol
        return max(self.atol, TF32_SPREADS * tf32_spread(lambda: self.reference.prompt_logits(tokens))[1])


@pytest.fixture(scope="module", params=["cpu-tiny", pytest.param("cuda-4b", marks=pytest.mark.gpu)])
def pair(request, tmp_path_factory, model, tied_checkpoint):
    """On CPU the tiny checkpoint; on the GPU (Triton kernels) the full Qwen3.5-4B geometry, both in float32 with
    TF32 off, so greedy tokens are comparable (bf16 rounding is amplified by a 32-layer random stack)."""
    if request.param == "cpu-tiny":
        return Pair(model, HfReference(tied_checkpoint), LOGITS_ATOL)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    folder = tmp_path_factory.mktemp("qwen3.5-4b-random")
    make_model(folder, catalog_geometry("qwen3.5-4b"), CHECKPOINT_SEED, dtype="float32")
    return Pair(load_model(folder, device="cuda"), HfReference(folder, device="cuda"), GPU_LOGITS_ATOL, True)


def random_prompt(generator: torch.Generator, length: int) -> list[int]:
    return torch.randint(0, PROMPT_VOCAB, (length,), generator=generator).tolist()


def test_prefill_logits_of_a_mixed_batch_equal_transformers_at_every_position(checkpoint, torch_generator):
    model, reference = load_model(checkpoint), HfReference(checkpoint)
    # Lengths around the block size (4), the GDN chunk (64) and the conv window (4).
    prompts = [random_prompt(torch_generator, length) for length in (1, 3, 17, 70)]
    harness = PagedHarness(model)
    logits = harness.step([(f"seq{i}", prompt) for i, prompt in enumerate(prompts)])
    offset = 0
    for i, prompt in enumerate(prompts):
        assert_logits_close(logits[offset : offset + len(prompt)], reference.prompt_logits(prompt),
                            f"prompt {i} of length {len(prompt)}")
        offset += len(prompt)


def test_prompt_split_into_chunks_gives_the_whole_prompts_logits(pair, torch_generator):
    prompt = random_prompt(torch_generator, 150)
    expected = pair.reference.prompt_logits(prompt)
    harness = PagedHarness(pair.model)
    chunks, start = [], 0
    for size in (2, 37, 64, 47):  # shorter than the conv window, then across GDN chunk and block boundaries
        chunks.append(harness.step([("chunked", prompt[start : start + size])]))
        start += size
    assert_logits_close(torch.cat(chunks), expected, "chunked prefill", pair.atol_for(prompt))


def test_decodes_and_prefill_chunks_in_one_batch_follow_transformers_greedy(pair, torch_generator):
    prompts = {"a": random_prompt(torch_generator, 23), "b": random_prompt(torch_generator, 70),
               "c": random_prompt(torch_generator, 5)}
    num_new_tokens = 10
    expected = {name: pair.reference.greedy(prompt, num_new_tokens) for name, prompt in prompts.items()}
    harness = PagedHarness(pair.model)
    generated: dict[str, list[int]] = {name: [] for name in prompts}
    step_logits: dict[str, list[torch.Tensor]] = {name: [] for name in prompts}

    def run(decodes: list[str], prefills: list[tuple[str, list[int], bool]]) -> None:
        """One step: decodes first, then prefill chunks; a chunk flagged last yields the first generated token."""
        batch = [(name, [generated[name][-1]]) for name in decodes] + [(name, tokens) for name, tokens, _ in prefills]
        logits = harness.step(batch)
        ends = torch.tensor([len(tokens) for _, tokens in batch]).cumsum(0) - 1
        for name, row in zip(decodes, ends[: len(decodes)].tolist()):
            step_logits[name].append(logits[row])
        for (name, _, last), row in zip(prefills, ends[len(decodes) :].tolist()):
            if last:
                step_logits[name].append(logits[row])
        for name in decodes + [name for name, _, last in prefills if last]:
            generated[name].append(int(step_logits[name][-1].argmax()))

    run([], [("a", prompts["a"], True)])
    run(["a"], [("b", prompts["b"][:40], False)])
    run(["a"], [("b", prompts["b"][40:], True)])
    run(["a", "b"], [("c", prompts["c"], True)])
    while any(len(tokens) < num_new_tokens for tokens in generated.values()):
        run([name for name in prompts if len(generated[name]) < num_new_tokens], [])

    for name, (expected_tokens, expected_logits) in expected.items():
        atol = pair.atol_for(prompts[name] + expected_tokens[:-1])
        tokens = generated[name]
        diverged = next((i for i, (a, b) in enumerate(zip(tokens, expected_tokens)) if a != b), len(tokens))
        if diverged < len(tokens):
            # Excused only at a near tie: transformers' two best logits closer than both sides' bounds together.
            best = expected_logits[diverged].topk(2)
            assert float(best.values[0] - best.values[1]) < 2 * atol, f"sequence {name} diverged at {diverged}"
            assert tokens[diverged] in best.indices.tolist(), f"sequence {name}"
        # Logits are compared along transformers' tokens, so up to (and at) the first divergence.
        for step, (ours, theirs) in enumerate(zip(step_logits[name][: diverged + 1], expected_logits)):
            assert_logits_close(ours, theirs, f"sequence {name}, generated token {step}", atol)


def test_output_depends_on_the_prompt(model, torch_generator):
    """Different prompts lead to different next tokens, and earlier context changes the continuation."""
    prompts = [random_prompt(torch_generator, 12) for _ in range(16)]
    harness = PagedHarness(model, max_seqs=16)
    logits = harness.step([(f"p{i}", prompt) for i, prompt in enumerate(prompts)])
    last_rows = torch.arange(1, len(prompts) + 1) * 12 - 1
    assert len(set(logits[last_rows].argmax(-1).tolist())) >= 8

    shared_suffix = random_prompt(torch_generator, 6)
    continuations = []
    for prefix_length in (10, 30):
        prompt = random_prompt(torch_generator, prefix_length) + shared_suffix
        harness = PagedHarness(model)
        tokens = [int(harness.step([("s", prompt)])[-1].argmax())]
        for _ in range(5):
            tokens.append(int(harness.step([("s", [tokens[-1]])])[0].argmax()))
        continuations.append(tokens)
    assert continuations[0] != continuations[1]


def test_padding_rows_with_the_null_slot_leave_live_sequences_unchanged(model, torch_generator):
    """A decode row aimed at null slot 0 (CUDA-graph padding) must not disturb the real rows."""
    prompt = random_prompt(torch_generator, 9)
    alone, padded = PagedHarness(model), PagedHarness(model)
    token = int(alone.step([("s", prompt)])[-1].argmax())
    padded.step([("s", prompt)])
    expected = alone.step([("s", [token])])
    padded.add_padding_row("pad")
    both = padded.step([("s", [token]), ("pad", [0])])
    assert torch.isfinite(both).all()
    assert_logits_close(both[0], expected[0], "decode row next to a padding row")


@pytest.mark.parametrize("device", [
    # On a CUDA machine the interpreter is off (conftest), so Triton on CPU tensors has nothing to run them.
    pytest.param("cpu", marks=pytest.mark.skipif(torch.cuda.is_available(), reason="the Triton interpreter is off on "
                                                 "a CUDA machine; the cuda case runs the kernels there")),
    pytest.param("cuda", marks=pytest.mark.gpu),
])
@pytest.mark.parametrize("part", ["mlp", "linear_attention", "full_attention"])
def test_one_token_hands_its_activation_to_the_projections_gemv(tied_checkpoint, monkeypatch, torch_generator, part,
                                                                device):
    """At one bf16 token with the Triton kernels (on the CPU the interpreter; every projection width made to take
    the GEMV), SwiGLU, GDN's gated norm and attention's output gate are read by their projection's GEMV instead of
    launched, and the layer part's output is the reference's (torch) within bf16."""
    pytest.importorskip("triton")
    from hybridkv import kernels
    from hybridkv.kernels import gemv
    from kernel_checks import rel_err

    model = load_model(tied_checkpoint, dtype=torch.bfloat16, device=device)
    layer = next(layer for layer in model.model.layers if layer.layer_type == part or part == "mlp")
    fused = {"mlp": "swiglu_gemv", "linear_attention": "gated_norm_gemv", "full_attention": "sigmoid_gated_gemv"}
    calls = []
    launch = getattr(gemv, fused[part])
    monkeypatch.setattr(gemv, fused[part], lambda *args: calls.append(part) or launch(*args))
    monkeypatch.setattr(kernels, "GEMV_MIN_OUT_FEATURES", 1)

    def draw(*shape):
        return torch.randn(*shape, generator=torch_generator).to(device, torch.bfloat16)

    if part == "mlp":
        hidden = draw(1, model.geometry.hidden_size)
        run = lambda: layer.mlp(hidden)  # noqa: E731
    else:
        mixer = layer.mixer
        widths = mixer.in_proj_qkvzba.output_sizes if part == "linear_attention" else None
        projected = ((draw(1, sum(widths)),) if part == "linear_attention"
                     else (None, None, None, draw(1, mixer.num_heads, 2 * mixer.head_dim)[..., mixer.head_dim:]))
        core = draw(*mixer.core_shape(1))
        run = lambda: mixer.finish(projected, core)  # noqa: E731
    monkeypatch.setenv("HYBRIDKV_KERNELS", "reference")
    want = run()
    monkeypatch.setenv("HYBRIDKV_KERNELS", "triton")
    got = run()
    assert calls == [part]
    assert got.shape == want.shape and rel_err(got, want) < 1e-2


def test_tensor_parallel_size_that_does_not_split_the_heads_is_refused(tied_checkpoint):
    import json

    geometry = geometry_from_config(json.loads((tied_checkpoint / "config.json").read_text()))
    with pytest.raises(TensorParallelError):
        Qwen3_5ForCausalLM(geometry, torch.float32, "meta", tp_rank=0, tp_size=3)


@pytest.mark.parametrize("tp_size", [1, 2, 4])
@pytest.mark.parametrize("catalog_name", ["qwen3.5-4b", "qwen3.5-27b"])
def test_each_rank_holds_exactly_the_weight_bytes_the_planner_predicts(catalog_name, tp_size):
    """The planner sizes the pools from these bytes before deployment, so the model must hold no more and no less."""
    geometry = catalog_geometry(catalog_name)
    for rank in range(tp_size):
        model = Qwen3_5ForCausalLM(geometry, torch.bfloat16, "meta", tp_rank=rank, tp_size=tp_size)
        held_bytes = sum(param.numel() * param.element_size() for param in model.parameters())
        assert held_bytes == geometry.weights_bytes(tp_size)


# ---- tensor parallelism over gloo ----------------------------------------------------------------------------------


def _tp_scenario(model, prompts: list[list[int]]) -> torch.Tensor:
    """Mixed prefill of all prompts in one step, a chunked second step, then three greedy decode steps."""
    harness = PagedHarness(model)
    rows = [harness.step([(f"p{i}", prompt[:-7]) for i, prompt in enumerate(prompts)])]
    rows.append(harness.step([(f"p{i}", prompt[-7:]) for i, prompt in enumerate(prompts)]))
    last = rows[-1].view(len(prompts), 7, -1)[:, -1]
    for _ in range(3):
        tokens = last.argmax(-1).tolist()
        last = harness.step([(f"p{i}", [token]) for i, token in enumerate(tokens)])
        rows.append(last)
    return torch.cat(rows)


def _tp_worker(rank: int, world_size: int, port: int, folder: str, prompts, results) -> None:
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                         world_size=world_size)
    try:
        logits = _tp_scenario(load_model(folder, tp_rank=rank, tp_size=world_size), prompts)
        results[rank] = logits
    finally:
        torch.distributed.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.parametrize("tp_size", [2, 4])
def test_tensor_parallel_ranks_produce_the_single_rank_logits(model, tied_checkpoint, tp_size, torch_generator):
    """tp=2 splits every head group; tp=4 also replicates the 2 KV heads (one per rank) and pads nothing."""
    prompts = [random_prompt(torch_generator, length) for length in (9, 20, 75)]
    expected = _tp_scenario(model, prompts)
    with mp.Manager() as manager:
        results = manager.dict()
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        mp.spawn(_tp_worker, args=(tp_size, _free_port(), str(tied_checkpoint), prompts, results), nprocs=tp_size,
                 join=True)
        per_rank = [results[rank] for rank in range(tp_size)]
    for rank, logits in enumerate(per_rank):
        assert_logits_close(logits, expected, f"tp={tp_size} rank {rank}")
        assert torch.equal(logits.argmax(-1), expected.argmax(-1))


# ---- GPU: bf16 on the Qwen3.5-4B geometry, host syncs, CUDA graphs ------------------------------------------------


@pytest.fixture(scope="module")
def gpu_model(tmp_path_factory):
    folder = tmp_path_factory.mktemp("qwen3.5-4b-random-bf16")
    make_model(folder, catalog_geometry("qwen3.5-4b"), CHECKPOINT_SEED)  # bf16, as served
    return load_model(folder, dtype=torch.bfloat16, device="cuda")


@pytest.mark.gpu
def test_gpu_decode_step_has_no_host_sync_and_replays_in_a_cuda_graph(gpu_model):
    harness = PagedHarness(gpu_model, max_seqs=8, num_blocks=256, block_size=16)
    harness.step([(f"p{i}", list(range(i * 50, i * 50 + 40 + i))) for i in range(4)])
    input_ids, positions, ctx = harness.build([(f"p{i}", [i + 1]) for i in range(4)])
    pools = harness.kv_caches + harness.state_caches
    before = [tensor.clone() for pair in pools for tensor in pair]

    def restore():
        for tensor, saved in zip((tensor for pair in pools for tensor in pair), before):
            tensor.copy_(saved)

    torch.cuda.synchronize()
    with torch.no_grad():
        torch.cuda.set_sync_debug_mode("error")
        try:
            eager = gpu_model.compute_logits(gpu_model(input_ids, positions, ctx))
        finally:
            torch.cuda.set_sync_debug_mode("default")
        restore()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up outside the graph (Triton compiles here)
            gpu_model(input_ids, positions, ctx)
        torch.cuda.current_stream().wait_stream(side)
        restore()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            hidden = gpu_model(input_ids, positions, ctx)
        restore()
        graph.replay()
        assert torch.equal(gpu_model.compute_logits(hidden), eager)
