"""`hybridkv operator`: its flags, and bad input rejected before anything starts."""

from __future__ import annotations

import pytest

from hybridkv.cli import build_parser, main


def test_operator_needs_a_namespace_scope(capsys):
    with pytest.raises(SystemExit) as raised:
        build_parser().parse_args(["operator"])
    assert raised.value.code == 2
    assert "--namespace" in capsys.readouterr().err


def test_operator_flags_parse():
    args = build_parser().parse_args(
        ["operator", "-n", "models", "-n", "team-b", "--peering", "hybridkv", "--liveness", "http://0.0.0.0:8080/healthz",
         "--capacity-interval-s", "15", "--no-gpu-discovery"]
    )
    assert args.namespace == ["models", "team-b"] and args.peering == "hybridkv"
    assert args.capacity_interval_s == 15.0 and args.no_gpu_discovery


@pytest.mark.parametrize("interval", ["0", "4", "100000"])
def test_an_out_of_range_capacity_interval_is_a_one_line_error(interval, capsys):
    assert main(["operator", "--all-namespaces", "--capacity-interval-s", interval]) == 2
    err = capsys.readouterr().err
    assert err.startswith("hybridkv operator: error: --capacity-interval-s must be in [5, 3600]")
    assert len(err.strip().splitlines()) == 1
