"""Fit the planner's reserve estimate on measured engine start-ups and report its prediction error per run.

The reserve is what an engine holds besides weights and cache (activations of the profile step, sampler, CUDA graphs,
CUDA context). `hybridkv.sizing.prediction` estimates it per rank as

    reserve = fixed + activation × (max_num_batched_tokens + G) × (hidden_size + widest_projection_per_rank)
            + unfitted

where `unfitted` is the sampler term, the piecewise graphs' arenas and, past one GPU, NCCL buffers, and G the
largest step the run replayed piecewise (0 for runs recorded before piecewise graphs, or without them). This
script fits `fixed` and `activation` by least squares on the start-ups it is given, writes them to
sizing/data/reserve.json (with --write), and prints for every run the measured and estimated reserve and, where the
run recorded its pools, the token capacity the plan predicts on the memory that run saw against the capacity it
measured. Runs named with --check, and every run of a --held-out file, are not fitted on, so their error is an honest
test of the estimate. Re-run it whenever something changes the reserve (CUDA graph sizes, MoE workspaces, a
checkpoint pool, the sampler) with the new start-ups.

Input: JSON files with `{"startups": [...]}`; each start-up is either a record
`{model, tensor_parallel_size, max_num_seqs, max_num_batched_tokens, reserve_bytes}` or `{"record": FILE}` naming a
`bench/throughput.py` result (read from `engine.model_info`, `engine.memory` and `capacity.report`).

    python bench/calibrate_reserve.py bench/results/startups-2026-11-29.json --check qwen3.5-4b
    python bench/calibrate_reserve.py bench/results/startups-2026-11-29.json --check qwen3.5-4b --write
    python bench/calibrate_reserve.py bench/results/startups-2026-11-29.json --check qwen3.5-4b \
        --held-out bench/results/startups-2026-12-06-h100.json --held-out bench/results/startups-2026-12-07-h100.json
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from decimal import ROUND_HALF_EVEN, Decimal
from pathlib import Path

from hybridkv.errors import UserError
from hybridkv.sizing import byte_model, catalog_geometry, dual_pool_layout
from hybridkv.sizing.prediction import (
    ReserveCalibration,
    estimate_reserve_bytes,
    piecewise_reserve_terms,
    requested_memory_bytes,
    reserve_activation_elements,
    reserve_unfitted_bytes,
)

ROOT = Path(__file__).resolve().parent.parent
RESERVE_JSON = ROOT / "sizing" / "data" / "reserve.json"
# Bytes per element are kept to this many decimals in reserve.json.
ACTIVATION_DECIMALS = Decimal("0.0001")


@dataclass(frozen=True)
class Startup:
    model: str
    tensor_parallel_size: int
    max_num_seqs: int
    max_num_batched_tokens: int
    reserve_bytes: int
    source: str
    # Present when the run recorded its memory and pools: the capacity check needs them.
    total_memory_bytes: int | None = None
    gpu_memory_utilization: str | None = None
    weights_bytes: int | None = None
    token_capacity: int | None = None
    block_size: int | None = None
    piecewise_tokens: int = 0  # the largest step replayed piecewise (0: none, as before piecewise graphs)


def _from_throughput_record(path: Path) -> Startup:
    data = json.loads(path.read_text())
    info, memory, report = data["engine"]["model_info"], data["engine"]["memory"], data["capacity"]["report"]
    requested = report["budget_bytes"] + report["weights_bytes"] + report["reserve_bytes"]
    utilization = Decimal(requested) / Decimal(memory["total_memory_bytes"])
    return Startup(
        model=data["model"],
        tensor_parallel_size=info["tensor_parallel_size"],
        max_num_seqs=info["max_num_seqs"],
        max_num_batched_tokens=info["max_num_batched_tokens"],
        reserve_bytes=report["reserve_bytes"],
        source=path.name,
        total_memory_bytes=memory["total_memory_bytes"],
        gpu_memory_utilization=str(utilization.quantize(Decimal("0.01"))),
        weights_bytes=report["weights_bytes"],
        token_capacity=report["token_capacity"],
        block_size=report["block_size"],
        piecewise_tokens=info.get("piecewise_cuda_graph_max_tokens", 0),
    )


def read_startups(paths: list[Path]) -> list[Startup]:
    startups = []
    for path in paths:
        for item in json.loads(path.read_text())["startups"]:
            if "record" in item:
                startups.append(_from_throughput_record(path.parent / item["record"]))
                continue
            startups.append(Startup(
                model=item["model"],
                tensor_parallel_size=item["tensor_parallel_size"],
                max_num_seqs=item["max_num_seqs"],
                max_num_batched_tokens=item["max_num_batched_tokens"],
                reserve_bytes=item["reserve_bytes"],
                source=path.name,
                piecewise_tokens=item.get("piecewise_tokens", 0),
            ))
    return startups


def _features(run: Startup) -> tuple[int, int]:
    """(activation elements, reserve minus the unfitted terms) of one run."""
    geometry = catalog_geometry(run.model)
    tp = run.tensor_parallel_size
    elements = reserve_activation_elements(geometry, tp, run.max_num_batched_tokens)
    unfitted = reserve_unfitted_bytes(geometry, tp, run.max_num_batched_tokens, run.max_num_seqs)
    piece_elements, arenas = piecewise_reserve_terms(geometry, tp, run.piecewise_tokens)
    return elements + piece_elements, run.reserve_bytes - unfitted - arenas


def fit(runs: list[Startup]) -> ReserveCalibration:
    """Least squares of reserve − unfitted = fixed + activation × elements over `runs`."""
    points = [_features(run) for run in runs]
    xs = [Decimal(x) for x, _ in points]
    ys = [Decimal(y) for _, y in points]
    if len(set(xs)) < 2:
        raise UserError("the fit needs start-ups of at least two geometries or batched-token budgets")
    n = Decimal(len(points))
    mean_x, mean_y = sum(xs) / n, sum(ys) / n
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys)) / sum((x - mean_x) ** 2 for x in xs)
    slope = slope.quantize(ACTIVATION_DECIMALS, rounding=ROUND_HALF_EVEN)
    fixed = int((mean_y - slope * mean_x).to_integral_value(rounding=ROUND_HALF_EVEN))
    return ReserveCalibration(fixed_bytes=fixed, activation_bytes_per_element=slope,
                              fitted_on=tuple(run.model for run in runs))


def predicted_capacity(run: Startup, calibration: ReserveCalibration) -> int | None:
    """The dual pool's token capacity the estimate predicts on the memory this run saw (None without a record)."""
    if run.total_memory_bytes is None:
        return None
    geometry = catalog_geometry(run.model)
    reserve = estimate_reserve_bytes(geometry, run.tensor_parallel_size, run.max_num_batched_tokens,
                                     run.max_num_seqs, calibration, run.piecewise_tokens)
    requested = requested_memory_bytes(run.total_memory_bytes, run.gpu_memory_utilization)
    budget = requested - run.weights_bytes - reserve
    rank = byte_model(geometry, run.tensor_parallel_size)
    return dual_pool_layout(rank, budget, run.max_num_seqs, run.block_size).token_capacity


def report_rows(runs: list[Startup], calibration: ReserveCalibration, fitted: list[Startup]) -> list[dict]:
    """A row per run: its reserve and capacity measured and estimated, and whether it is one of the `fitted` runs."""
    rows = []
    for run in runs:
        geometry = catalog_geometry(run.model)
        estimate = estimate_reserve_bytes(geometry, run.tensor_parallel_size, run.max_num_batched_tokens,
                                          run.max_num_seqs, calibration, run.piecewise_tokens)
        capacity = predicted_capacity(run, calibration)
        rows.append({
            "model": run.model,
            "tensor_parallel_size": run.tensor_parallel_size,
            "max_num_seqs": run.max_num_seqs,
            "max_num_batched_tokens": run.max_num_batched_tokens,
            "role": "fit" if any(run is other for other in fitted) else "check",
            "measured_reserve_bytes": run.reserve_bytes,
            "estimated_reserve_bytes": estimate,
            "reserve_error_bytes": estimate - run.reserve_bytes,
            "measured_token_capacity": run.token_capacity,
            "predicted_token_capacity": capacity,
            "capacity_error": None if capacity is None else round(capacity / run.token_capacity - 1, 6),
            "source": run.source,
        })
    return rows


def render(rows: list[dict]) -> str:
    lines = [
        "| model | tp | S | batched | role | measured reserve | estimate | error | predicted / measured tokens |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        capacity = "—" if row["capacity_error"] is None else (
            f"{row['predicted_token_capacity']:,} / {row['measured_token_capacity']:,} "
            f"({row['capacity_error']:+.2%})"
        )
        lines.append(
            f"| {row['model']} | {row['tensor_parallel_size']} | {row['max_num_seqs']} | "
            f"{row['max_num_batched_tokens']} | {row['role']} | {row['measured_reserve_bytes'] / 1e9:.2f} GB | "
            f"{row['estimated_reserve_bytes'] / 1e9:.2f} GB | {row['reserve_error_bytes'] / 1e9:+.2f} GB | "
            f"{capacity} |"
        )
    return "\n".join(lines)


def calibration_json(calibration: ReserveCalibration, fitted: list[Startup]) -> dict:
    return {
        "description": "Fitted terms of the planner's reserve estimate (hybridkv.sizing.prediction); written by "
        "bench/calibrate_reserve.py from the start-ups listed in fitted_on.",
        "fixed_bytes": calibration.fixed_bytes,
        "activation_bytes_per_element": str(calibration.activation_bytes_per_element),
        "fitted_on": [
            {"model": run.model, "tensor_parallel_size": run.tensor_parallel_size, "max_num_seqs": run.max_num_seqs,
             "max_num_batched_tokens": run.max_num_batched_tokens, "reserve_bytes": run.reserve_bytes,
             "source": run.source}
            for run in fitted
        ],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("startups", nargs="+", type=Path, help="JSON files of measured start-ups")
    parser.add_argument("--check", action="append", default=[], metavar="MODEL",
                        help="a model to leave out of the fit and check the estimate on (repeatable)")
    parser.add_argument("--held-out", action="append", default=[], type=Path, metavar="FILE",
                        help="a JSON file of start-ups to check the estimate on, none of them fitted (repeatable)")
    parser.add_argument("--write", action="store_true", help=f"write the fit to {RESERVE_JSON.relative_to(ROOT)}")
    parser.add_argument("--json", action="store_true", help="print the per-run rows as JSON")
    args = parser.parse_args()
    try:
        fitted_from = read_startups(args.startups)
        held_out = read_startups(args.held_out) if args.held_out else []
        fitted = [run for run in fitted_from if run.model not in args.check]
        calibration = fit(fitted)
    except UserError as exc:
        parser.exit(2, f"calibrate_reserve.py: {exc}\n")
    rows = report_rows(fitted_from + held_out, calibration, fitted)
    print(json.dumps({"calibration": calibration_json(calibration, fitted), "runs": rows}, indent=2) if args.json
          else f"fixed {calibration.fixed_bytes:,} B, activation {calibration.activation_bytes_per_element} B per "
               f"element\n\n{render(rows)}")
    if args.write:
        RESERVE_JSON.write_text(json.dumps(calibration_json(calibration, fitted), indent=1) + "\n")


if __name__ == "__main__":
    main()
