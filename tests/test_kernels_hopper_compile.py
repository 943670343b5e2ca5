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
from hybridkv.kernels import attention, step_inputs

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
for pdl in (True, False):
    write = ptx(attention._write_kv_cache_kernel,
                dict(HD=512, BLOCK_HD=512, BLOCK_SIZE=16, QUANTIZE=False, FP8_MAX=448.0, ROUND_IN_FLOAT32=False,
                     PDL=pdl), {"slot_mapping_ptr": "*i64", "k_inv_scale": "fp32", "v_inv_scale": "fp32"}, 4)
    attend = ptx(attention._paged_attention_kernel,
                 dict(HQ=8, GROUP=4, GROUP_PAD=4, BLOCK_Q=4, HEAD_DIM=256, BLOCK_N=64, PAGE=16, NUM_SEGMENTS=8,
                      FLOAT32_DOT=False, DOT_PRECISION="tf32", PDL=pdl),
                 {**ints, **parts, "scale_log2": "fp32", "v_scale": "fp32"}, 4)
    merge = ptx(attention._merge_segments_kernel, dict(HQ=8, HEAD_DIM=256, NUM_SEGMENTS=8, PDL=pdl), parts, 4)
    for name, text in (("write_kv", write), ("attention", attend), ("merge", merge)):
        counts[f"{name} {pdl}"] = [text.count("griddepcontrol.wait"), text.count("griddepcontrol.launch_dependents")]
print(json.dumps(counts))
"""


def test_attention_and_the_decode_input_unpack_compile_for_hopper():
    env = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", HOPPER_PTX], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    counts = json.loads(done.stdout.strip().splitlines()[-1])
    assert counts.pop("unpack") >= 7  # a store for each of the six fields and the table row's
    for name in ("write_kv", "attention", "merge"):
        assert counts[f"{name} True"] == [1, 1] and counts[f"{name} False"] == [0, 0], (name, counts)
