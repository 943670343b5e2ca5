"""`hybridkv serve`: run the gRPC sidecar with the flags the operator puts in the pod (docs/api.md)."""

from __future__ import annotations

import argparse
import re

from hybridkv.sidecar.core.config import DEFAULT_CHECKPOINT_INTERVAL_TOKENS

_QUANTITY = re.compile(r"^(\d+)(Ki|Mi|Gi|Ti)?$")
_QUANTITY_FACTORS = {None: 1, "Ki": 1024, "Mi": 1024**2, "Gi": 1024**3, "Ti": 1024**4}


def _bounded(kind: type, low: float, high: float | None = None, *, low_open: bool = False, what: str = ""):
    """An argparse type for an int or float in [low, high] ((low, high] with `low_open`); `what` names the value."""
    noun = what or ("an integer" if kind is int else "a number")
    interval = f"{'(' if low_open else '['}{low:g}, {'inf)' if high is None else f'{high:g}]'}"

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {noun} in {interval}, got {text!r}") from None
        if value < low or (low_open and value == low) or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"expected {noun} in {interval}, got {text}")
        return value

    return parse


_positive_int = _bounded(int, 1)
_non_negative_int = _bounded(int, 0)
_port = _bounded(int, 0, 65535, what="a port")
_fraction = _bounded(float, 0.0, 1.0, low_open=True)
_seconds = _bounded(float, 0.0, 86400.0, what="seconds")


def parse_bytes(text: str) -> int:
    """Bytes as an integer or a Kubernetes binary quantity (512Mi, 8Gi)."""
    match = _QUANTITY.match(text.strip())
    if not match or int(match.group(1)) == 0:
        raise argparse.ArgumentTypeError(
            f"expected a positive number of bytes such as 268435456 or 256Mi, got {text!r}")
    return int(match.group(1)) * _QUANTITY_FACTORS[match.group(2)]


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "serve",
        help="run the gRPC sidecar for one model replica",
        description=(
            "Load a checkpoint, size the dual-pool cache and serve hybridkv.v1.GenerationService with "
            "grpc.health.v1, reflection and Prometheus metrics. SIGTERM drains within --grace-period-s."
        ),
    )
    parser.add_argument("--model", required=True, metavar="DIR", help="checkpoint folder (config.json, safetensors)")
    parser.add_argument("--tensor-parallel-size", type=_positive_int, default=1, metavar="N")
    parser.add_argument("--gpu-memory-utilization", type=_fraction, default=0.9, metavar="F",
                        help="share of GPU memory for weights, activations and cache (default %(default)s)")
    parser.add_argument("--max-num-seqs", type=_positive_int, default=256, metavar="S",
                        help="most running requests = usable state slots (default %(default)s)")
    parser.add_argument("--max-model-len", type=_positive_int, default=None, metavar="L",
                        help="longest request in tokens, prompt + output (default: the model's)")
    parser.add_argument("--block-size", type=_positive_int, default=16,
                        help="tokens per KV block (default %(default)s)")
    parser.add_argument("--kv-cache-memory", type=parse_bytes, default=None, metavar="BYTES",
                        help="fix the cache budget in bytes (or 256Mi, 8Gi) instead of deriving it from utilization")
    parser.add_argument("--max-num-batched-tokens", type=_positive_int, default=8192, metavar="T",
                        help="tokens per engine step (default %(default)s)")
    parser.add_argument("--enable-prefix-caching", action="store_true",
                        help="share cached prompt prefixes: attention blocks by content hash, GDN state from checkpoints")
    parser.add_argument("--prefix-checkpoint-slots", type=_positive_int, default=None, metavar="N",
                        help="GDN state checkpoints the prefix cache keeps (default: a quarter of --max-num-seqs)")
    parser.add_argument("--prefix-checkpoint-interval", type=_non_negative_int,
                        default=DEFAULT_CHECKPOINT_INTERVAL_TOKENS, metavar="TOKENS",
                        help="also checkpoint long prompts every TOKENS tokens, a multiple of --block-size; 0: only "
                             "prompt ends, partings from a shared prefix and reply ends (default %(default)s)")
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N (default %(default)s)")
    parser.add_argument("--host", default="0.0.0.0", help="address to bind (default %(default)s)")
    parser.add_argument("--port", type=_port, default=50051, help="gRPC port (default %(default)s)")
    parser.add_argument("--metrics-port", type=_port, default=9400,
                        help="Prometheus /metrics port; 0 turns it off (default %(default)s)")
    parser.add_argument("--health-port", type=_port, default=50052,
                        help="plaintext grpc.health.v1 port when TLS is on (default %(default)s)")
    parser.add_argument("--max-queue", type=_non_negative_int, default=256, metavar="Q",
                        help="requests that may wait beyond the running ones before RESOURCE_EXHAUSTED "
                             "(default %(default)s)")
    parser.add_argument("--grace-period-s", type=_seconds, default=30.0,
                        help="on SIGTERM, how long in-flight requests may finish (default %(default)s)")
    parser.add_argument("--auth-token-file", default=None, metavar="F",
                        help="require `authorization: Bearer <token>` with the token in this file (health exempt)")
    parser.add_argument("--tls-cert", default=None, metavar="F", help="PEM certificate chain: serve gRPC over TLS")
    parser.add_argument("--tls-key", default=None, metavar="F", help="PEM private key of --tls-cert")
    parser.set_defaults(handler=_run_serve)


def _read_file(path: str, what: str, flag: str) -> bytes:
    from hybridkv.errors import UserError

    try:
        with open(path, "rb") as handle:
            content = handle.read()
    except OSError as exc:
        raise UserError(f"{flag}: cannot read the {what} {path!r}: {exc.strerror}") from exc
    if not content.strip():
        raise UserError(f"{flag}: the {what} {path!r} is empty")
    return content


def build_configs(args: argparse.Namespace):
    """EngineConfig and ServerConfig from the parsed flags; raises UserError naming the flag that cannot work."""
    from hybridkv.errors import UserError
    from hybridkv.sidecar.core.config import EngineConfig
    from hybridkv.sidecar.serving.server import ServerConfig

    if (args.tls_cert is None) != (args.tls_key is None):
        raise UserError("--tls-cert and --tls-key go together: pass both to serve TLS, or neither")
    ports = {"--port": args.port, "--metrics-port": args.metrics_port}
    if args.tls_cert is not None:
        ports["--health-port"] = args.health_port
    bound = [(flag, port) for flag, port in ports.items() if port]
    seen: dict[int, str] = {}
    for flag, port in bound:
        if port in seen:
            raise UserError(f"{flag} and {seen[port]} are both {port}; give each its own port")
        seen[port] = flag
    token = None
    if args.auth_token_file is not None:
        token = _read_file(args.auth_token_file, "auth token file", "--auth-token-file").decode().strip()
        if any(char.isspace() for char in token) or not token.isprintable():
            raise UserError("--auth-token-file: the token must be one line of printable characters without spaces")
    engine_config = EngineConfig(
        model=args.model,
        tensor_parallel_size=args.tensor_parallel_size,
        gpu_memory_utilization=args.gpu_memory_utilization,
        kv_cache_memory_bytes=args.kv_cache_memory,
        max_num_seqs=args.max_num_seqs,
        max_model_len=args.max_model_len,
        max_num_batched_tokens=args.max_num_batched_tokens,
        block_size=args.block_size,
        device=args.device,
        enable_prefix_caching=args.enable_prefix_caching,
        prefix_checkpoint_slots=args.prefix_checkpoint_slots,
        prefix_checkpoint_interval=args.prefix_checkpoint_interval,
    )
    engine_config.validate()
    server_config = ServerConfig(
        host=args.host,
        port=args.port,
        metrics_port=args.metrics_port,
        health_port=args.health_port,
        max_queue=args.max_queue,
        grace_period_s=args.grace_period_s,
        auth_token=token,
        tls_cert_pem=None if args.tls_cert is None else _read_file(args.tls_cert, "TLS certificate", "--tls-cert"),
        tls_key_pem=None if args.tls_key is None else _read_file(args.tls_key, "TLS key", "--tls-key"),
    )
    return engine_config, server_config


def _run_serve(args: argparse.Namespace) -> int:
    import asyncio
    import logging

    from hybridkv.sidecar.serving.server import serve

    engine_config, server_config = build_configs(args)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    asyncio.run(serve(engine_config, server_config))
    return 0
