"""A user's mistake on the command line is one line naming what to fix, exit code 2, and changes nothing."""

from __future__ import annotations

import importlib.metadata
import json
import os
import shutil
import socket
import subprocess
import sys

import pytest

from hybridkv.cli import main

pytest.importorskip("torch")


def _one_line_error(capsys, command: str) -> str:
    err = capsys.readouterr().err
    assert err.startswith(f"hybridkv {command}: error: "), err
    assert len(err.strip().splitlines()) == 1, err
    return err


def _files(folder) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in sorted(folder.iterdir())}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    folder = tmp_path_factory.mktemp("cli-errors") / "model"
    assert main(["make-model", "--catalog", "qwen3.5-4b", "--tiny", "--out", str(folder)]) == 0
    return folder


@pytest.fixture
def model_copy(checkpoint, tmp_path):
    return shutil.copytree(checkpoint, tmp_path / "model")


def _serve(model, *flags: str) -> list[str]:
    return ["serve", "--model", str(model), "--device", "cpu", "--port", "0", "--metrics-port", "0", "--http-port",
            "0", *flags]


# ------------------------------------------------------------------------------------------------------------ serve


@pytest.mark.parametrize("name", ["config.json", "generation_config.json", "tokenizer_config.json"])
def test_serve_refuses_a_corrupt_json_file_of_the_checkpoint(model_copy, capsys, name):
    (model_copy / name).write_text('{"model_type": ')
    before = _files(model_copy)
    assert main(_serve(model_copy)) == 2
    err = _one_line_error(capsys, "serve")
    assert f"{model_copy / name} is not valid JSON" in err
    assert _files(model_copy) == before


@pytest.mark.parametrize(("name", "content", "message"), [
    ("tokenizer.json", "{bad", "tokenizer.json is not a tokenizer the tokenizers library can read"),
    ("generation_config.json", '{"eos_token_id": "abc"}', "eos_token_id must be a token id or a list of token ids"),
    ("generation_config.json", '{"eos_token_id": [1, true]}', "eos_token_id must be a token id"),
])
def test_serve_refuses_a_tokenizer_or_eos_it_cannot_use(model_copy, capsys, name, content, message):
    (model_copy / name).write_text(content)
    assert main(_serve(model_copy)) == 2
    assert message in _one_line_error(capsys, "serve")


def test_serve_refuses_a_device_that_is_not_cuda_n_and_a_token_file_that_is_not_utf8(checkpoint, tmp_path, capsys):
    assert main(["serve", "--model", str(checkpoint), "--device", "cuda:abc", "--port", "0", "--metrics-port", "0",
                 "--http-port", "0"]) == 2
    assert "device must be auto, cpu, cuda or cuda:N, got 'cuda:abc'" in _one_line_error(capsys, "serve")
    token = tmp_path / "token"
    token.write_bytes(b"\xff\xfe")
    assert main(_serve(checkpoint, "--auth-token-file", str(token))) == 2
    assert "--auth-token-file: the token must be UTF-8 text" in _one_line_error(capsys, "serve")


@pytest.mark.parametrize("mode", ["triton", "fast"])
@pytest.mark.parametrize("device", ["cpu", "auto"])
def test_serve_refuses_a_kernel_mode_the_cpu_cannot_run(checkpoint, capsys, monkeypatch, mode, device):
    """Forcing the Triton kernels on a CPU device (named, or the one `auto` finds without a GPU) would die in the
    first prefill (fla's stages do not run under the interpreter); an unknown mode is named with the modes there
    are."""
    monkeypatch.setenv("HYBRIDKV_KERNELS", mode)
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    flags = _serve(checkpoint)
    flags[flags.index("--device") + 1] = device
    assert main(flags) == 2
    err = _one_line_error(capsys, "serve")
    if mode == "triton":
        assert "HYBRIDKV_KERNELS=triton cannot serve on the CPU" in err
    else:
        assert "HYBRIDKV_KERNELS='fast' is not one of auto, reference, triton" in err


@pytest.mark.parametrize("damage", ["truncated", "garbage"])
def test_serve_refuses_an_unreadable_safetensors_file(model_copy, capsys, damage):
    weights = model_copy / "model.safetensors"
    content = weights.read_bytes()
    weights.write_bytes(content[:-100] if damage == "truncated" else b"not a checkpoint" * 64)
    assert main(_serve(model_copy)) == 2
    err = _one_line_error(capsys, "serve")
    assert f"{weights} is not a readable safetensors file" in err
    assert "rebuild or download the checkpoint again" in err


def test_a_truncated_file_reaching_the_loader_is_the_same_user_error(model_copy):
    """The engine process loads through the loader: its failure goes back to the server as a UserError."""
    import torch

    from hybridkv.errors import UserError
    from hybridkv.sidecar.model.loader import load_checkpoint
    from hybridkv.sidecar.model.qwen3_5 import Qwen3_5ForCausalLM
    from hybridkv.sizing import geometry_from_config

    weights = model_copy / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    geometry = geometry_from_config(json.loads((model_copy / "config.json").read_text()))
    model = Qwen3_5ForCausalLM(geometry, torch.float32, "cpu")
    with pytest.raises(UserError, match="is not a readable safetensors file"):
        load_checkpoint(model, model_copy)


def test_serve_refuses_a_port_in_use(checkpoint, capsys):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(_serve(checkpoint, "--host", "127.0.0.1", "--port", str(port))) == 2
    err = _one_line_error(capsys, "serve")
    assert f"cannot listen on --port {port} on 127.0.0.1" in err


def test_serve_refuses_a_metrics_port_in_use(checkpoint, capsys):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main([*_serve(checkpoint, "--host", "127.0.0.1"), "--metrics-port", str(port)]) == 2
    assert f"cannot listen on --metrics-port {port} on 127.0.0.1" in _one_line_error(capsys, "serve")


@pytest.mark.parametrize(("host", "message"), [
    ("no-such-host.invalid", "--host 'no-such-host.invalid' is not an address of this machine"),
    ("192.0.2.1", "cannot listen on --host '192.0.2.1'"),  # TEST-NET-1: routable syntax, never a local address
])
def test_serve_refuses_a_host_it_cannot_bind(checkpoint, capsys, host, message):
    assert main(_serve(checkpoint, "--host", host)) == 2
    assert message in _one_line_error(capsys, "serve")


# --------------------------------------------------------------------------------------------------------- generate


@pytest.mark.parametrize(("flags", "message"), [
    (("--max-tokens", "-1"), "--max-tokens: expected an integer in [1, 4294967295], got -1"),
    (("--max-tokens", "0"), "--max-tokens: expected an integer in [1,"),
    (("--seed", "-1"), "--seed: expected an integer in [0, 9223372036854775807], got -1"),
    (("--seed", str(2**66)), f"--seed: expected an integer in [0, 9223372036854775807], got {2**66}"),
    (("--top-k", str(2**40)), "--top-k: expected an integer in [0,"),
    (("--timeout-s", "0"), "--timeout-s: expected seconds in (0, 86400], got 0"),
    (("--timeout-s", "nan"), "--timeout-s: expected seconds in (0, 86400], got nan"),
    (("--target", "localhost:99999"), "--target: expected host:port with a port in [1, 65535]"),  # gRPC wraps it
    (("--target", "localhost"), "--target: expected host:port"),
])
def test_generate_bounds_its_numbers_before_connecting(capsys, flags, message):
    with pytest.raises(SystemExit) as caught:
        main(["generate", "hello", "--target", "127.0.0.1:1", *flags])
    assert caught.value.code == 2
    err = capsys.readouterr().err
    assert message in err
    assert "Traceback" not in err


def test_generate_refuses_a_prompt_or_token_file_that_is_not_utf8(tmp_path, capsys):
    with pytest.raises(SystemExit) as caught:
        main(["generate", "\udcff\udcfe", "--target", "127.0.0.1:1"])  # argv bytes 0xff 0xfe, as Python sees them
    assert caught.value.code == 2 and "the prompt is not valid UTF-8 text" in capsys.readouterr().err
    token = tmp_path / "token"
    token.write_bytes(b"\xff\xfe")
    assert main(["generate", "hi", "--target", "127.0.0.1:1", "--auth-token-file", str(token)]) == 2
    assert f"the auth token file {str(token)!r} is not UTF-8 text" in _one_line_error(capsys, "generate")


def test_generate_exits_1_when_the_stream_ends_aborted(checkpoint, capsys):
    from hybridkv.sidecar.core.config import EngineConfig
    from hybridkv.sidecar.serving.server import BackgroundServer, ServerConfig

    config = EngineConfig(model=str(checkpoint), device="cpu", max_num_seqs=2, max_num_batched_tokens=64,
                          max_model_len=4096, kv_cache_memory_bytes=8 * 1024**2)
    background = BackgroundServer(config, ServerConfig(host="127.0.0.1", port=0, metrics_port=0)).start().load()
    try:
        # A drain with no grace aborts the running request: the stream ends with finish reason abort.
        import threading
        import time

        def drain_soon() -> None:
            time.sleep(1.0)
            background.drain(0.0)

        threading.Thread(target=drain_soon, daemon=True).start()
        code = main(["generate", "hello", "--target", background.target, "--max-tokens", "4000", "--ignore-eos",
                     "--usage"])
    finally:
        background.close()
    err = capsys.readouterr().err
    assert code == 1, err
    assert "[abort]" in err
    assert "hybridkv generate: error: the sidecar aborted the request before it finished" in err


# --------------------------------------------------------------------------------------------- simulate, make-model


def test_simulate_refuses_a_trace_path_in_a_missing_folder(tmp_path, capsys):
    target = tmp_path / "missing" / "trace.jsonl"
    assert main(["simulate", "--requests", "20", "--write-trace", str(target)]) == 2
    err = _one_line_error(capsys, "simulate")
    assert f"--write-trace: cannot write {str(target)!r}: No such file or directory" in err
    assert not (tmp_path / "missing").exists()


def test_make_model_refuses_an_unwritable_out(tmp_path, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    assert main(["make-model", "--catalog", "qwen3.5-4b", "--tiny", "--out", str(blocker / "model")]) == 2
    err = _one_line_error(capsys, "make-model")
    assert f"--out {str(blocker / 'model')!r}: cannot write the checkpoint: Not a directory" in err
    assert blocker.read_text() == "not a folder"


@pytest.mark.parametrize("flags, message", [
    (["--out", ""], "argument --out: expected a folder to write, got an empty path"),
    (["--out", "   "], "argument --out: expected a folder to write, got an empty path"),
    (["--out", "m", "--seed", "-1"], "argument --seed: expected an integer in [0, 9223372036854775807], got -1"),
    (["--out", "m", "--max-shard-mib", "0"], "argument --max-shard-mib: expected an integer in [1, 1048576], got 0"),
])
def test_make_model_refuses_bad_flags_before_writing_anything(tmp_path, monkeypatch, capsys, flags, message):
    """An empty --out used to write the checkpoint into the current directory."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as caught:
        main(["make-model", "--catalog", "qwen3.5-4b", "--tiny", *flags])
    assert caught.value.code == 2 and message in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_make_model_refuses_a_model_type_that_is_not_a_string(tmp_path, capsys):
    out = tmp_path / "model"
    assert main(["make-model", "--catalog", "qwen3.5-4b", "--tiny", "--set", "model_type=[1]", "--out", str(out)]) == 2
    assert "config key 'model_type' must be a string, got [1]" in _one_line_error(capsys, "make-model")
    assert not out.exists()


def test_make_model_refuses_an_unknown_config_key_naming_the_valid_ones(tmp_path, capsys):
    out = tmp_path / "model"
    assert main(["make-model", "--catalog", "qwen3.5-4b", "--tiny", "--set", "nosuchkey=1", "--out", str(out)]) == 2
    err = _one_line_error(capsys, "make-model")
    assert "unknown config key nosuchkey; the keys this config can set are: " in err
    assert "num_hidden_layers" in err and "full_attention_interval" in err
    assert not out.exists()


def test_make_model_keeps_an_existing_checkpoint_unless_forced(checkpoint, tmp_path, capsys):
    out = shutil.copytree(checkpoint, tmp_path / "model")
    before = _files(out)
    assert main(["make-model", "--catalog", "qwen3.5-4b", "--tiny", "--seed", "1", "--out", str(out)]) == 2
    err = _one_line_error(capsys, "make-model")
    assert "already holds a checkpoint; pass --force to replace it" in err
    assert _files(out) == before
    assert main(["make-model", "--catalog", "qwen3.5-4b", "--tiny", "--seed", "1", "--out", str(out), "--force"]) == 0
    assert _files(out)["model.safetensors"] != before["model.safetensors"]


# ------------------------------------------------------------------------------------------------- demo, operator


def test_demo_refuses_an_unknown_device_before_its_first_step(tmp_path):
    result = subprocess.run([sys.executable, "-P", "-m", "hybridkv", "demo", "--device", "tpu"], capture_output=True,
                            text=True, env={**os.environ, "HYBRIDKV_CACHE": str(tmp_path)}, timeout=60)
    assert result.returncode == 2
    assert "argument --device: invalid choice: 'tpu'" in result.stderr
    assert "[1/" not in result.stdout
    assert not any(tmp_path.iterdir())


def test_operator_without_credentials_is_one_line_before_kopf_starts(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("KUBECONFIG", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setattr("hybridkv.operator.cli.IN_CLUSTER_TOKEN_PATH", str(tmp_path / "no-token"))
    assert main(["operator", "--all-namespaces"]) == 2
    err = _one_line_error(capsys, "operator")
    assert "no Kubernetes credentials" in err and "set KUBECONFIG" in err


def test_operator_with_a_kubeconfig_path_that_does_not_exist(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "absent"))
    monkeypatch.setattr("hybridkv.operator.cli.IN_CLUSTER_TOKEN_PATH", str(tmp_path / "no-token"))
    assert main(["operator", "--all-namespaces"]) == 2
    assert f"KUBECONFIG names {str(tmp_path / 'absent')!r}, which is not a file" in _one_line_error(capsys, "operator")


# ------------------------------------------------------------------------------------------------- missing extras


@pytest.mark.parametrize(("argv", "extra", "package"), [
    (["demo"], "engine", "torch"),
    (["serve", "--model", "m"], "engine", "safetensors"),
    (["make-model", "--catalog", "qwen3.5-4b", "--tiny", "--out", "m"], "engine", "numpy"),
    (["operator", "--all-namespaces"], "operator", "kopf"),
])
def test_a_command_whose_extra_is_missing_names_the_install(monkeypatch, tmp_path, capsys, argv, extra, package):
    real = importlib.metadata.distribution

    def distribution(name: str):
        if name == package:
            raise importlib.metadata.PackageNotFoundError(name)
        return real(name)

    monkeypatch.setattr(importlib.metadata, "distribution", distribution)
    monkeypatch.chdir(tmp_path)
    assert main(argv) == 2
    err = _one_line_error(capsys, argv[0])
    assert f"this command needs the {extra} extra ({package} missing): pip install 'hybridkv[{extra}]'" in err
    assert not any(tmp_path.iterdir())


# ------------------------------------------------------------------------------------------------ start-up figures


@pytest.mark.parametrize(("budget_bytes", "budget_text"), [(1000, "1,000 bytes"), (3 * 2**20 + 1, "3.00 MiB")])
def test_a_budget_too_small_for_the_pools_prints_sizes_that_differ(budget_bytes, budget_text):
    from hybridkv.sizing import catalog_geometry
    from hybridkv.sizing.allocators import CapacityError, dual_pool_layout
    from hybridkv.sizing.memory import byte_model

    with pytest.raises(CapacityError) as caught:
        dual_pool_layout(byte_model(catalog_geometry("qwen3.5-4b")), budget_bytes, max_num_seqs=8)
    message = str(caught.value)
    assert message.startswith(f"a cache budget of {budget_text} per rank cannot hold 8 state slots")
    # 9 slots of 51,511,296 B and 2 blocks of 16 × 32,768 B = 464,650,240 B = 443.125 MiB, rounded up.
    assert "(+1 null, 442.13 MiB)" in message and "it needs at least 443.13 MiB" in message
