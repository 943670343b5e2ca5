"""`hybridkv serve` rejects every bad flag with a message naming it, before anything loads."""

from __future__ import annotations

import json

import pytest

from hybridkv.cli import main


@pytest.fixture
def model_dir(tmp_path):
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "qwen3_5_text"}))
    return folder


def _serve(model_dir, *flags: str) -> list[str]:
    return ["serve", "--model", str(model_dir), *flags]


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (("--gpu-memory-utilization", "1.5"), "expected a number in (0, 1], got 1.5"),
        (("--gpu-memory-utilization", "lots"), "expected a number in (0, 1]"),
        (("--max-num-seqs", "0"), "--max-num-seqs"),
        (("--max-model-len", "-4"), "--max-model-len"),
        (("--kv-cache-memory", "12abc"), "--kv-cache-memory"),
        (("--kv-cache-memory", "0"), "a positive number of bytes"),
        (("--port", "70000"), "expected a port in [0, 65535], got 70000"),
        (("--max-queue", "-1"), "--max-queue"),
        (("--grace-period-s", "-3"), "--grace-period-s"),
        (("--grace-period-s", "nan"), "--grace-period-s: expected seconds in [0, 86400], got nan"),
        (("--gpu-memory-utilization", "nan"), "expected a number in (0, 1], got nan"),
        (("--tool-call-parser", "mistral"), "invalid choice: 'mistral'"),
        (("--reasoning-parser", "deepseek"), "invalid choice: 'deepseek'"),
        (("--target-tpot-ms", "0"), "expected milliseconds in (0, 60000], got 0"),
        (("--target-tpot-ms", "soon"), "expected milliseconds in (0, 60000], got 'soon'"),
    ],
)
def test_malformed_flag_values_exit_2_naming_the_flag(model_dir, capsys, flags, message):
    with pytest.raises(SystemExit) as caught:
        main(_serve(model_dir, *flags))
    assert caught.value.code == 2
    err = capsys.readouterr().err
    assert flags[0] in err
    assert message in err


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (("--tls-cert", "cert.pem"), "--tls-cert and --tls-key go together"),
        (("--port", "9400"), "--metrics-port and --port are both 9400"),
        (("--auth-token-file", "/nonexistent/token"), "--auth-token-file: cannot read the auth token file"),
        (("--block-size", "24"), "block_size must be a power of two"),
        (("--device", "tpu"), "device must be auto, cpu, cuda or cuda:N"),
        (("--max-num-seqs", "512", "--max-num-batched-tokens", "256"), "max_num_batched_tokens=256 is below"),
        (("--tensor-parallel-size", "3"), "tensor_parallel_size"),
        (("--http-port", "50051"), "--http-port and --port are both 50051"),
        (("--tls-cert", "/nonexistent/c.pem", "--tls-key", "k.pem"), "--tls-cert: cannot read the TLS certificate"),
        (("--no-enable-prefix-caching", "--prefix-checkpoint-slots", "8"),
         "--prefix-checkpoint-slots needs prefix caching on; drop --no-enable-prefix-caching"),
    ],
)
def test_inconsistent_flags_exit_2_with_the_reason(model_dir, capsys, flags, message):
    assert main(_serve(model_dir, *flags)) == 2
    err = capsys.readouterr().err
    assert err.startswith("hybridkv serve: error:")
    assert message in err


def test_a_tls_key_that_is_not_the_certificates_is_rejected_before_anything_starts(model_dir, tmp_path, capsys):
    from test_sidecar_server import self_signed_localhost_certificate

    (cert_pem, _), (_, other_key_pem) = self_signed_localhost_certificate(), self_signed_localhost_certificate()
    (tmp_path / "tls.crt").write_bytes(cert_pem)
    (tmp_path / "other.key").write_bytes(other_key_pem)
    assert main(_serve(model_dir, "--tls-cert", str(tmp_path / "tls.crt"), "--tls-key",
                       str(tmp_path / "other.key"))) == 2
    assert "do not load as a PEM certificate chain and its private key" in capsys.readouterr().err


def test_a_model_folder_without_config_is_rejected(tmp_path, capsys):
    assert main(["serve", "--model", str(tmp_path)]) == 2
    assert "has no config.json" in capsys.readouterr().err


def test_an_empty_token_file_is_rejected(model_dir, tmp_path, capsys):
    token_file = tmp_path / "token"
    token_file.write_text("\n")
    assert main(_serve(model_dir, "--auth-token-file", str(token_file))) == 2
    assert "is empty" in capsys.readouterr().err


def test_prefix_caching_is_on_unless_turned_off(model_dir):
    from hybridkv.cli import build_parser
    from hybridkv.sidecar.serving.cli import build_configs

    def config(*flags):
        return build_configs(build_parser().parse_args(_serve(model_dir, "--device", "cpu", *flags)))[0]

    assert config().enable_prefix_caching is True
    assert config().checkpoint_slots == 128  # half of the default --max-num-seqs 256
    assert config("--no-enable-prefix-caching").enable_prefix_caching is False
    assert config("--no-enable-prefix-caching").checkpoint_slots == 0


def test_kv_cache_memory_takes_bytes_or_binary_quantities():
    from hybridkv.sidecar.serving.cli import parse_bytes

    assert parse_bytes("268435456") == 268435456
    assert parse_bytes("256Mi") == 256 * 1024**2
    assert parse_bytes("8Gi") == 8 * 1024**3
