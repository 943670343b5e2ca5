"""The L2 prefetch programs (`kernels.triton_utils.l2_prefetch_plan`): how a launch's slots split a projection's
bytes over its extra programs, when a launch takes them, that the kernels taking them compile for Hopper with the
prefetches in them (no GPU needed: Triton compiles for a named target), and what the model's kernels ask for."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
triton = pytest.importorskip("triton")

from hybridkv.kernels import triton_utils  # noqa: E402
from hybridkv.kernels.triton_utils import (  # noqa: E402
    L2_LINE_BYTES,
    L2_PREFETCH_MAX_BYTES,
    L2_PREFETCH_MAX_ROWS,
    L2_PREFETCH_MIN_BYTES,
    PrefetchLimits,
    l2_prefetch_plan,
    plan_l2_prefetch,
)

MIB = 1 << 20


def covered_spans(num_bytes: int, lane_bytes: int, threads: int) -> list[tuple[int, int]]:
    """The (start, end) each thread asks for, as `_line_prefetches` walks them, empty ones left out."""
    spans = []
    for lane in range(threads):
        start = lane * lane_bytes
        end = min(start + lane_bytes, num_bytes)
        if end > start:
            spans.append((start, end))
    return spans


@pytest.mark.parametrize("shape,lanes,programs", [((12352, 2560), 32, 132), ((2560, 9216), 128, 132),
                                                  ((4096 * 3 + 7, 2049), 32, 16), ((1, 2048 * 2048 + 3, 4), 32, 7)])
def test_a_slot_asks_for_the_head_of_a_tensor_once_in_whole_lines_over_every_thread(shape, lanes, programs):
    weight = torch.empty(shape, dtype=torch.bfloat16)
    plan = plan_l2_prefetch((weight,), lanes, programs)
    assert plan.programs == programs and plan.tensors[0] is weight
    total = weight.numel() * weight.element_size()
    assert plan.num_bytes[0] == min(total, L2_PREFETCH_MAX_BYTES)
    spans = covered_spans(plan.num_bytes[0], plan.lane_bytes[0], programs * lanes)
    assert spans[0][0] == 0 and spans[-1][1] == plan.num_bytes[0]
    assert all(end == start for (_, end), (start, _) in zip(spans, spans[1:]))
    assert plan.lane_bytes[0] % L2_LINE_BYTES == 0
    # Spread over the threads: none asks for more than its even share rounded up to a line.
    assert plan.lane_bytes[0] - plan.num_bytes[0] / (programs * lanes) < L2_LINE_BYTES
    # The empty second slot asks for nothing.
    assert plan.num_bytes[1] == 0 and covered_spans(0, plan.lane_bytes[1], programs * lanes) == []


def test_a_plan_takes_the_two_largest_contiguous_tensors_and_skips_small_ones():
    # The 4B's GDN input projection, MLP gate/up and down.
    in_proj = torch.empty(12352, 2560, dtype=torch.bfloat16)
    gate_up = torch.empty(18432, 2560, dtype=torch.bfloat16)
    down = torch.empty(2560, 9216, dtype=torch.bfloat16)
    small = torch.empty(L2_PREFETCH_MIN_BYTES // 2 - 8, dtype=torch.bfloat16)
    plan = plan_l2_prefetch((down, small, gate_up, in_proj), 32, 132)
    assert plan.tensors == (gate_up, in_proj)
    assert plan_l2_prefetch((small,), 32, 132) is None
    # The 0.8B's largest projection is under the floor.
    assert plan_l2_prefetch((torch.empty(8224, 1024, dtype=torch.bfloat16),), 32, 132) is None
    strided = torch.empty(8192, 8192, dtype=torch.bfloat16)[:, :4096]
    assert plan_l2_prefetch((strided,), 32, 132) is None
    # A contiguous block of a larger tensor (a stacked expert) is taken where it starts.
    stacked = torch.empty(3, L2_PREFETCH_MIN_BYTES // 2, dtype=torch.bfloat16)
    assert plan_l2_prefetch((stacked[2],), 32, 132).tensors[0].data_ptr() == stacked[2].data_ptr()
    assert MIB <= L2_PREFETCH_MAX_BYTES < L2_PREFETCH_MIN_BYTES


def test_launches_take_prefetch_programs_only_on_a_hopper_gpu_at_decode_sizes(monkeypatch):
    weight = torch.empty(L2_PREFETCH_MIN_BYTES // 2, dtype=torch.bfloat16)
    assert l2_prefetch_plan((weight,), 1, 32, torch.device("cpu")) is None
    # With support, one extra program per multiprocessor unless told.
    monkeypatch.setattr(triton_utils, "device_limits", lambda device: (132, 0))
    monkeypatch.setattr(triton_utils, "l2_prefetch_supported", lambda device: True)
    assert l2_prefetch_plan((weight,), 1, 32, torch.device("cpu")).programs == 132
    assert l2_prefetch_plan((weight,), 1, 32, torch.device("cpu"), PrefetchLimits(programs=144)).programs == 144
    assert l2_prefetch_plan((weight,), L2_PREFETCH_MAX_ROWS, 32, torch.device("cpu")) is not None
    assert l2_prefetch_plan((weight,), L2_PREFETCH_MAX_ROWS + 1, 32, torch.device("cpu")) is None
    assert l2_prefetch_plan((), 1, 32, torch.device("cpu")) is None
    # Other limits (what the benchmark sweeps): the 0.8B's in-projection with no floor, its first 2 MiB, at 64 rows.
    in_proj = torch.empty(8224, 1024, dtype=torch.bfloat16)
    assert l2_prefetch_plan((in_proj,), 1, 32, torch.device("cpu")) is None
    limits = PrefetchLimits(min_bytes=0, max_bytes=2 * MIB, max_rows=64)
    plan = l2_prefetch_plan((in_proj,), 64, 32, torch.device("cpu"), limits)
    assert plan.num_bytes[0] == 2 * MIB and plan.programs == 132
    assert l2_prefetch_plan((in_proj,), 65, 32, torch.device("cpu"), limits) is None


# Compiled in a process of its own: the suite runs Triton's interpreter, whose kernels do not compile.
HOPPER_PTX_COUNTS = """
import json
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from hybridkv.kernels import elementwise

def ptx(kernel, constexprs, floats, num_warps):
    signature = {p.name: ("constexpr" if p.is_constexpr else "*bf16" if p.name.endswith("_ptr")
                          else "fp32" if p.name in floats else "i64") for p in kernel.params}
    source = ASTSource(fn=kernel, signature=signature, constexprs=constexprs)
    return triton.compile(source, target=GPUTarget("cuda", 90, 64), options={"num_warps": num_warps}).asm["ptx"]

norm = dict(HAS_RESIDUAL=True, GATED=False, BLOCK_D=4096, FP8_GROUP=0, PDL=True, LANES=256)
counts = {}
for prefetch in (True, False):
    text = ptx(elementwise._norm_kernel, {**norm, "PREFETCH": prefetch}, {"eps"}, 8)
    counts[str(prefetch)] = text.count("prefetch.global.L2::evict_last")
print(json.dumps(counts))
"""


def test_the_norm_kernel_compiles_for_hopper_with_its_prefetches():
    env = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", HOPPER_PTX_COUNTS], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    counts = json.loads(done.stdout.strip().splitlines()[-1])
    # A line prefetch in each slot's walk; none without PREFETCH.
    assert counts == {"True": 2, "False": 0}


def same_tensors(held: tuple, asked: tuple) -> bool:
    """The same tensors, or views of the same block of the same tensor (a stacked expert is a new view each time)."""
    return len(held) == len(asked) and all(
        a is b or (a._base is not None and a._base is b._base and a.storage_offset() == b.storage_offset()
                   and a.shape == b.shape) for a, b in zip(held, asked))


def test_the_model_asks_for_the_weights_of_the_projection_after_each_kernel():
    from hybridkv.sidecar.model.moe import SparseMoeBlock
    from hybridkv.sidecar.model.qwen3_5 import Qwen3_5ForCausalLM
    from hybridkv.sizing import catalog_geometry

    for name in ("qwen3.5-0.8b", "qwen3.5-35b-a3b"):
        model = Qwen3_5ForCausalLM(catalog_geometry(name), torch.bfloat16, "meta")
        for layer in model.model.layers:
            mixer = layer.mixer
            if layer.layer_type == "linear_attention":
                assert mixer.prefetched() == (mixer.in_proj_qkvzba.weight,)
            else:
                assert mixer.prefetched() == (mixer.qkv_proj.weight,)
            # Each layer norm holds what the projection after it reads.
            assert same_tensors(layer.input_layernorm.prefetch, mixer.prefetched())
            assert same_tensors(layer.post_attention_layernorm.prefetch, layer.mlp.prefetched())
            mlp = layer.mlp
            if isinstance(mlp, SparseMoeBlock):
                # Every token's part: the router, and the shared expert, stacked last with the routed experts.
                router, gate_up, down = mlp.prefetched()
                assert router is mlp.router.weight
                assert gate_up.shape == mlp.experts.gate_up_proj.shape[1:] and gate_up.is_contiguous()
                assert gate_up.data_ptr() == mlp.experts.gate_up_proj[-1].data_ptr()
                assert down.shape == mlp.experts.down_proj.shape[1:]
            else:
                assert mlp.prefetched() == (mlp.gate_up_proj.weight, mlp.down_proj.weight)
