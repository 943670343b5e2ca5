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


def test_the_step_costs_come_from_a_throughput_result_or_the_flags(tmp_path):
    rows = [{"batch": 64, "decode_ms_per_step": 6.0, "prefill_tokens_per_s": 60000.0},
            {"batch": 16, "decode_ms_per_step": 4.0, "prefill_tokens_per_s": 62000.0}]
    (tmp_path / "parts.json").write_text(json.dumps({"engine": {"rows": rows}}))
    args = admission_replay.build_parser().parse_args(["--parts", str(tmp_path / "parts.json")])
    parts = admission_replay.build_parts(args)
    assert parts.prefill_tokens_per_s == 62000.0 and parts.decode_step_ms_by_batch == ((16.0, 4.0), (64.0, 6.0))
    assert parts.decode_step_ms(40) == pytest.approx(5.0)
    args = admission_replay.build_parser().parse_args(["--parts", str(tmp_path / "parts.json"), "--decode-step-ms",
                                                       "256:14,1:3", "--prefill-tok-s", "50000"])
    parts = admission_replay.build_parts(args)
    assert (parts.prefill_tokens_per_s, parts.decode_step_ms_by_batch) == (50000.0, ((1, 3.0), (256, 14.0)))
    defaults = admission_replay.build_parts(admission_replay.build_parser().parse_args([]))
    assert defaults.prefill_tokens_per_s == admission_replay.DEFAULT_PREFILL_TOK_S
    assert defaults.decode_step_ms_by_batch == tuple(
        admission_replay.parse_decode_steps(admission_replay.DEFAULT_DECODE_STEPS))


@pytest.mark.parametrize(("flags", "message"), [
    (["--decode-step-ms", "16"], "BATCH:MS pairs"),
    (["--decode-step-ms", "16:4,16:5"], "names a batch size twice"),
    (["--decode-step-ms", "0:4"], "a batch of at least 1"),
    (["--targets", "fast"], "--targets takes comma-separated numbers"),
    (["--concurrency", "0"], "--concurrency: every value must be in [1"),
    (["--prefill-tok-s", "0"], "--prefill-tok-s must be positive"),
    (["--parts", "/nonexistent/parts.json"], "--parts: cannot read"),
])
def test_bad_settings_exit_2_naming_them(flags, message, tmp_path, capsys):
    assert admission_replay.main([*flags, "--out", str(tmp_path / "x.json")]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "x.json").exists()
