"""bench/admission_replay.py: the engine's scheduler replayed on a step-time model, with and without a TPOT target."""

from __future__ import annotations

import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "bench"))
import admission_replay  # noqa: E402


def test_a_tpot_target_trades_first_token_time_for_time_per_token(tmp_path, capsys):
    out = tmp_path / "replay.json"
    assert admission_replay.main(["--concurrency", "96", "--targets", "0,12", "--requests", "160",
                                  "--out", str(out)]) == 0
    off, held = json.loads(out.read_text())["rows"]
    assert off["requests"] == held["requests"] == 160
    assert off["tpot_held_steps"] == 0 < held["tpot_held_steps"]
    # Fewer requests decode at once: each step is shorter, the queued ones wait longer for their first token.
    assert held["tpot_ms"]["p50"] < off["tpot_ms"]["p50"] and held["tpot_ms"]["p50"] < 12 * 1.1
    assert held["ttft_ms"]["p50"] > off["ttft_ms"]["p50"]
    assert held["mean_decode_batch"] < off["mean_decode_batch"]
    table = capsys.readouterr().out
    assert "| 96 | off |" in table and "| 96 | 12.0 |" in table


def test_the_decode_step_is_read_between_the_measured_batches():
    points = admission_replay.parse_decode_steps("64:6,16:4,256:14")
    assert points == [(16, 4.0), (64, 6.0), (256, 14.0)]
    assert admission_replay.decode_step_s(points, 40) == pytest.approx(0.005)
    assert admission_replay.decode_step_s(points, 8) == pytest.approx(0.004 - 8 * 2 / 48 / 1000)
    assert admission_replay.decode_step_s(points, 512) == pytest.approx((14 + 256 * 8 / 192) / 1000)


@pytest.mark.parametrize(("flags", "message"), [
    (["--decode-step-ms", "16"], "BATCH:MS pairs"),
    (["--decode-step-ms", "16:4,16:5"], "names a batch size twice"),
    (["--decode-step-ms", "0:4"], "a batch of at least 1"),
    (["--targets", "fast"], "--targets takes comma-separated numbers"),
    (["--concurrency", "0"], "--concurrency: every value must be in [1"),
    (["--prefill-tok-s", "0"], "--prefill-tok-s positive"),
])
def test_bad_settings_exit_2_naming_them(flags, message, tmp_path, capsys):
    assert admission_replay.main([*flags, "--out", str(tmp_path / "x.json")]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "x.json").exists()
