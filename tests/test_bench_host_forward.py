"""bench/host_forward.py on CPU: the model's forward at a catalog model's layer structure with every launch counted
and skipped; the counts follow the layers, and the stubs are gone afterwards."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
import host_forward  # noqa: E402


def test_launches_follow_the_layers_and_the_stubs_are_restored(tmp_path, monkeypatch):
    import os

    import torch.nn.functional as F
    from triton.runtime import interpreter, jit

    monkeypatch.setenv("HYBRIDKV_KERNELS", "auto")
    linear, jit_run, interpreted_run = F.linear, jit.JITFunction.run, interpreter.InterpretedFunction.run
    out = tmp_path / "host_forward.json"
    assert host_forward.main(["--model", "qwen3.5-0.8b", "--batch-sizes", "4", "--prefill-tokens", "0,40",
                              "--steps", "2", "--profile", "3", "--out", str(out)]) == 0
    assert F.linear is linear and jit.JITFunction.run is jit_run
    assert interpreter.InterpretedFunction.run is interpreted_run
    assert os.environ["HYBRIDKV_KERNELS"] == "auto"
    result = json.loads(out.read_text())
    decode, mixed = result["rows"]
    layers = result["num_hidden_layers"]
    # Every layer: its mixer's input and output projections, the MLP's gate|up and down.
    assert decode["gemms_per_step"] == mixed["gemms_per_step"] == 4 * layers
    assert decode["forward_host_ms"] > 0 and mixed["forward_host_ms"] > 0
    gdn_layers = decode["triton_launches"]["_gdn_decode_kernel"]
    assert mixed["triton_launches"]["_prefill_inputs_kernel"] == gdn_layers and 0 < gdn_layers < layers
    assert "_prefill_inputs_kernel" not in decode["triton_launches"]
    assert mixed["triton_launches_per_step"] > decode["triton_launches_per_step"]
    own = [entry["own_ms_per_step"] for entry in mixed["profile"]]
    assert len(own) == 3 and own == sorted(own, reverse=True)


def test_bad_flags_are_refused(capsys):
    for argv in (["--batch-sizes", "a"], ["--steps", "0"], ["--batch-sizes", "0", "--prefill-tokens", "0"]):
        with pytest.raises(SystemExit) as exit_info:
            host_forward.parse_args(argv)
        assert exit_info.value.code == 2


def test_an_unknown_model_is_named_in_the_error(tmp_path):
    import subprocess

    result = subprocess.run([sys.executable, "-P", str(ROOT / "bench" / "host_forward.py"), "--model", "nope",
                             "--out", str(tmp_path / "out.json")], capture_output=True, text=True, timeout=120,
                            check=False)
    assert result.returncode == 2 and "unknown model 'nope'" in result.stderr and "Traceback" not in result.stderr
    assert not (tmp_path / "out.json").exists()
