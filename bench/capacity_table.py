"""Print the capacity table of docs/capacity.md: Qwen3.5-4B and -9B on one H200 at 256 and 1024 running requests.

Every figure is computed by hybridkv.sizing from bytes (no GPU): the planner's reserve estimate at
gpu_memory_utilization 0.90 and 8192 batched tokens gives the budget, and the four allocators share it.

    python bench/capacity_table.py            # markdown table on stdout
    python bench/capacity_table.py --json     # the same figures as JSON
"""

from __future__ import annotations

import argparse
import json

from hybridkv.sizing import byte_model, catalog_geometry, gpu_spec, pool_models, predict_capacity

GIB = 1 << 30
MODELS = ("qwen3.5-4b", "qwen3.5-9b")
CONCURRENCY = (256, 1024)
UTILIZATION = "0.90"
REQUEST_TOKENS = 8192


def capacity_rows(gpu_name: str = "h200") -> list[dict]:
    gpu = gpu_spec(gpu_name)
    rows = []
    for name in MODELS:
        geometry = catalog_geometry(name)
        for max_num_seqs in CONCURRENCY:
            prediction = predict_capacity(geometry, 1, gpu.memory_bytes, UTILIZATION, max_num_seqs)
            pools = pool_models(byte_model(geometry), prediction.budget_bytes, max_num_seqs,
                                compute_capability=gpu.compute_capability)
            rows.append({
                "model": geometry.name,
                "max_num_seqs": max_num_seqs,
                "weights_bytes": prediction.weights_bytes,
                "reserve_bytes": prediction.reserve_bytes,
                "budget_bytes": prediction.budget_bytes,
                "allocators": {
                    key: {
                        "label": pool.label,
                        "block_size": pool.block_size,
                        "tokens_all_running": pool.token_capacity(max_num_seqs),
                        "tokens_one_running": pool.token_capacity(1),
                        "max_running_at_8192": pool.max_concurrency(REQUEST_TOKENS),
                    }
                    for key, pool in pools.items()
                },
            })
    return rows


def render_markdown(rows: list[dict]) -> str:
    lines = [
        "| model | S | budget | allocator | block | tokens, S running | tokens, 1 running | running at 8K tokens |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        for figures in row["allocators"].values():
            lines.append(
                f"| {row['model']} | {row['max_num_seqs']} | {row['budget_bytes'] / GIB:.2f} GiB | {figures['label']} "
                f"| {figures['block_size']} | {figures['tokens_all_running']:,} | {figures['tokens_one_running']:,} "
                f"| {figures['max_running_at_8192']:,} |"
            )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--gpu", default="h200")
    args = parser.parse_args()
    rows = capacity_rows(args.gpu)
    print(json.dumps(rows, indent=2) if args.json else render_markdown(rows))


if __name__ == "__main__":
    main()
