"""scripts/two_gpu_run.sh: its CPU mode runs every step of the two-GPU run (per-test bounded pytest, checkpoints,
per-rank capacity against the planner, tp=1 and tp=2 throughput with the collectives' share, serving at tp=2) on tiny
models with gloo, and writes all results under one folder."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "two_gpu_run.sh"
RUN_LIMIT_S = 300
STEPS = ["test test_close_in_the_middle_of_overlapped_steps_shuts_down_cleanly", "checkpoint qwen3.5-9b",
         "checkpoint qwen3.6-27b", "capacity qwen3.6-27b tp=2", "throughput qwen3.5-9b tp=1",
         "throughput qwen3.5-9b tp=2", "throughput tp=2 against tp=1", "serving qwen3.6-27b tp=2"]


def run_script(*args: str, tmp_path: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "TMPDIR": str(tmp_path / "checkpoints"),
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    env.pop("OUT", None)
    (tmp_path / "checkpoints").mkdir(exist_ok=True)
    return subprocess.run(["bash", str(SCRIPT), *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=RUN_LIMIT_S)


@pytest.mark.slow
def test_the_cpu_mode_runs_every_step_and_writes_one_folder(tmp_path):
    out = tmp_path / "results"
    done = run_script("--cpu", "--out", str(out), tmp_path=tmp_path)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    rows = [re.match(r"(.+?)\s+(\d+)\s+(\d+)\s+(\S.*)$", line).groups()
            for line in (out / "summary.txt").read_text().splitlines()[1:]]
    assert [(step, rc) for step, rc, _, _ in rows] == [(step, "0") for step in STEPS]
    assert "1 passed" in (out / "test-test_close_in_the_middle_of_overlapped_steps_shuts_down_cleanly.log").read_text()

    capacity = json.loads((out / "capacity-27b-tp2.json").read_text())
    assert len(capacity["per_rank"]) == 2 and capacity["state_slots_equal_across_ranks"]
    assert capacity["plan"]["tensor_parallel_size"] == 2
    for rank in capacity["comparison_per_rank"]:  # a fixed budget on CPU: the planner's pools are exact
        assert {key: rank[key]["error_pct"] for key in ("budget_bytes", "token_blocks", "state_slots")} == \
            {"budget_bytes": 0.0, "token_blocks": 0.0, "state_slots": 0.0}

    one, two = (json.loads((out / f"throughput-9b-tp{tp}.json").read_text()) for tp in (1, 2))
    assert [row["batch"] for row in one["engine"]["rows"]] == [row["batch"] for row in two["engine"]["rows"]] == [1, 2]
    assert all("collectives" not in row for row in one["engine"]["rows"])
    for row in two["engine"]["rows"]:
        # Per decode step: an all-reduce of the embedding, two per layer, the logits' all-gather, the ids' broadcast.
        assert row["collectives"]["collective_calls_per_step"] == 2 + 2 * 4 + 1
        assert 0 < row["collectives"]["collective_share_of_step"] < 1
    assert "| 1 |" in (out / "throughput-9b-tp2-vs-tp1.md").read_text()

    serving = json.loads((out / "serving-27b-tp2.json").read_text())
    assert serving["model_info"]["tensor_parallel_size"] == 2
    assert serving["phases"][0]["summary"]["completed"] == 4 and not serving["phases"][0]["summary"]["failed"]


def test_an_unknown_step_is_refused_before_anything_runs(tmp_path):
    done = run_script("--cpu", "--out", str(tmp_path / "results"), "--steps", "tests,benchmarks", tmp_path=tmp_path)
    assert done.returncode == 2
    assert "unknown step benchmarks" in done.stderr
    assert not (tmp_path / "results").exists()
