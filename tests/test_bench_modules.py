"""The bench scripts put their folder first on sys.path (each imports its siblings, e.g. `throughput`): no script may
be named like an installed top-level module, or every import of that module in the process, a dependency's included,
finds the script instead (transformers imports the `kernels` distribution when it is installed)."""

from __future__ import annotations

import importlib.metadata
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent.parent / "bench"


def test_no_bench_script_shadows_an_installed_or_standard_module():
    installed = set(importlib.metadata.packages_distributions()) | set(sys.stdlib_module_names)
    scripts = {path.stem for path in BENCH.glob("*.py")}
    assert scripts, "no bench scripts found"
    assert not scripts & installed, f"bench scripts named like installed modules: {sorted(scripts & installed)}"
