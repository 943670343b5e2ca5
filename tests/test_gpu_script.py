"""scripts/gpu.sh hands each bench the flags that follow it whole, a value with spaces included (the serving bench's
--serve-args carries a whole `hybridkv serve` command line), and runs the test paths before them."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# Stands in for the GPU machine's python3: records each invocation (its argument count, then one argument a line)
# and succeeds.
RECORDING_PYTHON = """#!/bin/sh
cat > /dev/null
printf '%s\\n' "$#" "$@" >> "$CALLS"
"""


def _invocations(calls: Path) -> list[list[str]]:
    lines = calls.read_text().splitlines()
    invocations = []
    while lines:
        count, lines = int(lines[0]), lines[1:]
        invocations.append(lines[:count])
        lines = lines[count:]
    return invocations


def test_each_bench_gets_its_own_flags_whole(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python3").write_text(RECORDING_PYTHON)
    (bin_dir / "python3").chmod(0o755)
    calls = tmp_path / "calls"
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "CALLS": str(calls), "OUT": str(tmp_path / "out"),
           "TMPDIR": str(tmp_path)}
    result = subprocess.run(
        ["bash", str(ROOT / "scripts/gpu.sh"), "tests/test_kernels_gpu.py", "-x",
         "bench/serving.py", "--serve-args=--model /m --device cuda", "--concurrency=1,32",
         "bench/kernel_speed.py", "--only=w4a16_gemm"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    invocations = _invocations(calls)
    pytest_run = next(args for args in invocations if args[:3] == ["-P", "-m", "pytest"])
    assert pytest_run[-2:] == ["tests/test_kernels_gpu.py", "-x"]
    benches = {args[0]: args[1:] for args in invocations if args and args[0].startswith("bench/")}
    out = tmp_path / "out"
    assert benches["bench/serving.py"][0] == "--out"
    assert Path(benches["bench/serving.py"][1]).parent == out
    assert benches["bench/serving.py"][2:] == ["--serve-args=--model /m --device cuda", "--concurrency=1,32"]
    assert benches["bench/kernel_speed.py"][2:] == ["--only=w4a16_gemm"]
