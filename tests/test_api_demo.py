"""`hybridkv demo` end to end: plan, build the small checkpoint, serve it, stream, compare planned vs measured."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

pytest.importorskip("torch")

COMPARED_ROWS = ("budget_bytes", "state_slots", "state_pool_bytes", "token_blocks", "token_capacity",
                 "token_pool_bytes")


def _demo(cache_dir, *flags: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "HYBRIDKV_CACHE": str(cache_dir)}
    return subprocess.run([sys.executable, "-P", "-m", "hybridkv", "demo", *flags], capture_output=True, text=True,
                          env=env, timeout=600)


def test_demo_streams_and_measures_what_it_planned(tmp_path):
    result = _demo(tmp_path / "cache", "--device", "cpu")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    out = result.stdout
    assert "Planning the bundled example HybridModel qwen3.5-4b-h200.yaml" in out
    assert "--max-num-seqs 256" in out  # the example's plan: one state slot per running request
    # Random weights: a stream may meet its end-of-sequence token before 32 tokens.
    finished = re.findall(r"\[(\d+) tokens, (length|stop),", out)
    assert len(finished) == 3 and all(reason == "stop" or count == "32" for count, reason in finished)
    # A full batch holds every state slot while it runs and gives them all back when it finishes.
    assert "8 streams at once: 8 running, 8 of 8 state slots" in out
    assert "when they finished: 0 slots, 0 blocks" in out
    for row in COMPARED_ROWS:
        match = re.search(rf"^\s+{row}\s+([\d,]+)\s+([\d,]+)\s+(\w+)$", out, re.MULTILINE)
        assert match, f"no {row} row in:\n{out}"
        assert match.group(1) == match.group(2) and match.group(3) == "yes"
    assert "sidecar stopped (exit code 0)" in out
    assert (tmp_path / "cache" / "demo").is_dir()
    assert any((path / "config.json").is_file() for path in (tmp_path / "cache" / "demo").iterdir())


def test_demo_fails_with_a_clear_message_when_the_cache_is_unwritable(tmp_path):
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("a file where the cache folder should be")
    result = _demo(blocker, "--device", "cpu")
    assert result.returncode == 1
    assert "hybridkv demo: failed: cannot write the demo checkpoint" in result.stderr
    assert "set HYBRIDKV_CACHE to a writable folder" in result.stderr
