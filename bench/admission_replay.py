"""The serving workload replayed through the engine's own scheduler on a model of its step times, once per TPOT target:
what `--target-tpot-ms` trades (time per output token against time to first token and throughput), read before a
GPU serves it.

The scheduler is `hybridkv.sidecar.core.scheduler.Scheduler` over a CacheManager on the CPU, with the hold for
fuller mixed steps that `hybridkv serve` uses on a GPU (1,024 prompt tokens with prefix caching on, its default;
4,096 with it off); only its bookkeeping runs, and its clock is the model's. A step costs the decode step time of its
decoding batch (interpolated between the measured batch sizes of a `bench/throughput.py` result, `--parts`, or of
`--decode-step-ms`) and, where it runs prefill, `--mixed-step-ms` more plus its prompt tokens at the prefill rate
(`bench/mixed_steps.py` measures both). Closed-loop clients send the reference workload of `bench/serving.py` (the
same seeded lengths); TPOT is a request's time from its first token to its last over its other tokens, as there.

These are a model's figures, not measurements: `bench/serving.py` measures the served path, host work and all. The
defaults are Qwen3.5-4B's on one H200 (decode steps 2026-12-06, the mixed-step cost and prefill rate of the
piecewise mixed steps of 2026-12-04; docs/performance.md).

    python bench/throughput.py --load-format random --batch-sizes 1,16,64,256 --hf-batch-sizes= --out parts.json
    python bench/admission_replay.py --parts parts.json --concurrency 256 --targets 0,18,20,25 --out replay.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import serving  # noqa: E402

from hybridkv.errors import UserError  # noqa: E402
from hybridkv.sidecar.core.config import (DEFAULT_MAX_PREFILL_WAIT_STEPS,  # noqa: E402
                                          DEFAULT_MIN_PREFILL_TOKENS_WITH_DECODES,
                                          DEFAULT_MIN_PREFILL_TOKENS_WITH_DECODES_CACHED)

DEFAULT_DECODE_STEPS = "1:3.06,16:3.94,64:5.60,256:13.47"
DEFAULT_PREFILL_TOK_S = 65000.0


class ReplayError(UserError):
    pass


def parse_decode_steps(text: str) -> list[tuple[int, float]]:
    """`B:MS,...` -> [(batch, ms)] sorted by batch: at least one point, batches and times positive. Between them a
    step's time is interpolated (`serving.Parts`), and past either end it is the end's."""
    points = []
    for item in text.split(","):
        batch, _, ms = item.partition(":")
        try:
            point = (int(batch), float(ms))
        except ValueError:
            raise ReplayError(f"--decode-step-ms takes BATCH:MS pairs, comma-separated; got {item!r}") from None
        if point[0] < 1 or not 0 < point[1] < 1e6:
            raise ReplayError(f"--decode-step-ms: a batch of at least 1 and a time in (0, 1e6) ms; got {item!r}")
        points.append(point)
    points.sort()
    if len({batch for batch, _ in points}) != len(points):
        raise ReplayError("--decode-step-ms names a batch size twice")
    return points


class ModelClock:
    """The scheduler's clock: the replay advances it by each step's modelled cost."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def replay(lengths: list[tuple[int, int]], concurrency: int, target_tpot_ms: float, parts: serving.Parts,
           mixed_step_ms: float, max_num_seqs: int, max_num_batched_tokens: int,
           min_prefill_tokens: int, max_prefill_wait_steps: int) -> dict:
    """Replay the (prompt, output) `lengths` with `concurrency` closed-loop clients; the phase's summary."""
    import torch

    from hybridkv.sidecar.core.cache import CacheManager
    from hybridkv.sidecar.core.sampling import SamplingParams
    from hybridkv.sidecar.core.scheduler import Scheduler
    from hybridkv.sidecar.core.sequence import Sequence
    from hybridkv.sizing import PoolShapes

    shapes = PoolShapes(num_full_attention_layers=1, num_linear_attention_layers=1, kv_token_shape=(1, 1),
                        conv_slot_shape=(1, 1), ssm_slot_shape=(1, 1, 1), kv_dtype="float32", conv_dtype="float32",
                        ssm_dtype="float32")
    block_size = 16
    longest = max(prompt + output for prompt, output in lengths)
    blocks = max_num_seqs * (-(-longest // block_size) + 1)
    cache = CacheManager(blocks, max_num_seqs, block_size, shapes, torch.device("cpu"))
    clock = ModelClock()
    scheduler = Scheduler(cache, max_num_seqs, max_num_batched_tokens, longest + 1, None, min_prefill_tokens,
                          max_prefill_wait_steps, target_tpot_ms / 1000, clock)
    issued = 0
    sent: dict[str, float] = {}
    first: dict[str, float] = {}
    records = []
    decode_batches = []

    def issue():
        nonlocal issued
        prompt, output = lengths[issued]
        request_id = f"r{issued}"
        scheduler.add(Sequence(request_id, list(range(1, prompt + 1)), SamplingParams(max_tokens=output)))
        sent[request_id] = clock.now
        issued += 1

    while issued < min(concurrency, len(lengths)):
        issue()
    while scheduler.has_unfinished():
        chunks = scheduler.schedule()
        decodes = sum(1 for chunk in chunks if chunk.num_tokens == 1)
        prefill = sum(chunk.num_tokens for chunk in chunks if chunk.num_tokens > 1)
        clock.now += parts.decode_step_ms(decodes) / 1000 if decodes else 0.0
        if prefill:
            clock.now += mixed_step_ms / 1000 + prefill / parts.prefill_tokens_per_s
        if decodes:
            decode_batches.append(decodes)
        sampled = [chunk.seq for chunk in chunks if chunk.samples]  # read before the launch counts the tokens
        scheduler.launched(chunks)
        for seq in sampled:
            seq.num_pending_tokens += 1
            first.setdefault(seq.request_id, clock.now)
        reasons = scheduler.postprocess(sampled, [7] * len(sampled), [False] * len(sampled))
        for seq, reason in zip(sampled, reasons):
            if reason is None:
                continue
            start, first_s = sent[seq.request_id], first[seq.request_id]
            out = len(seq.token_ids) - seq.num_prompt_tokens
            records.append((first_s - start, (clock.now - first_s) / max(out - 1, 1), seq.num_prompt_tokens + out))
            if issued < len(lengths):
                issue()
    ttft = [record[0] for record in records]
    tpot = [record[1] for record in records]
    return {
        "target_tpot_ms": target_tpot_ms or None,
        "concurrency": concurrency,
        "requests": len(records),
        "wall_s": clock.now,
        "total_tok_s": sum(record[2] for record in records) / clock.now,
        "ttft_ms": serving.distribution(ttft),
        "tpot_ms": serving.distribution(tpot),
        "tpot_held_steps": scheduler.tpot_held_steps_total,
        "prefill_held_steps": scheduler.held_steps_total,
        "mean_decode_batch": sum(decode_batches) / max(len(decode_batches), 1),
    }


def build_parts(args: argparse.Namespace) -> serving.Parts:
    """The step costs: --parts' rows, each flag over them; without --parts, the flags or the H200's defaults."""
    steps = None if args.decode_step_ms is None else parse_decode_steps(args.decode_step_ms)
    if args.prefill_tok_s is not None and not 0 < args.prefill_tok_s < 1e9:
        raise ReplayError(f"--prefill-tok-s must be positive, got {args.prefill_tok_s:g}")
    if args.parts is not None:
        parts = serving.load_parts(Path(args.parts), args.prefill_tok_s, None)
        if steps is None:
            return parts
        return serving.Parts(parts.prefill_tokens_per_s, tuple(steps), f"{parts.source} and --decode-step-ms")
    return serving.Parts(DEFAULT_PREFILL_TOK_S if args.prefill_tok_s is None else args.prefill_tok_s,
                         tuple(steps or parse_decode_steps(DEFAULT_DECODE_STEPS)), "flags")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--concurrency", default="256", help="closed-loop clients, comma-separated")
    parser.add_argument("--targets", default="0,18,20,25", help="TPOT targets in ms, comma-separated (0: off)")
    parser.add_argument("--requests", type=int, default=512)
    parser.add_argument("--seed", type=int, default=3)
    parser.add_argument("--parts", metavar="FILE",
                        help="a bench/throughput.py result: its decode step times by batch and its prefill rate")
    parser.add_argument("--decode-step-ms", default=None, metavar="B:MS,...",
                        help="decode step times by batch size, over --parts' (default without --parts: "
                             f"{DEFAULT_DECODE_STEPS}, Qwen3.5-4B on one H200)")
    parser.add_argument("--mixed-step-ms", type=float, default=15.0,
                        help="what a step with prefill costs beyond its decodes and its tokens (default %(default)s)")
    parser.add_argument("--prefill-tok-s", type=float, default=None,
                        help=f"prefill rate, over --parts' (default without --parts: {DEFAULT_PREFILL_TOK_S:g})")
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--min-prefill-tokens-with-decodes", type=int,
                        default=DEFAULT_MIN_PREFILL_TOKENS_WITH_DECODES_CACHED,
                        help="the server's hold (default %(default)s, `hybridkv serve`'s with prefix caching on; "
                             f"{DEFAULT_MIN_PREFILL_TOKENS_WITH_DECODES} with it off)")
    parser.add_argument("--max-prefill-wait-steps", type=int, default=DEFAULT_MAX_PREFILL_WAIT_STEPS)
    parser.add_argument("--out", default="admission_replay.json")
    return parser


def _list(text: str, kind: type, flag: str, low: float) -> list:
    try:
        values = [kind(item) for item in text.split(",")]
    except ValueError:
        raise ReplayError(f"{flag} takes comma-separated numbers, got {text!r}") from None
    if any(not low <= value < 1e6 for value in values):
        raise ReplayError(f"{flag}: every value must be in [{low}, 1e6), got {text!r}")
    return values


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        concurrencies = _list(args.concurrency, int, "--concurrency", 1)
        targets = _list(args.targets, float, "--targets", 0)
        parts = build_parts(args)
        if not 1 <= args.requests <= 100_000 or args.mixed_step_ms < 0:
            raise ReplayError("--requests must be in [1, 100000] and --mixed-step-ms at least 0")
        if not 1 <= args.max_num_seqs <= args.max_num_batched_tokens:
            raise ReplayError("--max-num-seqs must be positive and at most --max-num-batched-tokens")
    except UserError as exc:
        print(f"admission_replay: error: {exc}", file=sys.stderr)
        return 2
    workload = serving.random_workload(args.requests, serving.Lengths(), 1000, args.seed)
    lengths = [(len(turn.message_ids), turn.output_tokens) for conversation in workload for turn in conversation.turns]
    rows = [replay(lengths, concurrency, target, parts, args.mixed_step_ms, args.max_num_seqs,
                   args.max_num_batched_tokens, args.min_prefill_tokens_with_decodes, args.max_prefill_wait_steps)
            for concurrency in concurrencies for target in targets]
    print("| concurrency | TPOT target (ms) | total tok/s | TTFT p50 / p99 (ms) | TPOT p50 / p99 (ms) | mean decode batch "
          "| steps held for the target |")
    print("|---:|---:|---:|---|---|---:|---:|")
    for row in rows:
        print(f"| {row['concurrency']} | {row['target_tpot_ms'] or 'off'} | {row['total_tok_s']:,.0f} | "
              f"{row['ttft_ms']['p50']:,.0f} / {row['ttft_ms']['p99']:,.0f} | "
              f"{row['tpot_ms']['p50']:.1f} / {row['tpot_ms']['p99']:.1f} | {row['mean_decode_batch']:.0f} | "
              f"{row['tpot_held_steps']:,} |")
    settings = {key: value for key, value in vars(args).items() if key != "out"}
    settings["parts"] = {"source": parts.source, "prefill_tokens_per_s": parts.prefill_tokens_per_s,
                         "decode_step_ms_by_batch": parts.decode_step_ms_by_batch}
    with open(args.out, "w") as handle:
        json.dump({"settings": settings, "rows": rows}, handle, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
