"""bench/mixed_steps.py end to end on CPU: the rows it writes hold the prefill budget it was given, and each timing
covers the steps it names (the decoders' prompts take several steps, which are not timed)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parent.parent


def test_mixed_steps_times_decode_steps_with_and_without_prefill(tmp_path):
    out = tmp_path / "mixed.json"
    result = subprocess.run(
        [sys.executable, "-P", str(ROOT / "bench" / "mixed_steps.py"), "--device", "cpu", "--tiny",
         "--checkpoint", str(tmp_path / "checkpoint"), "--batch-sizes", "2,3", "--prefill-budgets", "8,32",
         "--steps", "3", "--max-num-seqs", "4", "--max-model-len", "512", "--prompt-len", "40",
         "--max-num-batched-tokens", "64", "--out", str(out)],
        capture_output=True, text=True, timeout=240, env=dict(os.environ, OMP_NUM_THREADS="1"), check=False)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    rows = json.loads(out.read_text())["rows"]
    assert [(row["batch"], row["prefill_budget"]) for row in rows] == [(2, 8), (2, 32), (3, 8), (3, 32)]
    for row in rows:
        assert row["pure_steps_by_kind"] == {"decode": 3, "mixed": 0, "prefill": 0}
        assert row["mixed_steps_by_kind"] == {"decode": 0, "mixed": 3, "prefill": 0} and row["mixed_steps"] == 3
        assert row["pure_decode_step_ms"] > 0 and row["mixed_step_ms"] > 0
        # Each mixed step prefilled exactly the budget: rate x step time gives it back.
        assert row["prefill_tokens_per_s"] * row["mixed_step_ms"] / 1000 == pytest.approx(row["prefill_budget"])
    assert "prefill/step" in result.stdout


def test_flags_that_cannot_time_a_row_are_refused(capsys):
    sys.path.insert(0, str(ROOT / "bench"))
    import mixed_steps

    assert mixed_steps.parse_args([]).max_num_seqs == 257  # the defaults run: 256 decoders beside the probe prompt
    for argv, message in ((["--batch-sizes", "x"], "comma-separated integers"),
                          (["--prefill-budgets", "8192", "--max-model-len", "8192"], "probe prompt outlasts"),
                          (["--batch-sizes", "256", "--max-num-seqs", "256"], "leave a state slot")):
        with pytest.raises(SystemExit) as exit_info:
            mixed_steps.parse_args(argv)
        assert exit_info.value.code == 2 and message in capsys.readouterr().err
