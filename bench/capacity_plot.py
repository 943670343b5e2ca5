"""Plot max concurrency against request length for Qwen3.5-4B on one H200 (docs/img/capacity-vs-length.png).

All four allocators get the same cache budget: the planner's prediction at gpu_memory_utilization 0.90 with
max_num_seqs 256 and 8192 batched tokens. vLLM and the ideal bound are limited by memory only; the dual pool's
max_num_seqs is sized for each length (`dual_pool_max_concurrency`), as the planner would size it. The output is
deterministic (no timestamps or version strings in the PNG).

    python bench/capacity_plot.py [--out docs/img/capacity-vs-length.png]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from hybridkv.sizing import (  # noqa: E402
    DUAL_POOL,
    IDEAL,
    VLLM_0_20_NONE,
    byte_model,
    catalog_geometry,
    dual_pool_max_concurrency,
    gpu_spec,
    pool_model,
    predict_capacity,
    vllm_align_allocator,
)
from hybridkv.sizing.allocators import MAX_NUM_SEQS  # noqa: E402

DEFAULT_OUT = Path(__file__).resolve().parent.parent / "docs" / "img" / "capacity-vs-length.png"
MODEL = "qwen3.5-4b"
GPU = "h200"
UTILIZATION = "0.90"
PLANNED_SEQS = 256
REQUEST_LENGTHS = [2**k for k in range(7, 19)] + [3 * 2**k for k in range(6, 17)]


def curves() -> tuple[list[int], dict[str, list[int]], int]:
    geometry = catalog_geometry(MODEL)
    rank = byte_model(geometry)
    budget = predict_capacity(geometry, 1, gpu_spec(GPU).memory_bytes, UTILIZATION, PLANNED_SEQS).budget_bytes
    lengths = sorted(REQUEST_LENGTHS)
    series = {DUAL_POOL.label + " (max_num_seqs sized per length)": [
        dual_pool_max_concurrency(rank, budget, length) for length in lengths
    ]}
    for allocator in (VLLM_0_20_NONE, vllm_align_allocator(gpu_spec(GPU).compute_capability), IDEAL):
        pool = pool_model(allocator, rank, budget, MAX_NUM_SEQS)
        series[allocator.label] = [pool.max_concurrency(length) for length in lengths]
    return lengths, series, budget


def plot(out: Path) -> None:
    lengths, series, budget = curves()
    ideal = series[IDEAL.label]
    styles = {0: ("tab:blue", "-", 2.2), 1: ("tab:orange", "--", 1.6), 2: ("tab:red", ":", 1.8), 3: ("black", "-", 0.8)}
    plt.rcParams.update({"font.size": 9})
    figure, (top, bottom) = plt.subplots(2, 1, figsize=(8, 7.5), sharex=True, height_ratios=(3, 2))
    for index, (label, values) in enumerate(series.items()):
        color, line, width = styles[index]
        top.plot(lengths, values, line, color=color, linewidth=width, label=label)
        bottom.plot(lengths, [100 * v / i for v, i in zip(values, ideal, strict=True)], line, color=color,
                    linewidth=width, label=label)
    top.set_xscale("log", base=2)
    top.set_yscale("log")
    top.set_ylabel("max requests resident at once")
    top.set_title(
        f"Qwen3.5-4B on one H200: {budget / 2**30:.1f} GiB cache budget (util {UTILIZATION}, bf16 KV, fp32 GDN state)"
    )
    top.grid(True, which="both", alpha=0.3)
    top.legend(loc="lower left")
    bottom.set_ylabel("% of the ideal bound")
    bottom.set_xlabel("request length (prompt + output tokens)")
    bottom.set_ylim(0, 105)
    bottom.grid(True, which="both", alpha=0.3)
    figure.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    # No Software/date metadata: the committed PNG only changes when the figures do.
    figure.savefig(out, dpi=110, metadata={"Software": None})
    plt.close(figure)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    plot(parser.parse_args().out)


if __name__ == "__main__":
    main()
