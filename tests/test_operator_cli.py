"""`hybridkv operator`: its flags, and bad input rejected before anything starts."""

from __future__ import annotations

import asyncio
import os
import pathlib
import signal
import sys

import aiohttp
import pytest
import yaml
from operator_cluster import DEPLOYMENTS, NAMESPACE, ClusterEmulator, create, declare_resources, stored, write_kubeconfig

from hybridkv.cli import build_parser, main
from hybridkv.net import free_loopback_port

ROOT = pathlib.Path(__file__).resolve().parents[1]


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


@pytest.mark.kmock(cls=ClusterEmulator)
async def test_hybridkv_operator_serves_a_cluster_until_sigterm(kmock, tmp_path):
    """The real command in its own process (kopf.run, signals, liveness) against the mock API server."""
    declare_resources(kmock)
    write_kubeconfig(tmp_path / "kubeconfig", str(kmock.url).rstrip("/"))
    liveness = f"http://127.0.0.1:{free_loopback_port()}/healthz"
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-P", "-m", "hybridkv", "operator", "--namespace", NAMESPACE, "--standalone", "--liveness", liveness,
        env={**os.environ, "KUBECONFIG": str(tmp_path / "kubeconfig")},
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
    )
    try:
        body = yaml.safe_load((ROOT / "examples" / "qwen3.5-4b-h200.yaml").read_text())
        body["metadata"]["namespace"] = NAMESPACE
        await create(kmock, body)
        deadline = asyncio.get_running_loop().time() + 60
        while not stored(kmock, DEPLOYMENTS, "qwen35-4b"):
            assert asyncio.get_running_loop().time() < deadline, "the operator applied no Deployment within 60 s"
            await asyncio.sleep(0.2)
        async with aiohttp.ClientSession() as session, session.get(liveness) as response:
            assert response.status == 200
    finally:
        process.send_signal(signal.SIGTERM)
        output, _ = await asyncio.wait_for(process.communicate(), timeout=60)
    assert process.returncode == 0, output.decode()[-2000:]
    assert "applied Deployment qwen35-4b, Service qwen35-4b, Service qwen35-4b-headless" in output.decode()


def test_an_impersonating_kubeconfig_is_refused_before_the_operator_starts(tmp_path, monkeypatch, capsys):
    kubeconfig = tmp_path / "kubeconfig"
    write_kubeconfig(kubeconfig, "http://127.0.0.1:1")
    config = yaml.safe_load(kubeconfig.read_text())
    config["users"][0]["user"]["as"] = "system:serviceaccount:hybridkv:hybridkv"
    kubeconfig.write_text(yaml.safe_dump(config))
    monkeypatch.setenv("KUBECONFIG", str(kubeconfig))
    assert main(["operator", "-n", NAMESPACE]) == 2
    assert "impersonates (as)" in capsys.readouterr().err


@pytest.mark.parametrize(
    "flags,message",
    [
        (["--operator-namespace", "serving", "--operator-pod-label", "no-equals-sign"], "--operator-pod-label"),
        (["--operator-namespace", "Not_A_Namespace"], "--operator-namespace"),
        (["--scraper-pod-label", "app=prometheus"], "--scraper-pod-label needs --scraper-namespace"),
    ],
)
def test_bad_network_policy_identities_are_one_line_errors(flags, message, capsys):
    assert main(["operator", "-n", NAMESPACE, *flags]) == 2
    assert message in capsys.readouterr().err
