"""The one-token GEMV (`kernels.gemv`) under the Triton interpreter against torch's matmul, and the dispatcher's
choice of it (`kernels.linear`)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from kernel_checks import rel_err  # noqa: E402

from hybridkv import kernels  # noqa: E402

interpreter_only = pytest.mark.skipif(torch.cuda.is_available(), reason="the Triton interpreter is off on a CUDA "
                                      "machine; the GPU test below covers the kernel there")


@interpreter_only
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("out_features,in_features,block_n,block_k,programs_per_sm", [
    (40, 96, 16, 32, 1),    # rows and K not multiples of the tile; one share
    (24, 330, 8, 32, 16),   # more shares than a row block's tiles divide evenly: a last, shorter share
    (5, 64, 16, 16, 8),     # fewer rows than one block
])
def test_gemv_matches_the_float64_product(torch_generator, dtype, out_features, in_features, block_n, block_k,
                                          programs_per_sm):
    pytest.importorskip("triton")
    from hybridkv.kernels import gemv

    x = torch.randn(1, in_features, generator=torch_generator).to(dtype)
    weight = (torch.randn(out_features, in_features, generator=torch_generator) / in_features**0.5).to(dtype)
    launch = gemv.GemvLaunch(block_n=block_n, block_k=block_k, num_warps=4, programs_per_sm=programs_per_sm)
    got = gemv.gemv(x, weight, launch)
    want = (x.double() @ weight.double().T)
    assert got.shape == (1, out_features) and got.dtype == dtype
    assert rel_err(got, want) < 1e-2
    # Split K sums the shares in share order: the same launch gives the same bits every time.
    assert torch.equal(gemv.gemv(x, weight, launch), got)


@interpreter_only
def test_gemv_picks_its_launch_by_width(torch_generator):
    """Four rows a program in tiles of 1,024 input channels up to 1,024 outputs; then eight rows, in tiles of 512 up
    to 4,096 outputs and of 256 past them."""
    pytest.importorskip("triton")
    from hybridkv.kernels import gemv

    assert gemv.launch_for(257) == gemv.launch_for(1024) == gemv.GemvLaunch(block_n=4, block_k=1024, num_warps=4,
                                                                            programs_per_sm=4)
    assert gemv.launch_for(1025) == gemv.launch_for(4096) == gemv.GemvLaunch(block_n=8, block_k=512, num_warps=4,
                                                                             programs_per_sm=4)
    assert gemv.launch_for(4097).block_k == 256
    x = torch.randn(1, 700, generator=torch_generator).to(torch.bfloat16)
    weight = (torch.randn(40, 700, generator=torch_generator) / 700**0.5).to(torch.bfloat16)
    assert rel_err(gemv.gemv(x, weight), x.double() @ weight.double().T) < 1e-2


@interpreter_only
def test_gemv_refuses_what_it_does_not_multiply():
    pytest.importorskip("triton")
    from hybridkv.kernels import gemv

    with pytest.raises(ValueError, match=r"x \[1, K\] and weight \[N, K\]"):
        gemv.gemv(torch.zeros(2, 8, dtype=torch.bfloat16), torch.zeros(4, 8, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="contiguous"):
        gemv.gemv(torch.zeros(1, 8, dtype=torch.bfloat16), torch.zeros(8, 4, dtype=torch.bfloat16).T)


def test_linear_takes_the_gemv_for_one_16_bit_row_only(monkeypatch, torch_generator):
    """On the CPU (reference mode) and for float32, several rows, the vocabulary-wide head or too few outputs,
    `linear` is F.linear; one 16-bit row with Triton on is the GEMV."""
    pytest.importorskip("triton")
    calls = []
    from hybridkv.kernels import gemv

    monkeypatch.setattr(gemv, "gemv", lambda x, weight: calls.append(tuple(weight.shape)) or x @ weight.T)
    weight = torch.randn(kernels.GEMV_MIN_OUT_FEATURES, 32, generator=torch_generator).to(torch.bfloat16)
    one = torch.randn(1, 32, generator=torch_generator).to(torch.bfloat16)
    monkeypatch.setenv("HYBRIDKV_KERNELS", "reference")
    assert torch.equal(kernels.linear(one, weight), torch.nn.functional.linear(one, weight)) and not calls
    monkeypatch.setenv("HYBRIDKV_KERNELS", "triton")
    kernels.linear(one, weight)
    kernels.linear(one.repeat(2, 1), weight)
    kernels.linear(one.float(), weight.float())
    kernels.linear(one, torch.zeros(kernels.GEMV_MAX_OUT_FEATURES + 1, 32, dtype=torch.bfloat16))
    kernels.linear(one, torch.zeros(kernels.GEMV_MIN_OUT_FEATURES - 1, 32, dtype=torch.bfloat16))
    assert calls == [(kernels.GEMV_MIN_OUT_FEATURES, 32)]


@pytest.mark.gpu
@pytest.mark.parametrize("out_features,in_features", [(8224, 1024), (1024, 2048), (7168, 1024), (1024, 3584),
                                                      (257, 2048), (2048, 4096), (24576, 4096)])
def test_gemv_at_the_models_projection_sizes_on_the_gpu(torch_generator, out_features, in_features):
    """Qwen3.5-0.8B's GDN in-projection, output projection, MLP gate|up and down, 35B-A3B's router, its output
    projection and 9B's gate|up, against the float64 product of the same bf16 values."""
    x = torch.randn(1, in_features, generator=torch_generator).to("cuda", torch.bfloat16)
    weight = (torch.randn(out_features, in_features, generator=torch_generator) / in_features**0.5).to(
        "cuda", torch.bfloat16)
    got = kernels.linear(x, weight)
    want = x.double() @ weight.double().T
    assert rel_err(got, want) < 1e-2
