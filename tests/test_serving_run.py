"""scripts/serving_run.sh: its CPU mode runs every step of the GPU serving run (one server for both front doors, then
prefix caching off and on) on a tiny model, and writes all results under one folder."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "serving_run.sh"
OVERHEAD = ["overhead-grpc-1", "overhead-http-1", "overhead-grpc-2", "overhead-http-2"]
STEPS = ["make-model", "parts", "serve (plain)", "stall", "grpc", "http", *OVERHEAD, "overhead", "chat-grpc-uncached",
         "chat-chat-uncached", "document-grpc-uncached", "serve (prefix caching)", "chat-grpc-cached",
         "chat-chat-cached", "document-grpc-cached"]


def run_script(*args: str, tmp_path: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "TMPDIR": str(tmp_path), "OMP_NUM_THREADS": "1",
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    env.pop("OUT", None)
    return subprocess.run(["bash", str(SCRIPT), *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)


def run_steps(tmp_path: Path, *args: str) -> tuple[Path, list[str]]:
    """`--cpu` with these arguments into a results folder: the folder and the steps summary.txt lists, in order."""
    out = tmp_path / "results"
    done = run_script("--cpu", "--out", str(out), *args, tmp_path=tmp_path)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    return out, [line.split("  ")[0].strip() for line in (out / "summary.txt").read_text().splitlines()[2:]]


def _phases(out: Path, name: str) -> list[dict]:
    return json.loads((out / f"serving-{name}.json").read_text())["phases"]


def test_the_cpu_mode_runs_every_step_and_writes_one_folder(tmp_path):
    out = tmp_path / "results"
    done = run_script("--cpu", "--out", str(out), tmp_path=tmp_path)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    rows = [re.match(r"(.+?)\s+(\d+)\s+(\d+)\s+(\S.*)$", line).groups()
            for line in (out / "summary.txt").read_text().splitlines()[2:]]
    assert [(step, rc) for step, rc, _, _ in rows] == [(step, "0") for step in STEPS]

    stall = _phases(out, "stall")[0]
    assert stall["concurrency"] == 1 and stall["summary"]["completed"] == 4
    assert stall["summary"]["first_shape_stall"] is not None and stall["engine_steps"]["jit_compiles"] == 0
    grpc, http = _phases(out, "grpc"), _phases(out, "http")
    assert [phase["concurrency"] for phase in grpc] == [2, 4] and [phase["concurrency"] for phase in http] == [2]
    for phase in grpc + http:
        assert phase["summary"]["completed"] == phase["summary"]["requests"] == 8
        # Read against the engine's own parts, measured by the parts step.
        assert phase["bound"]["total_tokens_per_s"] > 0 and phase["ratios_to_bound"]["total_tokens_per_s"] > 0
    assert [row["batch"] for row in json.loads((out / "throughput.json").read_text())["engine"]["rows"]] == [2, 4]
    # The same seeded requests through both front doors of one server.
    assert http[0]["summary"]["prompt_tokens"] == grpc[0]["summary"]["prompt_tokens"]

    uncached, cached = (_phases(out, name)[0] for name in ("chat-grpc-uncached", "chat-grpc-cached"))
    # A server without prefix caching looks nothing up; the client's unbounded model counts either way.
    assert uncached["prefix_cache"]["queried_tokens"] == uncached["prefix_cache"]["hit_tokens"] == 0
    assert uncached["prefix_cache"]["unbounded_hit_tokens"] > 0
    assert cached["prefix_cache"]["queried_tokens"] == cached["summary"]["prompt_tokens"]
    assert cached["prefix_cache"]["hit_tokens"] > 0
    assert "ready in" in (out / "ready-prefix.log").read_text()
    # Through the chat endpoint the server renders the prompts; the unbounded figure comes from its /tokenize.
    chat_api = _phases(out, "chat-chat-cached")[0]
    assert chat_api["summary"]["completed"] == 8 and chat_api["prefix_cache"]["unbounded_hit_tokens"] > 0
    run = json.loads((out / "serving-run.json").read_text())
    assert run["parts"] == json.loads((out / "throughput.json").read_text())
    combined = run["steps"]
    assert sorted(combined) == sorted(["chat-chat-cached", "chat-chat-uncached", "chat-grpc-cached",
                                       "chat-grpc-uncached", "document-grpc-cached", "document-grpc-uncached",
                                       "stall", "grpc", "http", *OVERHEAD])
    assert combined["grpc"]["phases"] == grpc

    # Alternating rounds: each front door's median over its own rounds, and HTTP's overhead against gRPC's.
    overhead = json.loads((out / "overhead.json").read_text())
    tpot = [_phases(out, name)[0]["summary"]["tpot_ms"]["p50"] for name in OVERHEAD]
    assert overhead["median_p50_ms"]["grpc"]["tpot_ms"] == (tpot[0] + tpot[2]) / 2
    assert overhead["http_overhead"]["tpot_ms"] == (
        overhead["median_p50_ms"]["http"]["tpot_ms"] / overhead["median_p50_ms"]["grpc"]["tpot_ms"] - 1)


def test_the_chat_step_runs_the_prefix_steps_first_phase_both_ways_alone(tmp_path):
    """`--steps chat`: the chat workload over gRPC without and then with prefix caching, nothing else."""
    out, steps = run_steps(tmp_path, "--steps", "chat")
    assert steps == ["make-model", "serve (plain)", "chat-grpc-uncached", "serve (prefix caching)", "chat-grpc-cached"]
    cached = _phases(out, "chat-grpc-cached")[0]
    assert cached["prefix_cache"]["hit_tokens"] > 0
    # The running server's CPU (found by its pid; its event loop's part is under a clock tick in so short a phase)
    # and the benchmark's own, per phase.
    assert cached["server_cpu_us_per_output_token"] > 0
    assert 0 <= cached["event_loop_cpu_us_per_output_token"] <= cached["server_cpu_us_per_output_token"]
    assert 0 < cached["client_cpu_fraction"] <= os.cpu_count()


def test_the_chat_http_step_runs_the_chat_endpoints_phase_both_ways_alone(tmp_path):
    """`--steps chat-http`: the chat workload over the HTTP chat endpoint without and then with prefix caching."""
    out, steps = run_steps(tmp_path, "--steps", "chat-http")
    assert steps == ["make-model", "serve (plain)", "chat-chat-uncached", "serve (prefix caching)", "chat-chat-cached"]
    assert _phases(out, "chat-chat-cached")[0]["prefix_cache"]["hit_tokens"] > 0


def test_chat_and_document_steps_run_both_grpc_workloads_with_the_serve_flags_given(tmp_path):
    """`--steps chat,document --serve-flags "..."`: the two gRPC prefix workloads without and then with caching, on
    servers started with the extra flags (the servers say so in their model info)."""
    out, steps = run_steps(tmp_path, "--steps", "document,chat", "--serve-flags",
                           "--max-num-batched-tokens 256 --max-num-seqs 4")
    assert steps == ["make-model", "serve (plain)", "chat-grpc-uncached", "document-grpc-uncached",
                     "serve (prefix caching)", "chat-grpc-cached", "document-grpc-cached"]
    for name in ("chat-grpc-uncached", "document-grpc-cached"):
        info = json.loads((out / f"serving-{name}.json").read_text())["model_info"]
        assert (info["max_num_batched_tokens"], info["max_num_seqs"]) == (256, 4)
    # The second server caches prefixes: it looked up every prompt token (whether two questions about one document
    # meet in the cache depends on how the tiny run's requests overlap in time, so hits are not asserted here).
    cached = _phases(out, "document-grpc-cached")[0]
    assert cached["prefix_cache"]["queried_tokens"] == cached["summary"]["prompt_tokens"] > 0
    assert _phases(out, "document-grpc-uncached")[0]["prefix_cache"]["queried_tokens"] == 0


def test_serve_flags_are_refused_by_a_script_that_starts_no_server_of_its_own():
    done = subprocess.run(["bash", str(ROOT / "scripts" / "two_gpu_run.sh"), "--serve-flags", "--max-num-seqs 4"],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "unknown argument --serve-flags" in done.stderr
