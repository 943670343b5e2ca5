"""bench/host_step.py on CPU: every part of a decode step is timed per batch size and the parts fit in the step."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
import host_step  # noqa: E402


def test_a_cpu_run_times_every_part_of_the_decode_steps(tmp_path, monkeypatch):
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    out = tmp_path / "host_step.json"
    # 4 prompts of 40 tokens take three steps of 64: none of them is timed.
    assert host_step.main(["--device", "cpu", "--tiny", "--batch-sizes", "2,4", "--max-num-seqs", "4",
                           "--max-model-len", "128", "--max-num-batched-tokens", "64", "--prompt-len", "40",
                           "--steps", "3", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert [row["batch"] for row in result["rows"]] == [2, 4] and result["device"] == "cpu"
    for row in result["rows"]:
        assert row["steps_by_kind"] == {"decode": 3, "mixed": 0, "prefill": 0}
        parts = row["parts_ms"]
        assert set(parts) == {"schedule", "batch", "forward", "logits", "sample", "outputs", "other"}
        # Each step schedules, builds its tensors, runs the model and hands out one token per request.
        assert all(parts[name] > 0 for name in ("schedule", "batch", "forward", "sample", "outputs"))
        assert sum(parts.values()) == pytest.approx(row["step_ms"], rel=1e-6) or parts["other"] == 0
        assert row["host_ms"] == pytest.approx(parts["schedule"] + parts["batch"] + parts["outputs"])


def test_with_prefill_tokens_every_timed_step_is_a_mixed_one(tmp_path, monkeypatch):
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    out = tmp_path / "host_step.json"
    assert host_step.main(["--device", "cpu", "--tiny", "--batch-sizes", "3", "--max-num-seqs", "4",
                           "--max-model-len", "256", "--max-num-batched-tokens", "64", "--prompt-len", "8",
                           "--steps", "4", "--prefill-tokens", "16", "--profile", "5", "--module-times",
                           "--out", str(out)]) == 0
    row = json.loads(out.read_text())["rows"][0]
    assert row["prefill_tokens"] == 16 and row["steps_by_kind"] == {"decode": 0, "mixed": 4, "prefill": 0}
    # --profile ranks the functions by own host time per step.
    own = [entry["own_ms_per_step"] for entry in row["profile"]]
    assert len(own) == 5 and own == sorted(own, reverse=True) and own[0] > 0
    assert all(entry["cumulative_ms_per_step"] >= entry["own_ms_per_step"] for entry in row["profile"])
    # --module-times: every layer's token mixer and MLP ran once a step, inside the forward's own time.
    modules = row["module_host_ms"]
    for part in ("project", "mix", "finish"):
        mixers = (modules[f"Qwen3_5GatedDeltaNet.{part}"]["calls_per_step"]
                  + modules[f"Qwen3_5Attention.{part}"]["calls_per_step"])
        assert mixers == modules["Qwen3_5MLP"]["calls_per_step"] > 0
    assert 0 < modules["Qwen3_5MLP"]["ms_per_step"] <= row["parts_ms"]["forward"]


def test_a_batch_larger_than_the_engine_holds_is_refused(capsys):
    with pytest.raises(SystemExit) as exit_info:
        host_step.parse_args(["--batch-sizes", "512", "--max-num-seqs", "256"])
    assert exit_info.value.code == 2
    assert "every batch size (and with --prefill-tokens, the prompt beside it) must fit" in capsys.readouterr().err


def test_a_flag_the_engine_refuses_ends_the_script_with_its_message(tmp_path, monkeypatch, capsys):
    """The engine-building scripts run through `throughput.run_script`: a refused flag is its message and exit code
    2, not a traceback, and no result is written."""
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr(sys, "argv", ["host_step.py"])
    out = tmp_path / "host_step.json"
    with pytest.raises(SystemExit) as exit_info:
        host_step.throughput.run_script(lambda: host_step.main([
            "--device", "cpu", "--tiny", "--batch-sizes", "2", "--max-num-seqs", "2", "--max-model-len", "16384",
            "--prompt-len", "8", "--steps", "1", "--out", str(out)]))
    assert exit_info.value.code == 2
    assert "host_step.py: max_model_len=16384 exceeds the model's max_position_embeddings" in capsys.readouterr().err
    assert not out.exists()
