"""`hybridkv demo`: the main job on an embedded default, on any machine (no cluster, no GPU needed).

1. Plans the bundled example HybridModel (Qwen3.5-4B on an H200) with the planner.
2. Builds, once, a small random-weight Qwen3.5-shaped checkpoint (cached under $HYBRIDKV_CACHE or ~/.cache/hybridkv).
3. Plans that small model for a fixed cache budget (--kv-cache-memory), BEFORE anything starts.
4. Starts a local sidecar (`hybridkv serve` on a free loopback port) with the plan's flags, the same budget included,
   on the GPU when one is visible, streams a few Generate calls to the terminal, then runs max_num_seqs at once and
   shows their state slots and token blocks in use (GetCapacity).
5. Prints planned vs measured capacity (GetCapacity) for the same model and budget, and stops the sidecar.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from hybridkv.net import free_loopback_port

DEMO_CATALOG_MODEL = "qwen3.5-4b"
DEMO_DEVICES = ("auto", "cpu", "cuda")
DEMO_SEED = 0
DEMO_MAX_NUM_SEQS = 8
DEMO_MAX_MODEL_LEN = 1024
DEMO_MAX_NUM_BATCHED_TOKENS = 1024
DEMO_BLOCK_SIZE = 16
# The fixed cache budget, in bytes, both the prediction and the sidecar use: planned and measured compare like for like.
DEMO_KV_CACHE_MEMORY_BYTES = 48 * 1024**2
DEMO_PROMPTS = (
    "A hybrid language model mixes two kinds of layers.",
    "The token pool is split into blocks of sixteen tokens",
    "Capacity is counted in tokens for the first pool and in requests for the second.",
)
DEMO_MAX_TOKENS = 32
DEMO_BURST_TOKENS = 16
SIDECAR_READY_TIMEOUT_S = 150.0
SIDECAR_STOP_TIMEOUT_S = 15.0


class DemoError(Exception):
    """A demo step failed; the message says which and why."""


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "demo",
        help="plan, build a small model, serve it locally and compare planned vs measured capacity",
        description=__doc__.split("\n\n")[1] if __doc__ else None,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--device", default="auto", choices=DEMO_DEVICES,
                        help="auto (GPU when visible), cpu or cuda (default %(default)s)")
    parser.add_argument("--cache-dir", default=None,
                        help="where the small checkpoint is built once (default $HYBRIDKV_CACHE or ~/.cache/hybridkv)")
    parser.set_defaults(handler=_run_demo, extra="engine")


def cache_dir(override: str | None = None) -> Path:
    return Path(override or os.environ.get("HYBRIDKV_CACHE") or Path.home() / ".cache" / "hybridkv")


class _Progress:
    def __init__(self, total_steps: int):
        self._total = total_steps
        self._step = 0
        self._started_s = time.monotonic()

    def step(self, text: str) -> None:
        self._step += 1
        print(f"\n[{self._step}/{self._total}] {text}", flush=True)

    def note(self, text: str) -> None:
        print(f"      {text}", flush=True)

    def elapsed_s(self) -> float:
        return time.monotonic() - self._started_s


def _run_demo(args: argparse.Namespace) -> int:
    progress = _Progress(total_steps=6)
    print(f"hybridkv demo: plan the example -> build a small model -> plan it -> serve -> generate -> compare "
          f"(device {args.device})")
    try:
        _plan_example(progress)
        model_dir = _build_small_model(progress, cache_dir(args.cache_dir))
        small_plan = _plan_small_model(progress, model_dir)
        with _Sidecar(model_dir, small_plan, args.device, progress) as sidecar:
            _stream_generations(progress, sidecar.target)
            _fill_the_state_pool(progress, sidecar.target, small_plan.max_num_seqs)
            measured = sidecar.capacity()
        _compare(progress, small_plan, measured)
    except DemoError as exc:
        print(f"\nhybridkv demo: failed: {exc}", file=sys.stderr)
        return 1
    print(f"\ndone in {progress.elapsed_s():.1f} s")
    return 0


# ------------------------------------------------------------------------------------------------------------ steps


def _plan_example(progress: _Progress) -> None:
    from hybridkv.errors import UserError
    from hybridkv.sizing.cli import default_spec_path
    from hybridkv.sizing.planner import plan
    from hybridkv.sizing.report import render_plan
    from hybridkv.sizing.spec import load_hybridmodel_file

    path = default_spec_path()
    progress.step(f"Planning the bundled example HybridModel {path.name} (also examples/{path.name})")
    try:
        rendered = render_plan(plan(load_hybridmodel_file(path)))
    except (OSError, UserError) as exc:
        raise DemoError(f"planning {path.name}: {exc}") from exc
    for line in rendered.rstrip().splitlines():
        progress.note(line)


def _build_small_model(progress: _Progress, root: Path) -> Path:
    from hybridkv import __version__

    model_dir = root / "demo" / f"{DEMO_CATALOG_MODEL}-small-seed{DEMO_SEED}-v{__version__}"
    progress.step(f"Small random-weight {DEMO_CATALOG_MODEL}-shaped checkpoint")
    if (model_dir / "config.json").is_file():
        progress.note(f"cached: {model_dir}")
        return model_dir
    import tempfile

    from hybridkv.sidecar.random_checkpoint import make_model
    from hybridkv.sizing import catalog_geometry

    progress.note(f"building once into {model_dir} ...")
    try:
        model_dir.parent.mkdir(parents=True, exist_ok=True)
        # Built aside and renamed into place, so an interrupted build never leaves a half-written cache entry.
        with tempfile.TemporaryDirectory(dir=model_dir.parent, prefix=".building-") as scratch:
            built = make_model(Path(scratch) / "model", catalog_geometry(DEMO_CATALOG_MODEL), DEMO_SEED, tiny=True)
            os.replace(built, model_dir)
    except OSError as exc:
        raise DemoError(f"cannot write the demo checkpoint under {root}: {exc}; set HYBRIDKV_CACHE to a "
                        "writable folder") from exc
    size_mib = sum(path.stat().st_size for path in model_dir.iterdir()) / 1024**2
    progress.note(f"built {model_dir.name} ({size_mib:.1f} MiB)")
    return model_dir


def _plan_small_model(progress: _Progress, model_dir: Path):
    """Plans the small model through the same parser and planner as the example, with the fixed cache budget."""
    import json

    from hybridkv.errors import UserError
    from hybridkv.sizing.planner import plan
    from hybridkv.sizing.spec import API_VERSION, KIND, parse_hybridmodel

    host_memory_mib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 1024**2
    progress.step(f"Planning the small model for a fixed {DEMO_KV_CACHE_MEMORY_BYTES / 1024**2:.0f} MiB cache budget "
                  f"({DEMO_MAX_NUM_SEQS} running requests of up to {DEMO_MAX_MODEL_LEN} tokens), before it starts")
    resource = {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "metadata": {"name": "demo-small"},
        "spec": {
            "model": {"name": model_dir.name, "config": json.loads((model_dir / "config.json").read_text())},
            "serving": {"maxModelLen": DEMO_MAX_MODEL_LEN, "maxConcurrency": DEMO_MAX_NUM_SEQS},
            # The budget is fixed, so the memory the plan assumes (this machine's) does not change the pools.
            "gpu": {"memoryMiB": host_memory_mib, "maxPerReplica": 1},
        },
    }
    try:
        small_plan = plan(parse_hybridmodel(resource, require_source=False),
                          kv_cache_memory_bytes=DEMO_KV_CACHE_MEMORY_BYTES,
                          max_num_batched_tokens=DEMO_MAX_NUM_BATCHED_TOKENS, block_size=DEMO_BLOCK_SIZE)
    except UserError as exc:
        raise DemoError(f"planning the small model: {exc}") from exc
    geometry, layout = small_plan.geometry, small_plan.layout
    progress.note(f"{geometry.num_hidden_layers} layers ({geometry.num_linear_attention_layers} Gated DeltaNet, "
                  f"{geometry.num_full_attention_layers} full attention): {layout.bytes_per_token:,} B per token, "
                  f"{layout.bytes_per_request:,} B of state per request")
    progress.note(f"planned: {layout.state_slots} state slots, {layout.token_blocks:,} token blocks "
                  f"= {layout.token_capacity:,} tokens")
    return small_plan


def _stream_generations(progress: _Progress, target: str) -> None:
    import grpc

    from hybridkv.api.client import FINISH_REASON_NAMES, GenerationClient

    progress.step(f"Streaming {len(DEMO_PROMPTS)} Generate calls (greedy, up to {DEMO_MAX_TOKENS} tokens; "
                  "random weights, so the text is noise), then a full batch at once")
    with GenerationClient(target) as client:
        for prompt in DEMO_PROMPTS:
            print(f"      > {prompt}\n      < ", end="", flush=True)
            started_s = time.perf_counter()
            first_token_s = None
            last = None
            try:
                for response in client.generate(prompt, max_tokens=DEMO_MAX_TOKENS, temperature=0.0,
                                                timeout_s=SIDECAR_READY_TIMEOUT_S):
                    if first_token_s is None and response.token_ids:
                        first_token_s = time.perf_counter() - started_s
                    print(response.text.replace("\n", " "), end="", flush=True)
                    last = response
            except grpc.RpcError as exc:
                raise DemoError(f"Generate failed: {exc.code().name}: {exc.details()}") from exc
            elapsed_s = time.perf_counter() - started_s
            print(flush=True)
            progress.note(f"  [{last.usage.completion_tokens} tokens, {FINISH_REASON_NAMES[last.finish_reason]}, "
                          f"first token {1000 * (first_token_s or elapsed_s):.0f} ms, "
                          f"{last.usage.completion_tokens / elapsed_s:.0f} tokens/s]")


def _fill_the_state_pool(progress: _Progress, target: str, max_num_seqs: int) -> None:
    """Runs max_num_seqs streams at once and shows, through GetCapacity, one state slot per running request."""
    import asyncio

    import grpc

    from hybridkv.api.client import AsyncGenerationClient

    async def run() -> tuple[dict, dict]:
        async with AsyncGenerationClient(target) as client:
            calls = [client.generate(prompt, max_tokens=DEMO_BURST_TOKENS, temperature=0.0, ignore_eos=True)
                     for prompt in (DEMO_PROMPTS * max_num_seqs)[:max_num_seqs]]
            # Read each stream's first token: every request has then been admitted and holds its slot.
            streams = [call.__aiter__() for call in calls]
            await asyncio.gather(*(stream.__anext__() for stream in streams))
            busiest = (await client.get_capacity())["usage"]
            for stream in streams:
                async for _ in stream:
                    pass
            return busiest, (await client.get_capacity())["usage"]

    try:
        busiest, after = asyncio.run(run())
    except grpc.RpcError as exc:
        raise DemoError(f"concurrent Generate failed: {exc.code().name}: {exc.details()}") from exc
    progress.note(f"{max_num_seqs} streams at once: {busiest['running']} running, {busiest['used_state_slots']} of "
                  f"{max_num_seqs} state slots and {busiest['used_token_blocks']} token blocks in use; when they "
                  f"finished: {after['used_state_slots']} slots, {after['used_token_blocks']} blocks")


def _compare(progress: _Progress, small_plan, measured: dict) -> None:
    progress.step("Planned (before start) vs measured (engine, GetCapacity) for the same model and budget")
    layout = small_plan.layout
    planned = {
        "budget_bytes": small_plan.prediction.budget_bytes,
        "state_slots": layout.state_slots,
        "state_pool_bytes": layout.state_pool_bytes,
        "token_blocks": layout.token_blocks,
        "token_capacity": layout.token_capacity,
        "token_pool_bytes": layout.token_pool_bytes,
    }
    progress.note(f"{'':18} {'planned':>14} {'measured':>14}  match")
    mismatches = []
    for key, planned_value in planned.items():
        same = planned_value == measured[key]
        mismatches += [] if same else [key]
        progress.note(f"{key:18} {planned_value:>14,} {measured[key]:>14,}  {'yes' if same else 'NO'}")
    progress.note("state_slots = usable request-constant slots (= max_num_seqs; null slot extra); token_blocks = "
                  "usable blocks (null block extra); pool bytes are allocated, null included")
    if mismatches:
        raise DemoError(f"measured capacity differs from the plan in {', '.join(mismatches)}")


class _Sidecar:
    """`hybridkv serve` in a subprocess on free loopback ports; always stopped on exit (SIGTERM, then kill)."""

    def __init__(self, model_dir: Path, small_plan, device: str, progress: _Progress):
        self._model_dir = model_dir
        self._plan = small_plan
        self._device = device
        self._progress = progress
        self._process = None
        self._log_path = model_dir.parent / "sidecar.log"
        self.target = ""

    def __enter__(self) -> _Sidecar:
        import subprocess

        port = free_loopback_port()
        self.target = f"127.0.0.1:{port}"
        small_plan = self._plan
        # The plan's settings become the sidecar's flags, as the operator does in a pod.
        plan_flags = [
            "--tensor-parallel-size", str(small_plan.tensor_parallel_size),
            "--gpu-memory-utilization", str(small_plan.gpu_memory_utilization),
            "--max-num-seqs", str(small_plan.max_num_seqs),
            "--max-model-len", str(small_plan.max_model_len),
            "--block-size", str(small_plan.layout.block_size),
            "--kv-cache-memory", str(small_plan.kv_cache_memory_bytes),
            "--max-num-batched-tokens", str(small_plan.max_num_batched_tokens),
        ]
        command = [
            sys.executable, "-P", "-m", "hybridkv", "serve", "--model", str(self._model_dir), *plan_flags,
            "--device", self._device, "--host", "127.0.0.1", "--port", str(port), "--metrics-port", "0",
            "--grace-period-s", "5",
        ]
        self._progress.step(f"Starting a local sidecar with the plan's flags (log: {self._log_path})")
        self._progress.note(f"hybridkv serve --model {self._model_dir.name} {' '.join(plan_flags)} "
                            f"--device {self._device} --port {port}")
        log_file = open(self._log_path, "w")  # noqa: SIM115 - the subprocess writes to it for its whole life
        try:
            self._process = subprocess.Popen(command, stdout=log_file, stderr=subprocess.STDOUT,
                                             stdin=subprocess.DEVNULL)
        finally:
            log_file.close()
        try:
            self._wait_ready()
        except BaseException:
            self._stop()
            raise
        return self

    def __exit__(self, *exc_info) -> None:
        self._stop()

    def _log_tail(self, lines: int = 15) -> str:
        try:
            return "\n".join(self._log_path.read_text().splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def _wait_ready(self) -> None:
        import grpc

        from hybridkv.api.client import READINESS_SERVICE, GenerationClient

        deadline_s = time.monotonic() + SIDECAR_READY_TIMEOUT_S
        started_s = time.monotonic()
        last_note_s = started_s
        with GenerationClient(self.target) as client:
            while True:
                if self._process.poll() is not None:
                    raise DemoError(f"the sidecar exited with code {self._process.returncode} while starting:\n"
                                    f"{self._log_tail()}")
                try:
                    if client.check_health(READINESS_SERVICE, timeout_s=1.0) == "SERVING":
                        break
                except grpc.RpcError:
                    pass  # not listening yet
                now_s = time.monotonic()
                if now_s > deadline_s:
                    raise DemoError(f"the sidecar was not ready within {SIDECAR_READY_TIMEOUT_S:.0f} s:\n"
                                    f"{self._log_tail()}")
                if now_s - last_note_s >= 5.0:
                    self._progress.note(f"loading weights and measuring the pools ... {now_s - started_s:.0f} s")
                    last_note_s = now_s
                time.sleep(0.2)
            info = client.get_model_info()
        self._progress.note(f"ready after {time.monotonic() - started_s:.1f} s: {info['name']} on {info['device']}, "
                            f"max_model_len {info['max_model_len']}")

    def capacity(self) -> dict:
        import grpc

        from hybridkv.api.client import GenerationClient

        with GenerationClient(self.target) as client:
            try:
                return client.get_capacity()
            except grpc.RpcError as exc:
                raise DemoError(f"GetCapacity failed: {exc.code().name}: {exc.details()}") from exc

    def _stop(self) -> None:
        import subprocess

        if self._process is None or self._process.poll() is not None:
            return
        self._process.terminate()
        try:
            self._process.wait(timeout=SIDECAR_STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()
        self._progress.note(f"sidecar stopped (exit code {self._process.returncode})")
