"""The quantized GEMMs compiled on a GPU at real sizes (Qwen3.5-27B projections) against their references, and a
tiny FP8 checkpoint served on the GPU."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.gpu  # CPU runs deselect these (addopts "-m 'not gpu'")

from hybridkv.kernels import fp8_gemm, quant_reference, w4a16_gemm  # noqa: E402

SHAPES = [(5120, 17408), (17408, 5120), (6144, 5120)]


@pytest.mark.parametrize("tokens", [1, 7, 64, 4100])
@pytest.mark.parametrize("out_features, in_features", SHAPES)
def test_fp8_gemm_at_real_sizes(tokens, out_features, in_features):
    gen = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, in_features, generator=gen).to("cuda", torch.bfloat16)
    weight, scale_inv = (t.cuda() for t in quant_reference.quantize_fp8_block(
        torch.randn(out_features, in_features, generator=gen) / in_features**0.5, (128, 128)))
    expected = quant_reference.fp8_linear(x, weight, scale_inv, (128, 128)).float()
    got = fp8_gemm.fp8_linear(x, weight, scale_inv, (128, 128)).float()
    assert float((got - expected).norm() / expected.norm()) < 1e-2
    if tokens <= 64 and fp8_gemm.uses_tma(weight, (128, 128)):
        # The tiles copied by the tensor memory accelerator and loaded through pointers: the same products.
        pointers = fp8_gemm.fp8_linear(x, weight, scale_inv, (128, 128), {"tma": False}).float()
        assert torch.equal(got, pointers)


@pytest.mark.parametrize("tokens", [fp8_gemm.CUBLAS_MIN_TOKENS + 3, 4100])
def test_fp8_prefill_takes_cublas_on_hopper_and_both_paths_match_the_reference(tokens):
    """On Hopper the prefill-sized product goes to cuBLASLt (rows padded to its tile); the Triton tiles still serve it
    when asked, and both match the reference."""
    gen = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, 5120, generator=gen).to("cuda", torch.bfloat16)
    weight, scale_inv = (t.cuda() for t in quant_reference.quantize_fp8_block(
        torch.randn(6144, 5120, generator=gen) / 5120**0.5, (128, 128)))
    if torch.cuda.get_device_capability() == (9, 0):
        assert fp8_gemm.uses_cublas(tokens, weight, scale_inv, (128, 128))
    expected = quant_reference.fp8_linear(x, weight, scale_inv, (128, 128)).float()
    for config in (None, {}):
        got = fp8_gemm.fp8_linear(x, weight, scale_inv, (128, 128), config)
        assert got.shape == expected.shape and got.is_contiguous()
        assert float((got.float() - expected).norm() / expected.norm()) < 1e-2


@pytest.mark.parametrize("tokens, dtype", [(1, torch.bfloat16), (3, torch.bfloat16), (5, torch.bfloat16),
                                           (16, torch.bfloat16), (40, torch.bfloat16), (4100, torch.bfloat16),
                                           (2, torch.float16), (16, torch.float16)])
@pytest.mark.parametrize("awq_layout", [True, False])
@pytest.mark.parametrize("out_features, in_features", SHAPES)
def test_w4a16_gemm_at_real_sizes(tokens, dtype, awq_layout, out_features, in_features):
    """Every token class (the decode-sized ones split K) in both activation dtypes, whose integer weights the
    tensor-core kernel forms each its own way."""
    gen = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, in_features, generator=gen).to("cuda", dtype)
    stored = {k: t.cuda() for k, t in quant_reference.quantize_w4(
        torch.randn(out_features, in_features, generator=gen), 128, awq_layout, False,
        torch.float16 if awq_layout else torch.bfloat16).items()}
    if awq_layout:
        args = (stored["qweight"], stored["scales"], stored["qzeros"], 128, True)
    else:
        args = (stored["weight_packed"], stored["weight_scale"], stored["weight_zero_point"], 128, False)
    expected = quant_reference.w4a16_linear(x, *args).float()
    got = w4a16_gemm.w4a16_linear(x, *args).float()
    assert float((got - expected).norm() / expected.norm()) < 1e-2


# The packed-along-K CUDA-core kernel multiplies in fp16 pairs after scaling the activations by the row's peak: an
# outlier channel thousands of times the rest must neither overflow nor drown the others. Sizes that are not whole
# groups take the masked loads; K split in three shares and an explicit tile check the other launch shapes.
@pytest.mark.parametrize("outlier", [0.0, 3.0e4])
@pytest.mark.parametrize("out_features, in_features, group, symmetric, config", [
    (5120, 17408, 128, False, None), (17408, 5120, 128, False, {"block_n": 64, "block_k": 256, "split_k": 3}),
    (300, 1000, 32, True, None), (77, 2056, 64, False, {"block_n": 16, "block_k": 128, "split_k": 1}),
    (4096, 12288, 128, False, {"block_n": 32, "block_k": 256, "split_k": 8})])
@pytest.mark.parametrize("tokens", [1, 5])
def test_packed_along_k_gemv_scales_activations(outlier, out_features, in_features, group, symmetric, config, tokens):
    gen = torch.Generator().manual_seed(out_features)
    x = torch.randn(tokens, in_features, generator=gen)
    x[0, in_features // 3] = outlier or x[0, in_features // 3]
    x = x.to("cuda", torch.bfloat16)
    stored = {k: t.cuda() for k, t in quant_reference.quantize_w4(
        torch.randn(out_features, in_features, generator=gen), group, False, symmetric, torch.bfloat16).items()}
    args = (stored["weight_packed"], stored["weight_scale"], stored.get("weight_zero_point"), group, False)
    expected = quant_reference.w4a16_linear(x, *args).float()
    # Five tokens in one program of eight rows: each row scaled by its own peak (the outlier is in row 0 alone).
    got = w4a16_gemm.w4a16_linear(x, *args, config={"block_m": 1 if tokens == 1 else 8, **(config or {})}).float()
    assert torch.isfinite(got).all()
    errors = (got - expected).norm(dim=1) / expected.norm(dim=1)
    assert float(errors.max()) < 1e-2, errors


@pytest.mark.parametrize("awq_layout, tokens", [(False, 1), (False, 3), (True, 1)])
def test_w4a16_launched_dependently_in_a_graph_gives_the_plain_launch_bits(monkeypatch, awq_layout, tokens):
    """The CUDA-core kernels prefetch their first weight tile before waiting for the kernel that writes their input:
    a norm -> product -> norm -> product chain replayed from a CUDA graph (where the launches overlap) gives the same
    bits launched dependently and in plain order, and the same as run eagerly."""
    from hybridkv import kernels
    from hybridkv.kernels import elementwise

    gen = torch.Generator().manual_seed(tokens)
    hidden, inner = 5120, 17408
    stored = [{k: t.cuda() for k, t in quant_reference.quantize_w4(
        torch.randn(*shape, generator=gen), 128, awq_layout, False,
        torch.float16 if awq_layout else torch.bfloat16).items()} for shape in ((inner, hidden), (hidden, inner))]
    dtype = torch.float16 if awq_layout else torch.bfloat16
    x = torch.randn(tokens, hidden, generator=gen).to("cuda", dtype)
    norms = [torch.rand(n, generator=gen).to("cuda", dtype) for n in (hidden, inner)]

    def args(w):
        if awq_layout:
            return w["qweight"], w["scales"], w["qzeros"], 128, True
        return w["weight_packed"], w["weight_scale"], w["weight_zero_point"], 128, False

    def chain():
        y = w4a16_gemm.w4a16_linear(kernels.rms_norm(x, norms[0], 1e-6), *args(stored[0]))
        return w4a16_gemm.w4a16_linear(kernels.rms_norm(y, norms[1], 1e-6), *args(stored[1]))

    results = {}
    for mode in (True, False):
        monkeypatch.setattr(w4a16_gemm, "dependent_launch", lambda device, mode=mode: mode)
        monkeypatch.setattr(elementwise, "dependent_launch", lambda device, mode=mode: mode)
        eager = chain()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            chain()  # compiled and its workspaces allocated outside the capture
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = chain()
        for _ in range(3):
            graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, eager)
        results[mode] = out.clone()
    assert torch.equal(results[True], results[False])


def test_fp8_model_serves_the_same_tokens_with_its_inputs_quantized_by_their_producers(tmp_path, monkeypatch):
    """A tiny FP8 model on the GPU, decode steps replayed from CUDA graphs: the norms and SwiGLU writing the FP8
    projections' input quantized (the default) and each projection quantizing its own input give the same greedy
    tokens (the same e4m3 values either way)."""
    from engine_fixtures import make_engine

    from hybridkv.sidecar.core.sampling import SamplingParams
    from hybridkv.sidecar.model import qwen3_5
    from hybridkv.sidecar.random_checkpoint import make_model
    from hybridkv.sizing import catalog_geometry

    folder = make_model(tmp_path / "fp8", catalog_geometry("qwen3.5-4b"), 7, tiny=True, dtype="bfloat16",
                        quantize="fp8")
    prompts = [[5, 17, 300, 42, 9, 77, 128], list(range(40, 140)), [11] * 30]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    runs = []
    for producers_quantize in (True, False):
        if not producers_quantize:
            monkeypatch.setattr(qwen3_5, "_quantize_before_fp8_projections", lambda model: None)
        engine = make_engine(str(folder), device="cuda", dtype="bfloat16", enforce_eager=False,
                             kv_cache_memory_bytes=64 * 2**20)
        try:
            norms = [layer.input_layernorm.fp8_group for layer in engine.runner.model.model.layers]
            assert norms == [128 if producers_quantize else None] * len(norms)
            runs.append([output.token_ids for output in engine.generate(prompts, params)])
        finally:
            engine.close()
    assert runs[0] == runs[1]
