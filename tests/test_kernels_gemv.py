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
    """Tiles of 1,024 input channels (2,048 for a narrow projection of a longer input); four rows a program up to
    1,024 outputs or inputs, eight past both."""
    pytest.importorskip("triton")
    from hybridkv.kernels import gemv

    four = gemv.GemvLaunch(block_n=4, block_k=1024, num_warps=4, programs_per_sm=4)
    assert gemv.launch_for(257, 2048) == gemv.launch_for(1024, 2048) == gemv.launch_for(8224, 1024) == four
    assert gemv.launch_for(1024, 3584) == gemv.GemvLaunch(block_n=4, block_k=2048, num_warps=4, programs_per_sm=4)
    assert gemv.launch_for(1025, 1025) == gemv.launch_for(12352, 2560) == gemv.GemvLaunch(
        block_n=8, block_k=1024, num_warps=4, programs_per_sm=4)
    x = torch.randn(1, 700, generator=torch_generator).to(torch.bfloat16)
    weight = (torch.randn(40, 700, generator=torch_generator) / 700**0.5).to(torch.bfloat16)
    assert rel_err(gemv.gemv(x, weight), x.double() @ weight.double().T) < 1e-2


def test_only_gemvs_of_small_weights_let_the_next_kernel_start_at_their_start(monkeypatch):
    """Launched dependently with early releases on, a GEMV signals at its start for weights under 32 MiB (the 0.8B's
    projections, which gained) and after its wait from 32 MiB (the 4B's in-projections, which lost)."""
    pytest.importorskip("triton")
    from hybridkv.kernels import gemv

    launched = []

    class Recorder:
        def __getitem__(self, grid):
            return lambda *args, **constexprs: launched.append(constexprs)

    monkeypatch.setattr(gemv, "_gemv_kernel", Recorder())
    monkeypatch.setattr(gemv, "dependent_launch", lambda device: True)
    monkeypatch.setattr(gemv, "early_release", lambda device: True)
    monkeypatch.setattr(gemv, "split_k_for", lambda device, row_blocks, k_tiles, programs_per_sm: 1)
    x = torch.zeros(1, 1024, dtype=torch.bfloat16)
    under = torch.empty(gemv.EARLY_RELEASE_MAX_BYTES // 2048 - 1, 1024, dtype=torch.bfloat16)
    at = torch.empty(gemv.EARLY_RELEASE_MAX_BYTES // 2048, 1024, dtype=torch.bfloat16)
    gemv.gemv(x, under)
    gemv.gemv(x, at)
    monkeypatch.setattr(gemv, "early_release", lambda device: False)
    gemv.gemv(x, under)
    assert [(c["PDL"], c["EARLY"]) for c in launched] == [(True, True), (True, False), (True, False)]


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


def _prologue_case(prologue: str, heads: int, head_dim: int, generator, device="cpu"):
    """(the fused GEMV's arguments but the weight, its input length) for one token in bf16."""

    def draw(*shape):
        return torch.randn(*shape, generator=generator).to(device, torch.bfloat16)

    width = heads * head_dim
    if prologue == "swiglu":
        return (draw(1, 2 * width),), width
    core = draw(1, heads, head_dim)
    # The gate is a strided view, as the merged projections hand it over: every other head_dim of a wider row.
    gate = draw(1, heads, 2 * head_dim)[..., head_dim:]
    if prologue == "gated_norm":
        return (core, gate, (1 + 0.1 * torch.randn(head_dim, generator=generator)).to(device, torch.bfloat16),
                1e-6), width
    return (core, gate), width


def _two_launch_input(prologue: str, args, ops):
    """The input the two launches hand their projection: `ops`' kernel of the prologue (`kernels.elementwise` under
    the interpreter, `kernels` on the GPU or the CPU); the sigmoid gate is torch's, as the model's was."""
    if prologue == "swiglu":
        return ops.silu_and_mul(args[0])
    core, gate = args[:2]
    if prologue == "gated_norm":
        return ops.gated_rms_norm(core, gate, args[2], args[3]).reshape(1, -1)
    return (core * torch.sigmoid(gate)).reshape(1, -1)


def _exact_input(prologue: str, args) -> torch.Tensor:
    """The activated input in float64 from the same bf16 values."""
    if prologue == "swiglu":
        gate, up = args[0].double().chunk(2, dim=-1)
        return gate * torch.sigmoid(gate) * up
    core, gate = args[0].double(), args[1].double()
    if prologue == "gated_norm":
        normed = core / torch.sqrt(core.pow(2).mean(-1, keepdim=True) + args[3]) * args[2].double()
        return (normed * gate * torch.sigmoid(gate)).reshape(1, -1)
    return (core * torch.sigmoid(gate)).reshape(1, -1)


_PROLOGUES = {"swiglu": "swiglu_gemv", "gated_norm": "gated_norm_gemv", "sigmoid_gate": "sigmoid_gated_gemv"}
_FUSED_LINEARS = {"swiglu": "swiglu_linear", "gated_norm": "gated_norm_linear", "sigmoid_gate": "sigmoid_gated_linear"}


@interpreter_only
@pytest.mark.parametrize("prologue", sorted(_PROLOGUES))
@pytest.mark.parametrize("heads,head_dim,out_features,block_k,programs_per_sm", [
    (3, 32, 40, 32, 1),    # one head a tile, one share; outputs not a multiple of the row block
    (5, 16, 24, 32, 16),   # two heads a tile, the last tile half full; split K over several shares
    (4, 32, 8, 64, 8),     # fewer rows than one block
])
def test_a_gemv_reading_its_input_through_a_prologue_equals_the_two_launches_it_replaces(
        torch_generator, prologue, heads, head_dim, out_features, block_k, programs_per_sm):
    """SwiGLU and the gated per-head norm computed on the GEMV's reads give the bits of the plain GEMV of what the
    elementwise kernels write; every prologue, the float64 product of the activated input within bf16."""
    pytest.importorskip("triton")
    from hybridkv.kernels import elementwise, gemv

    args, width = _prologue_case(prologue, heads, head_dim, torch_generator)
    weight = (torch.randn(out_features, width, generator=torch_generator) / width**0.5).to(torch.bfloat16)
    launch = gemv.GemvLaunch(block_n=16, block_k=block_k, num_warps=4, programs_per_sm=programs_per_sm)
    got = getattr(gemv, _PROLOGUES[prologue])(*args, weight, launch)
    assert got.shape == (1, out_features) and got.dtype == torch.bfloat16
    assert rel_err(got, _exact_input(prologue, args) @ weight.double().T) < 1e-2
    if prologue != "sigmoid_gate":  # (no kernel of ours wrote the gated attention output)
        assert torch.equal(got, gemv.gemv(_two_launch_input(prologue, args, elementwise), weight, launch))


@interpreter_only
def test_the_gated_norm_gemv_widens_tiles_that_would_split_a_head(torch_generator):
    """A launch whose K tiles are narrower than a head still norms whole heads: its tiles widen to one head."""
    pytest.importorskip("triton")
    from hybridkv.kernels import gemv

    args, width = _prologue_case("gated_norm", 2, 64, torch_generator)
    weight = (torch.randn(12, width, generator=torch_generator) / width**0.5).to(torch.bfloat16)
    narrow = gemv.GemvLaunch(block_n=4, block_k=32, num_warps=4, programs_per_sm=1)
    assert gemv._whole_heads(narrow, 64).block_k == 64
    got = gemv.gated_norm_gemv(*args, weight, narrow)
    assert rel_err(got, _exact_input("gated_norm", args) @ weight.double().T) < 1e-2


@interpreter_only
def test_prologue_gemvs_refuse_what_they_do_not_multiply():
    pytest.importorskip("triton")
    from hybridkv.kernels import gemv

    bf16 = dict(dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"\[gate \| up\] row"):
        gemv.swiglu_gemv(torch.zeros(1, 7, **bf16), torch.zeros(4, 3, **bf16))
    with pytest.raises(ValueError, match=r"weight must be \[N, 8\]"):
        gemv.swiglu_gemv(torch.zeros(1, 16, **bf16), torch.zeros(4, 16, **bf16))
    with pytest.raises(ValueError, match=r"core and gate \[1, H, D\]"):
        gemv.sigmoid_gated_gemv(torch.zeros(2, 2, 8, **bf16), torch.zeros(2, 2, 8, **bf16), torch.zeros(4, 16, **bf16))
    with pytest.raises(ValueError, match="head dim contiguous"):
        gemv.sigmoid_gated_gemv(torch.zeros(1, 2, 8, **bf16), torch.zeros(1, 8, 2, **bf16).transpose(1, 2),
                                torch.zeros(4, 16, **bf16))
    with pytest.raises(ValueError, match=r"norm weight \[8\]"):
        gemv.gated_norm_gemv(torch.zeros(1, 2, 8, **bf16), torch.zeros(1, 2, 8, **bf16), torch.zeros(16, **bf16),
                             1e-6, torch.zeros(4, 16, **bf16))


@pytest.mark.parametrize("prologue", sorted(_PROLOGUES))
def test_fused_projections_take_the_prologue_gemv_where_linear_takes_the_gemv(monkeypatch, torch_generator,
                                                                              prologue):
    """With the kernels on the reference (the CPU), `kernels.<prologue>_linear` is the activation, then `linear`;
    with Triton on, one 16-bit row goes to the fused GEMV, and two rows to the activation and cuBLAS."""
    pytest.importorskip("triton")
    from hybridkv.kernels import gemv

    fused = []
    monkeypatch.setattr(gemv, _PROLOGUES[prologue], lambda *args: fused.append(args[-1].shape) or "fused")
    linear = getattr(kernels, _FUSED_LINEARS[prologue])
    args, width = _prologue_case(prologue, 2, 128, torch_generator)  # 256 inputs
    weight = (torch.randn(kernels.GEMV_MIN_OUT_FEATURES, width, generator=torch_generator) / width**0.5).to(
        torch.bfloat16)
    monkeypatch.setenv("HYBRIDKV_KERNELS", "reference")
    want = torch.nn.functional.linear(_two_launch_input(prologue, args, kernels), weight)
    assert torch.equal(linear(*args, weight), want) and not fused
    monkeypatch.setenv("HYBRIDKV_KERNELS", "triton")
    assert linear(*args, weight) == "fused" and fused == [weight.shape]
    two_rows = tuple(torch.cat([a, a]) if isinstance(a, torch.Tensor) and a.dim() > 1 else a for a in args)
    assert linear(*two_rows, weight).shape == (2, kernels.GEMV_MIN_OUT_FEATURES) and fused == [weight.shape]


@pytest.mark.gpu
@pytest.mark.parametrize("prologue,heads,head_dim,out_features", [
    ("swiglu", 1, 3584, 1024), ("swiglu", 1, 9216, 2560),              # 0.8B's and 4B's MLP down projections
    ("gated_norm", 16, 128, 1024), ("gated_norm", 32, 128, 2560),      # their GDN output projections
    ("sigmoid_gate", 8, 256, 1024), ("sigmoid_gate", 16, 256, 2560),   # their attention output projections
])
def test_prologue_gemvs_at_the_models_sizes_on_the_gpu(torch_generator, prologue, heads, head_dim, out_features):
    """At real sizes, through the dispatcher the model calls: within bf16 of the float64 product of the activated
    input, and within rounding of the two launches they replace."""
    args, width = _prologue_case(prologue, heads, head_dim, torch_generator, device="cuda")
    weight = (torch.randn(out_features, width, generator=torch_generator) / width**0.5).to("cuda", torch.bfloat16)
    got = getattr(kernels, _FUSED_LINEARS[prologue])(*args, weight)
    assert rel_err(got, _exact_input(prologue, args) @ weight.double().T) < 1e-2
    assert rel_err(got, kernels.linear(_two_launch_input(prologue, args, kernels), weight)) < 1e-3
