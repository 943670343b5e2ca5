"""Print docs/capacity.md's prefix-caching comparison: the multi-turn trace on Qwen3.5-4B on one H200, per allocator.

The plan is `hybridkv plan`'s default for the bundled HybridModel (Qwen3.5-4B, one H200); the trace is the seeded
multi-turn workload (64 chats of 4 turns on a shared 2048-token system prompt); no GPU.

    python bench/prefix_table.py            # markdown table on stdout
    python bench/prefix_table.py --json     # the same figures as JSON
"""

from __future__ import annotations

import argparse
import json

from hybridkv.sizing import default_checkpoint_slots, parse_hybridmodel, plan
from hybridkv.sizing.cli import default_spec_path, prefix_table
from hybridkv.sizing.prefix import multi_turn_workload, prefix_cache_models, replay_prefix_all
from hybridkv.sizing.spec import read_hybridmodel_file

SEED = 0


def prefix_results() -> dict:
    planned = plan(parse_hybridmodel(read_hybridmodel_file(default_spec_path())))
    slots = default_checkpoint_slots(planned.max_num_seqs)
    models = prefix_cache_models(planned.allocators, planned.prediction.rank_bytes, slots)
    return replay_prefix_all(models, multi_turn_workload(SEED), planned.max_model_len)


def render_markdown(results: dict) -> str:
    header, rows = prefix_table(results)
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    results = prefix_results()
    print(json.dumps({k: v.to_dict() for k, v in results.items()}, indent=2) if args.json
          else render_markdown(results))


if __name__ == "__main__":
    main()
