"""bench/kernel_speed.py's mixed-step attention case on CPU under the Triton interpreter (tiny shapes, timings
stubbed): it launches what the engine launches, and both ways of launching compute the same attention."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from kernel_checks import rel_err  # noqa: E402

from hybridkv import kernels  # noqa: E402
from hybridkv.kernels import reference  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
import kernel_speed  # noqa: E402


def stubbed_report(monkeypatch, first_us: float) -> "kernel_speed.Report":
    """A report whose cases run on the CPU, each timed call run once and timed `first_us` + 1, + 2, ... in call
    order, and nothing saved."""
    calls = []

    def time_us(fn, graph=False, rep_ms=200):
        fn()
        calls.append(fn)
        return first_us + len(calls)

    monkeypatch.setattr(kernel_speed, "DEVICE", "cpu")
    monkeypatch.setattr(kernel_speed, "time_us", time_us)
    report = kernel_speed.Report({"copy_tbps": 4.0, "matmul_bf16_tflops": 700.0}, "unused.json")
    monkeypatch.setattr(report, "save", lambda: None)
    return report


def test_the_mixed_attention_case_times_the_engines_two_launches_against_one(monkeypatch):
    report = stubbed_report(monkeypatch, 10.0)
    geometry = kernel_speed.AttentionGeometry(num_q_heads=4, num_kv_heads=2, head_dim=16, block_size=4)
    kernel_speed.attention_mixed_bench(report, geometry, 3, 20, 9, 40, sweep=True)
    row = report.rows[-1]
    assert row["kernel"] == "paged_mixed" and row["baseline"] == "one launch for the step"
    assert [s["segments"] for s in report.sweeps] == [1, 2, 4, 8, 16]
    assert row["time_us"] == 17.0 and row["baseline_us"] == 16.0  # the split timed last, after the one launch

    # The parts the case launches are the engine's, and together they are the step's attention.
    generator = torch.Generator().manual_seed(0)
    inputs = kernel_speed.paged_attention_inputs(geometry, [20, 20, 20, 40], [1, 1, 1, 9], generator)
    parts = kernel_speed.mixed_attention_parts(inputs, 3)
    assert [(p.first, p.end, p.max_seqlen_q, p.max_seqlen_k) for p in parts] == [(0, 3, 1, 20), (3, 12, 9, 40)]
    out = torch.empty_like(inputs["q"])
    for rows in parts:
        kernel_speed.attention.paged_attention(
            inputs["q"][rows.first : rows.end], inputs["k_cache"], inputs["v_cache"], rows.block_tables,
            rows.cu_seqlens_q, rows.seq_lens, inputs["scale"], rows.max_seqlen_q, rows.max_seqlen_k,
            out=out[rows.first : rows.end])
    assert rel_err(out, reference.paged_attention(**inputs)) < 1e-2


def test_a_prefill_moe_layer_is_read_against_the_longer_of_its_products_and_its_expert_bytes(monkeypatch):
    ceiling = {"copy_tbps": 3.0, "matmul_bf16_tflops": 700.0}
    # 35B-A3B at 4,096 tokens: 206 GFLOP (294 µs at 700 TFLOP/s), 1.61 GB of experts (537 µs at 3 TB/s).
    flops, moved = 2 * 4096 * 8 * 3 * 2048 * 512, 256 * 3 * 2048 * 512 * 2
    assert kernel_speed.moe_prefill_bound_us(ceiling, flops, moved) == pytest.approx(moved / 3e6)
    assert kernel_speed.moe_prefill_bound_us({**ceiling, "copy_tbps": 30.0}, flops, moved) == pytest.approx(
        flops / 700e6)
    report = kernel_speed.Report(ceiling, "unused.json")
    monkeypatch.setattr(report, "save", lambda: None)
    report.add("fused_moe", "T=4096", 1000.0, flops=flops, bound_us=500.0)
    assert report.rows[-1]["fraction_of_bound"] == 0.5
    assert report.table().splitlines()[-1].endswith("(50% of its bound)")
    # The prefill tiles' own gain is read beside them: the layer with each expert's run padded to whole tiles.
    report.add("fused_moe", "T=8192", 1250.0, flops=2 * flops, bound_us=600.0, whole_tiles_us=1282.34)
    assert report.table().splitlines()[-1].endswith("(48% of its bound)  (whole tiles 1282.3 µs)")


def random_moe_layer(seed: int, experts: int, hidden: int, width: int, top_k: int, tokens: int):
    """A float32 MoE layer's experts and inputs, and a random routing of `tokens` tokens to `top_k` of the experts:
    (x, w13, w2, weights, ids), ids int64."""
    generator = torch.Generator().manual_seed(seed)
    w13 = torch.randn(experts, 2 * width, hidden, generator=generator) / hidden**0.5
    w2 = torch.randn(experts, hidden, width, generator=generator) / width**0.5
    x = torch.randn(tokens, hidden, generator=generator)
    weights, ids = torch.randn(tokens, experts, generator=generator).softmax(-1).topk(top_k, dim=-1)
    return x, w13, w2, weights, ids


def test_the_grouped_gemm_anchor_computes_the_moe_layer_the_fused_kernel_does():
    from hybridkv.kernels import moe_reference

    x, w13, w2, weights, ids = random_moe_layer(5, experts=6, hidden=32, width=16, top_k=3, tokens=9)
    ids[0] = 4  # one token sends every choice to one expert
    layer = kernel_speed.grouped_mm_moe(x, w13, w2, weights, ids.to(torch.int32))
    expected = moe_reference.fused_moe(x, w13, w2, weights, ids)
    assert rel_err(layer(), expected) < 1e-5
    assert kernel_speed.grouped_mm_available("cpu") == hasattr(torch, "_grouped_mm")


def test_the_fused_moe_row_prints_the_grouped_gemm_anchor_beside_it(monkeypatch):
    report = kernel_speed.Report({"copy_tbps": 3.0, "matmul_bf16_tflops": 700.0}, "unused.json")
    monkeypatch.setattr(report, "save", lambda: None)
    report.add("fused_moe", "T=4096", 860.0, flops=2e11, bound_us=544.0, grouped_mm_us=2101.8)
    assert report.table().splitlines()[-1].endswith("(63% of its bound)  (torch grouped GEMMs 2101.8 µs)")


def test_the_gemv_case_times_the_dispatchers_choice_against_cublas_and_sweeps(monkeypatch):
    report = stubbed_report(monkeypatch, 5.0)
    monkeypatch.setattr(kernel_speed, "ROTATION_BYTES", 4096)
    monkeypatch.setattr(kernel_speed, "GEMV_SWEPT", frozenset({(24, 40)}))
    monkeypatch.setattr(kernels, "GEMV_MIN_OUT_FEATURES", 16)  # the GEMV's smallest width, at these tiny shapes
    monkeypatch.setenv("HYBRIDKV_KERNELS", "triton")
    kernel_speed.gemv_bench(report, 24, 40, sweep=True)
    row = report.rows[-1]
    assert row["kernel"] == "gemv" and row["case"] == "M=1 N=24 K=40" and row["gemv"]
    assert row["baseline"] == "torch bf16 matmul (cuBLAS)" and row["tbps"] == (24 * 40 + 24 + 40) * 2 / row["time_us"] / 1e6
    assert len(report.sweeps) == len(kernel_speed.gemv_launches()) and all("time_us" in s for s in report.sweeps)
    kernel_speed.gemv_bench(report, 16, 40, sweep=True)  # not a swept shape
    assert len(report.sweeps) == len(kernel_speed.gemv_launches())


@pytest.mark.parametrize("prologue,heads,head_dim", [("swiglu", 1, 40), ("gated_norm", 2, 32), ("sigmoid_gate", 2, 32)])
def test_the_gemv_prologue_case_times_the_fused_product_against_the_two_launches(monkeypatch, prologue, heads,
                                                                                  head_dim):
    """Each case runs the two-launch path first (the baseline), then the fused product through the dispatcher, which
    takes the prologue GEMV (the interpreter here) at one 16-bit row."""
    from hybridkv.kernels import gemv

    report = stubbed_report(monkeypatch, 5.0)
    monkeypatch.setattr(kernel_speed, "ROTATION_BYTES", 4096)
    monkeypatch.setattr(kernels, "GEMV_MIN_OUT_FEATURES", 16)
    monkeypatch.setenv("HYBRIDKV_KERNELS", "triton")
    fused = {"swiglu": "swiglu_gemv", "gated_norm": "gated_norm_gemv", "sigmoid_gate": "sigmoid_gated_gemv"}[prologue]
    calls = []
    launch = getattr(gemv, fused)
    monkeypatch.setattr(gemv, fused, lambda *args: calls.append(fused) or launch(*args))
    kernel_speed.gemv_prologue_bench(report, prologue, heads, head_dim, 24)
    row = report.rows[-1]
    width = heads * head_dim
    assert row["kernel"] == "gemv_prologue" and row["case"] == f"{prologue} M=1 N=24 K={width}"
    assert row["baseline"] == "the activation's launch, then the GEMV"
    copies = -(-4096 // (24 * width * 2))  # the weight's copies in rotation, each timed call over all of them
    assert (row["baseline_us"], row["time_us"]) == (6.0 / copies, 7.0 / copies) and calls == [fused] * copies
    assert "gemv_prologue" in kernel_speed.BENCHES and not report.sweeps
    kernel_speed.gemv_prologue_bench(report, prologue, heads, head_dim, 24, sweep=True)
    launches = kernel_speed.gemv_launches()
    assert [(s["case"], s["block_n"], s["block_k"]) for s in report.sweeps] == [
        (row["case"], launch.block_n, launch.block_k) for launch in launches]
    assert all("time_us" in s for s in report.sweeps) and calls == [fused] * copies * (len(launches) + 2)


@pytest.mark.gpu
def test_measuring_the_ceilings_leaves_no_memory_reserved():
    """bench/throughput.py measures the ceilings in the process that then starts the engine, which counts whatever
    the allocator still holds as taken: cuBLAS's workspace, allocated by the matmul, must not pin one of the copy
    buffers' segments (it did, 4.3 GB of them, and a 0.8B engine measured 4 % fewer token blocks than planned)."""
    import gc

    kernel_speed.ceilings()
    gc.collect()
    torch.cuda.empty_cache()
    assert torch.cuda.memory_reserved() < 256 * 2**20


@pytest.mark.parametrize("tokens", ["0", "1,x", ""])
def test_fused_moe_token_counts_must_be_positive_integers(tokens, capsys):
    with pytest.raises(SystemExit) as exit_info:
        kernel_speed.main([f"--fused-moe-tokens={tokens}", "--only=fused_moe"])
    assert exit_info.value.code == 2
    assert "--fused-moe-tokens takes comma-separated positive token counts" in capsys.readouterr().err


def test_every_launch_the_one_token_moe_sweep_tries_computes_the_reference():
    """The --sweep's one-token configurations (the gate/up GEMV's rows, K tile and warps, the down projection's
    columns) each give the plain-torch layer, so a faster one found on a GPU is a valid default."""
    from hybridkv.kernels import moe, moe_reference

    # The widest K tile swept (512) is one tile.
    x, w13, w2, weights, ids = random_moe_layer(5, experts=8, hidden=512, width=32, top_k=2, tokens=1)
    ids = ids.to(torch.int32)
    want = moe_reference.fused_moe(x, w13, w2, weights, ids)
    launches = kernel_speed.moe_launches(1)
    shapes = {(launch.one_token_gate_up_block_n, launch.one_token_gate_up_block_k, launch.one_token_down_block_n)
              for launch in launches}
    assert len(shapes) == 18 and moe.MoeLaunch(16, 32, 128, 4, 4) in launches  # the default among them
    for launch in launches:
        if launch.one_token_gate_up_warps == launch.one_token_down_warps == 4:  # warps change nothing computed here
            assert rel_err(moe.fused_moe(x, w13, w2, weights, ids, launch=launch), want) < 1e-5


def test_every_launch_the_prefill_moe_sweep_tries_computes_the_reference():
    """The --sweep's prefill configurations (tile shapes, experts' runs padded to whole, half and quarter tiles)
    each give the plain-torch layer; the default is among them."""
    from hybridkv.kernels import moe, moe_reference

    x, w13, w2, weights, ids = random_moe_layer(6, experts=4, hidden=64, width=64, top_k=2, tokens=150)
    ids = ids.to(torch.int32)
    want = moe_reference.fused_moe(x, w13, w2, weights, ids)
    launches = kernel_speed.moe_launches(4096)
    assert moe.PREFILL_LAUNCH in launches and {launch.tile_blocks for launch in launches} == {1, 2, 4}
    for launch in launches:
        assert rel_err(moe.fused_moe(x, w13, w2, weights, ids, launch=launch), want) < 1e-5, launch


def test_the_norm_prefetch_case_times_the_chain_with_and_without_and_sweeps_the_limits(monkeypatch):
    """On the CPU no launch prefetches (the interpreter has no L2), so the case runs the same chain each way; what it
    records and which limits its sweep tries are the point here."""
    report = stubbed_report(monkeypatch, 20.0)
    monkeypatch.setattr(kernel_speed, "ROTATION_BYTES", 3 * 256 * 64 * 2)
    kernel_speed.norm_prefetch_bench(report, "tiny MLP", 64, ((256, 64), (64, 128)), 2, sweep=True)
    row = report.rows[-1]
    assert row["kernel"] == "norm_prefetch" and row["case"] == "tiny MLP M=2"
    assert row["baseline"] == "the norm without prefetches" and row["prefetched"] is False
    # Eight limits swept first, then the chain without prefetches, then with the engine's limits.
    swept = [(s["max_bytes"] >> 20, s["programs"]) for s in report.sweeps]
    assert swept == [(mib, per_sm * 4) for mib in (2, 4, 8, 16) for per_sm in (1, 2)]
    # Two links rotate (ROTATION_BYTES over one link's weights), so each timing is per link: half a call's.
    assert [s["time_us"] for s in report.sweeps] == [(21.0 + i) / 2 for i in range(8)]
    assert row["baseline_us"] == 29.0 / 2 and row["time_us"] == 30.0 / 2


def test_the_captured_decode_case_times_the_launch_split_for_max_model_len_against_the_contexts(monkeypatch):
    """The case launches decode attention as a graph captured for `max_model_len` does (more key segments than the
    context's own launch takes), after the launch sized for the context, and records both splits; the two compute
    the same attention."""
    report = stubbed_report(monkeypatch, 10.0)
    geometry = kernel_speed.AttentionGeometry(num_q_heads=4, num_kv_heads=2, head_dim=16, block_size=4)
    launched = []
    paged_attention = kernels.paged_attention
    monkeypatch.setattr(kernels, "paged_attention", lambda **inputs: launched.append(inputs["max_seqlen_k"])
                        or paged_attention(**inputs))
    kernel_speed.attention_captured_bench(report, geometry, 1, 70, 4096)
    row = report.rows[-1]
    assert row["kernel"] == "paged_decode_captured" and row["case"] == "Hq=4/2 B=1 ctx=70 max_model_len=4096"
    assert launched == [70, 4096] and (row["baseline_us"], row["time_us"]) == (11.0, 12.0)
    # Split until two programs a multiprocessor (the interpreter reports four) for 4,096 keys; 70 keys do not split.
    assert row["context_segments"] == 1 and row["segments"] == 4
    generator = torch.Generator().manual_seed(70)
    inputs = kernel_speed.paged_attention_inputs(geometry, [70], [1], generator)
    want = reference.paged_attention(**inputs)
    assert rel_err(paged_attention(**{**inputs, "max_seqlen_k": 4096}), want) < 1e-2
