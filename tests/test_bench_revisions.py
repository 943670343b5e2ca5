"""bench/revisions.py end to end on CPU: two trees written by scripts/revision-trees.sh, each timed in its own child
process that must import hybridkv from its own tree."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_revisions_times_each_tree_in_alternating_rounds_from_its_own_code(tmp_path):
    trees = tmp_path / "trees"
    subprocess.run([str(ROOT / "scripts" / "revision-trees.sh"), "--dir", str(trees), "one=HEAD", "two=HEAD"],
                   check=True, capture_output=True, timeout=60)
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], check=True, capture_output=True,
                          text=True).stdout.strip()
    out = tmp_path / "revisions.json"
    result = subprocess.run(
        [sys.executable, "-P", str(ROOT / "bench" / "revisions.py"), "--tree", f"one={trees / 'one'}",
         "--tree", f"two={trees / 'two'}", "--out", str(out), "--checkpoint", str(tmp_path / "checkpoint"),
         "--device", "cpu", "--tiny", "--batch-sizes", "1,2", "--rounds", "2", "--prompt-len", "8",
         "--new-tokens", "3", "--max-num-seqs", "2", "--max-num-batched-tokens", "16", "--max-model-len", "64"],
        check=False, capture_output=True, text=True, timeout=240, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads(out.read_text())

    assert [(t["name"], t["revision"]) for t in report["trees"]] == [("one", head), ("two", head)]
    assert [r["order"] for r in report["rounds"]] == [["one", "two"], ["two", "one"]]
    import_trees = set()
    for round_ in report["rounds"]:
        for name, run in round_["runs"].items():
            assert [row["batch"] for row in run["rows"]] == [1, 2]
            assert all(row["decode_tokens_per_s"] > 0 and row["decode_ms_per_step"] > 0 for row in run["rows"])
            assert Path(run["hybridkv_file"]).is_relative_to(run["import_tree"])
            assert Path(run["engine_file"]).is_relative_to((trees / name).resolve())
            import_trees.add((name, run["import_tree"]))
    assert len({tree for _, tree in import_trees}) == 2  # one import tree per source tree, kept over the rounds
    assert set(report["summary"]["2"]["ratios"]) == {"two/one"}
    assert report["summary"]["1"]["ratios"]["two/one"]["median"] > 0
    assert "| batch | one tok/s | two tok/s | two/one |" in result.stdout


def test_a_hybridkv_module_from_outside_the_tree_stops_the_child(tmp_path):
    import importlib.util

    import hybridkv.sizing  # noqa: F401  (loaded from this checkout, not from tmp_path)

    spec = importlib.util.spec_from_file_location("revisions", ROOT / "bench" / "revisions.py")
    revisions = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(revisions)
    with pytest.raises(SystemExit, match=r"hybridkv\.sizing \("):
        revisions.check_modules_from(str(tmp_path))
