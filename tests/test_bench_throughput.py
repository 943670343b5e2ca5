"""bench/throughput.py's roofline arithmetic and its table: each decode rate against the roofline at the assumed
bandwidth and, on a GPU, at the copy rate measured in the same run."""

from __future__ import annotations

import sys
from argparse import Namespace
from pathlib import Path
from types import SimpleNamespace

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
import throughput  # noqa: E402


def test_the_roofline_is_the_steps_bytes_at_the_bandwidth():
    rank = SimpleNamespace(weights_bytes=8e9, bytes_per_request=50e6, bytes_per_token=32e3)
    # 16 requests: weights once, each state read and written, 1,000 tokens of KV each.
    step_bytes = 8e9 + 16 * 2 * 50e6 + 16 * 1000 * 32e3
    assert throughput.decode_roofline_tokens_per_s(rank, 16, 1000, 4.0) == pytest.approx(16 / (step_bytes / 4e12))
    # Experts no token reads come off the weights.
    assert throughput.decode_roofline_tokens_per_s(rank, 16, 1000, 4.0, 2e9) == pytest.approx(
        16 / ((step_bytes - 2e9) / 4e12))


def test_the_table_reads_each_rate_against_the_measured_copy_when_the_run_measured_it(capsys):
    args = Namespace(tiny=False, tensor_parallel_size=1, model="qwen3.5-4b", quantize=None, prompt_len=512,
                     new_tokens=128, bandwidth_tbs=4.3)
    row = {"batch": 16, "decode_tokens_per_s": 3900.0, "decode_roofline_tokens_per_s": 6600.0,
           "decode_pct_of_roofline": 59.1, "decode_pct_of_measured_copy": 60.2, "decode_ms_per_step": 4.1,
           "decode_device_wait_ms_per_step": 2.9, "prefill_tokens_per_s": 70000.0, "prefill_s": 0.1, "decode_s": 0.5}
    result = {"device": "GPU", "torch": "2", "command": "throughput.py", "bandwidth_tbs": 4.3,
              "ceilings": {"copy_tbps": 4.23, "matmul_bf16_tflops": 700.0},
              "engine": {"rows": [row]}, "transformers": {"with_fla": True, "rows": []},
              "capacity": {"comparison": {}}}
    throughput.print_tables(args, result)
    out = capsys.readouterr().out
    assert "% at the copy rate (4.23 TB/s measured)" in out and "| 16 | 3900 | 6600 | 59% | 60% | 4.10 |" in out
    unmeasured = {**result, "ceilings": None, "engine": {"rows": [{k: v for k, v in row.items()
                                                                    if k != "decode_pct_of_measured_copy"}]}}
    throughput.print_tables(args, unmeasured)
    out = capsys.readouterr().out
    assert "(not measured)" in out and "| 16 | 3900 | 6600 | 59% | - | 4.10 |" in out
