"""docs/capacity.md quotes figures the code computes: the table must match the generator, the plot must be stable."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _bench(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_capacity_doc_table_is_what_the_generator_prints():
    table = _bench("capacity_table")
    assert table.render_markdown(table.capacity_rows()) in (ROOT / "docs" / "capacity.md").read_text()


def test_prefix_caching_doc_table_is_what_the_generator_prints():
    table = _bench("prefix_table")
    assert table.render_markdown(table.prefix_results()) in (ROOT / "docs" / "capacity.md").read_text()


def test_capacity_plot_is_deterministic(tmp_path):
    plot = _bench("capacity_plot")
    first, second = tmp_path / "a.png", tmp_path / "b.png"
    plot.plot(first)
    plot.plot(second)
    assert first.read_bytes() == second.read_bytes()
    assert (ROOT / "docs" / "img" / "capacity-vs-length.png").is_file()
