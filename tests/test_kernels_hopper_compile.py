"""Kernels of the decode chain compiled for Hopper without a GPU (Triton compiles for a named target): the attention
kernels wait for the kernel before them and release the next exactly when launched dependently, and the kernel that
unpacks a replayed decode step's inputs compiles (the interpreter accepts code the compiler may not)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("torch")
pytest.importorskip("triton")

# Compiled in a process of its own: the suite runs Triton's interpreter, whose kernels do not compile.
HOPPER_PTX = """
import json
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from hybridkv.kernels import attention, conv1d, elementwise, gdn_recurrent, gemv, step_inputs

def ptx(kernel, constexprs, types, num_warps):
    signature = {p.name: "constexpr" if p.is_constexpr
                 else types.get(p.name, "*bf16" if p.name.endswith("_ptr") else "i32") for p in kernel.params}
    source = ASTSource(fn=kernel, signature=signature, constexprs=constexprs)
    return triton.compile(source, target=GPUTarget("cuda", 90, 64), options={"num_warps": num_warps}).asm["ptx"]

ints = {name: "*i32" for name in ("seq_lens_ptr", "state_slots_ptr", "block_tables_ptr", "cu_seqlens_q_ptr")}
longs = {name: "*i64" for name in ("packed_ptr", "last_tokens_ptr", "input_ids_ptr", "positions_ptr",
                                   "slot_mapping_ptr", "sample_slots_ptr")}
parts = {"part_o_ptr": "*fp32", "part_m_ptr": "*fp32", "part_l_ptr": "*fp32"}
unpack = ptx(step_inputs._unpack_decode_inputs_kernel, {"BLOCK": 256}, {**ints, **longs}, 1)
counts = {"unpack": unpack.count("st.global")}
floats = {"scale_log2": "fp32", "v_scale": "fp32", "eps": "fp32", "k_inv_scale": "fp32", "v_inv_scale": "fp32",
          "scale": "fp32"}
# Each kernel of the decode chain: what it is compiled with, its pointer and float arguments, its warps.
chain = {
    "write_kv": (attention._write_kv_cache_kernel,
                 dict(HD=512, BLOCK_HD=512, BLOCK_SIZE=16, QUANTIZE=False, FP8_MAX=448.0, ROUND_IN_FLOAT32=False),
                 {"slot_mapping_ptr": "*i64"}, 4),
    "attention": (attention._paged_attention_kernel,
                  dict(HQ=8, GROUP=4, GROUP_PAD=4, BLOCK_Q=4, HEAD_DIM=256, BLOCK_N=64, PAGE=16, NUM_SEGMENTS=8,
                       FLOAT32_DOT=False, DOT_PRECISION="tf32"), {**ints, **parts}, 4),
    "merge": (attention._merge_segments_kernel, dict(HQ=8, HEAD_DIM=256, NUM_SEGMENTS=8), parts, 4),
    "norm": (elementwise._norm_kernel,
             dict(HAS_RESIDUAL=True, GATED=False, BLOCK_D=1024, FP8_GROUP=0, PREFETCH=False, LANES=128), {}, 4),
    "qk_norm_rotary": (elementwise._qk_norm_rotary_kernel, dict(HALF=32, BLOCK_HALF=32, BLOCK_D=256),
                       {"positions_ptr": "*i64", "inv_freq_ptr": "*fp32"}, 1),
    "conv": (conv1d._conv1d_decode_kernel, dict(D=6144, W=4, BW=4, BD=256, PREFETCH_STATE=True),
             {"slot_ids_ptr": "*i32"}, 4),
    "gdn": (gdn_recurrent._gdn_decode_kernel,
            dict(H=16, HV=16, K=128, V=128, BK=128, BV=8, PREFETCH_STATE=True),
            {"slot_ids_ptr": "*i32", "A_log_ptr": "*fp32", "dt_bias_ptr": "*bf16", "state_ptr": "*fp32",
             "o_ptr": "*bf16"}, 1),
    "gemv": (gemv._gemv_kernel, dict(BLOCK_N=4, BLOCK_K=1024, SPLIT_K=2, PROLOGUE=1, HEAD_DIM=1),
             {"shares_ptr": "*fp32", "counters_ptr": "*i32"}, 4),
}
for name, (kernel, constexprs, types, warps) in chain.items():
    for pdl, early in ((True, False), (True, True), (False, False), (False, True)):
        text = ptx(kernel, {**constexprs, "PDL": pdl, "EARLY": early}, {**floats, **types}, warps)
        wait, release = text.find("griddepcontrol.wait"), text.find("griddepcontrol.launch_dependents")
        counts[f"{name} {pdl} {early}"] = [text.count("griddepcontrol.wait"),
                                           text.count("griddepcontrol.launch_dependents"),
                                           "release first" if 0 <= release < wait else "wait first"]
print(json.dumps(counts))
"""


def test_attention_and_the_decode_input_unpack_compile_for_hopper():
    env = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", HOPPER_PTX], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    counts = json.loads(done.stdout.strip().splitlines()[-1])
    assert counts.pop("unpack") >= 7  # a store for each of the six fields and the table row's
    for name in ("write_kv", "attention", "merge", "norm", "qk_norm_rotary", "conv", "gdn", "gemv"):
        # Launched dependently, one wait and one release: after the wait, or before it when the kernel lets the
        # next one start at once; launched plainly, neither.
        waits, releases, order = counts[f"{name} True False"]
        assert waits >= 1 and releases == waits and order == "wait first", (name, counts)  # one of each a branch
        waits, releases, order = counts[f"{name} True True"]
        assert waits >= 1 and releases == 1 and order == "release first", (name, counts)
        assert counts[f"{name} False False"][:2] == [0, 0] and counts[f"{name} False True"][:2] == [0, 0], name
