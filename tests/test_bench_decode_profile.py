"""bench/decode_profile.py end to end on CPU: decode steps alone and mixed steps beside a prefilling prompt, each
batch's profiled steps of the kind asked for, the host-timed step beside the operators' sum; bad flags refused."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parent.parent


# (8, 12, 64): a prompt prefilling beside the decodes; (0, 120, 16): prompts that take more steps to admit than the
# profiled steps' tokens, so the first ones must not finish before the last decodes.
@pytest.mark.parametrize(("prefill_tokens", "prompt_len", "budget"), [(0, 12, 64), (8, 12, 64), (0, 120, 16)])
def test_the_profile_times_and_profiles_the_steps_it_names(tmp_path, prefill_tokens, prompt_len, budget):
    out = tmp_path / "profile.json"
    result = subprocess.run(
        [sys.executable, "-P", str(ROOT / "bench" / "decode_profile.py"), "--device", "cpu", "--tiny",
         "--checkpoint", str(tmp_path / "checkpoint"), "--batch-sizes", "2,3", "--steps", "2",
         "--prefill-tokens", str(prefill_tokens), "--max-num-seqs", "4", "--max-model-len", "256",
         "--prompt-len", str(prompt_len), "--max-num-batched-tokens", str(budget), "--out", str(out)],
        capture_output=True, text=True, timeout=240, env=dict(os.environ, OMP_NUM_THREADS="1"), check=False)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    report = json.loads(out.read_text())
    assert report["prefill_tokens"] == prefill_tokens and [b["batch"] for b in report["batches"]] == [2, 3]
    kind = "mixed" if prefill_tokens else "decode"
    for batch in report["batches"]:
        # Two timed and two profiled steps, all of the kind asked for.
        assert batch["steps_by_kind"] == {**{"decode": 0, "mixed": 0, "prefill": 0}, kind: 4}
        assert batch["host_ms_per_step"] > 0 and batch["kernel_us_per_step"] > 0 and batch["kernels"]
    assert ("mixed step (8 prefill tokens)" if prefill_tokens else "per decode step") in result.stdout


def test_flags_that_cannot_profile_are_refused(capsys):
    sys.path.insert(0, str(ROOT / "bench"))
    import decode_profile

    for argv, message in ((["--batch-sizes", "x"], "comma-separated integers"),
                          (["--prefill-tokens", "-1"], "at least 0"),
                          (["--batch-sizes", "64", "--prefill-tokens", "512", "--max-model-len", "4096"], "outlasts the profiled steps"),
                          (["--batch-sizes", "256", "--prefill-tokens", "8"], "fit --max-num-seqs")):
        with pytest.raises(SystemExit) as exit_info:
            decode_profile.parse_args(argv)
        assert exit_info.value.code == 2 and message in capsys.readouterr().err
