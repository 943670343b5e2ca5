"""`hybridkv serve`: run the sidecar (gRPC and the OpenAI-compatible HTTP API) with the flags the operator puts in the
pod (docs/api.md)."""

from __future__ import annotations

import argparse
import os
import socket

from hybridkv.cli import bounded as _bounded
from hybridkv.errors import UserError
from hybridkv.sidecar.core.config import (DEFAULT_CHECKPOINT_INTERVAL_TOKENS, DEFAULT_MAX_PREFILL_WAIT_STEPS,
                                          DEFAULT_MIN_PREFILL_TOKENS_WITH_DECODES,
                                          DEFAULT_MIN_PREFILL_TOKENS_WITH_DECODES_CACHED,
                                          DEFAULT_PIECEWISE_GRAPH_TOKENS, DEFAULT_STALL_TIMEOUT_S,
                                          MAX_TARGET_TPOT_MS)
from hybridkv.sidecar.serving.openai.reasoning import REASONING_PARSERS
from hybridkv.sidecar.serving.openai.tool_calls import TOOL_CALL_PARSERS
from hybridkv.sizing.memory import KV_CACHE_DTYPES
from hybridkv.sizing.quantities import parse_bytes as _parse_quantity

_positive_int = _bounded(int, 1)
_non_negative_int = _bounded(int, 0)
_port = _bounded(int, 0, 65535, what="a port")
_fraction = _bounded(float, 0.0, 1.0, low_open=True)
_seconds = _bounded(float, 0.0, 86400.0, what="seconds")
_stall_seconds = _bounded(float, 1.0, 86400.0, what="seconds")
_target_tpot_ms = _bounded(float, 0.0, MAX_TARGET_TPOT_MS, low_open=True, what="milliseconds")


def parse_bytes(text: str) -> int:
    """Bytes as an integer or a Kubernetes binary quantity (512Mi, 8Gi): the planner's reading, as an argparse type."""
    try:
        return _parse_quantity(text)
    except UserError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "serve",
        help="run the gRPC sidecar for one model replica",
        description=(
            "Load a checkpoint, size the dual-pool cache and serve hybridkv.v1.GenerationService with "
            "grpc.health.v1, reflection and Prometheus metrics. SIGTERM drains within --grace-period-s."
        ),
    )
    parser.add_argument("--model", required=True, metavar="DIR", help="checkpoint folder (config.json, safetensors, tokenizer)")
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
    parser.add_argument("--max-prefill-tokens-with-decodes", type=_positive_int, default=None, metavar="T",
                        help="prefill tokens a step may run while decodes run in it, which bounds decode latency "
                             "under mixed load (default: --max-num-batched-tokens)")
    parser.add_argument("--min-prefill-tokens-with-decodes", type=_non_negative_int, default=None, metavar="T",
                        help="while decodes run, hold prefill back until T prompt tokens are ready (or it has waited "
                             "--max-prefill-wait-steps), so prefill runs in fewer, fuller mixed steps and the others "
                             "replay the decode CUDA graphs; 0 never holds (default: "
                             f"{DEFAULT_MIN_PREFILL_TOKENS_WITH_DECODES} with CUDA graphs, "
                             f"{DEFAULT_MIN_PREFILL_TOKENS_WITH_DECODES_CACHED} with them and prefix caching, else 0)")
    parser.add_argument("--max-prefill-wait-steps", type=_non_negative_int, default=DEFAULT_MAX_PREFILL_WAIT_STEPS,
                        metavar="N", help="steps prefill may be held back while decodes run (default %(default)s)")
    parser.add_argument("--target-tpot-ms", type=_target_tpot_ms, default=None, metavar="MS",
                        help="time per output token to keep decoding requests under: while requests decode and the "
                             "last two seconds' steps took longer than MS on average, new prompts wait (their time "
                             "to first token grows) and the running requests decode on until the steps are under it "
                             "again (default: off)")
    parser.add_argument("--piecewise-cuda-graph-max-tokens", type=_non_negative_int,
                        default=DEFAULT_PIECEWISE_GRAPH_TOKENS, metavar="T",
                        help="mixed and prefill steps of up to T tokens replay their token-wise work (norms, "
                             "projections, MLPs) as CUDA graphs captured at start-up, the token mixers' sequence "
                             "work running between them; 0 launches those steps eagerly (default %(default)s)")
    parser.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto",
                        help="attention KV pool dtype: auto (the model dtype) or fp8 (float8 e4m3 with the "
                             "checkpoint's per-layer k_scale/v_scale, else 1.0; twice the tokens of bfloat16)")
    parser.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                        help="share cached prompt prefixes: attention blocks by content hash, GDN state from "
                             "checkpoints (default on; --no-enable-prefix-caching turns it off)")
    parser.add_argument("--prefix-checkpoint-slots", type=_positive_int, default=None, metavar="N",
                        help="GDN state checkpoints the prefix cache keeps (default: half of --max-num-seqs)")
    parser.add_argument("--prefix-checkpoint-interval", type=_non_negative_int,
                        default=DEFAULT_CHECKPOINT_INTERVAL_TOKENS, metavar="TOKENS",
                        help="also checkpoint long prompts every TOKENS tokens, a multiple of --block-size; 0: only "
                             "prompt ends, partings from a shared prefix and reply ends (default %(default)s)")
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N (default %(default)s)")
    parser.add_argument("--load-format", choices=("auto", "safetensors", "random", "dummy"), default="auto",
                        help="random (alias dummy): build seeded random weights for the folder's config.json in "
                             "device memory; the folder needs only config.json and the tokenizer (default %(default)s)")
    parser.add_argument("--seed", type=_bounded(int, 0, 2**63 - 1), default=0,
                        help="seed of sampling and of --load-format random weights (default %(default)s)")
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
    parser.add_argument("--engine-stall-timeout", type=_stall_seconds, default=DEFAULT_STALL_TIMEOUT_S, metavar="S",
                        help="liveness fails when the engine has work and makes no progress for this long; above "
                             "the longest prefill step and first-call compiles (default %(default)s)")
    parser.add_argument("--auth-token-file", default=None, metavar="F",
                        help="require `authorization: Bearer <token>` with the token in this file (health exempt)")
    parser.add_argument("--tls-cert", default=None, metavar="F", help="PEM certificate chain: serve gRPC and the HTTP API over TLS")
    parser.add_argument("--tls-key", default=None, metavar="F", help="PEM private key of --tls-cert")
    parser.add_argument("--http-port", type=_port, default=8000,
                        help="OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, /v1/models, "
                             "/health, /metrics); 0 turns it off (default %(default)s)")
    parser.add_argument("--served-model-name", default=None, metavar="NAME",
                        help="the model name the HTTP API answers to and metrics carry (default: the --model "
                             "folder's name)")
    parser.add_argument("--tool-call-parser", choices=TOOL_CALL_PARSERS, default=None,
                        help="read tool calls out of chat output: hermes (JSON in <tool_call>, Qwen3) or "
                             "qwen3_coder (XML <function=...>, Qwen3.5/3.6); default: tool calls are refused")
    parser.add_argument("--reasoning-parser", choices=REASONING_PARSERS, default=None,
                        help="return <think>...</think> as reasoning_content (qwen3); default: left in the content")
    parser.set_defaults(handler=_run_serve, extra="engine")


def _read_file(path: str, what: str, flag: str) -> bytes:

    try:
        with open(path, "rb") as handle:
            content = handle.read()
    except OSError as exc:
        raise UserError(f"{flag}: cannot read the {what} {path!r}: {exc.strerror}") from exc
    if not content.strip():
        raise UserError(f"{flag}: the {what} {path!r} is empty")
    return content


# The JSON files the server process itself reads (the tokenizer's end-of-sequence ids come from them).
_CHECKPOINT_JSON_FILES = ("config.json", "generation_config.json", "tokenizer_config.json")


def check_checkpoint_files(folder: str) -> None:
    """Reads the checkpoint's small JSON files and every safetensors header, so a corrupt or truncated file is a
    UserError naming it before any process starts (the headers are read without torch; no weights are loaded)."""
    from safetensors import SafetensorError, safe_open

    from hybridkv.sizing import read_config_file

    for name in _CHECKPOINT_JSON_FILES:
        path = os.path.join(folder, name)
        if os.path.exists(path):
            read_config_file(path)
    for name in sorted(os.listdir(folder)):
        if not name.endswith(".safetensors"):
            continue
        path = os.path.join(folder, name)
        try:
            with safe_open(path, framework="numpy"):
                pass
        except (SafetensorError, OSError) as exc:
            raise UserError(f"{path} is not a readable safetensors file ({exc}); rebuild or download the checkpoint "
                            "again") from None


def _check_can_listen(host: str, ports: list[tuple[str, int]]) -> None:
    """Binds and releases each port on --host, so an unknown address or a port in use is a UserError naming the flag
    before the engine process starts (0 asks for any free port, which checks the address alone)."""

    for flag, port in [("--host", 0), *ports]:
        try:
            family, kind, protocol, _, address = socket.getaddrinfo(
                host.strip("[]"), port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
        except socket.gaierror as exc:
            raise UserError(f"--host {host!r} is not an address of this machine: {exc.strerror}") from None
        with socket.socket(family, kind, protocol) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind(address)
            except OSError as exc:
                where = f"--host {host!r}" if flag == "--host" else f"{flag} {port} on {host}"
                raise UserError(f"cannot listen on {where}: {exc.strerror}; choose another") from None


def build_configs(args: argparse.Namespace):
    """EngineConfig and ServerConfig from the parsed flags; raises UserError naming the flag that cannot work."""
    from hybridkv.sidecar.core.config import LOAD_FORMAT_ALIASES, EngineConfig
    from hybridkv.sidecar.serving.server import ServerConfig, server_ssl_context

    if (args.tls_cert is None) != (args.tls_key is None):
        raise UserError("--tls-cert and --tls-key go together: pass both to serve TLS, or neither")
    ports = {"--port": args.port, "--metrics-port": args.metrics_port, "--http-port": args.http_port}
    if args.served_model_name is not None and not 0 < len(args.served_model_name) <= 256:
        raise UserError("--served-model-name must be 1 to 256 characters")
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
        try:
            token = _read_file(args.auth_token_file, "auth token file", "--auth-token-file").decode("utf-8").strip()
        except UnicodeDecodeError:
            raise UserError("--auth-token-file: the token must be UTF-8 text") from None
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
        max_prefill_tokens_with_decodes=args.max_prefill_tokens_with_decodes,
        min_prefill_tokens_with_decodes=args.min_prefill_tokens_with_decodes,
        max_prefill_wait_steps=args.max_prefill_wait_steps,
        target_tpot_ms=args.target_tpot_ms,
        piecewise_cuda_graph_max_tokens=args.piecewise_cuda_graph_max_tokens,
        block_size=args.block_size,
        kv_cache_dtype=args.kv_cache_dtype,
        device=args.device,
        load_format=LOAD_FORMAT_ALIASES.get(args.load_format, args.load_format),
        seed=args.seed,
        enable_prefix_caching=args.enable_prefix_caching,
        prefix_checkpoint_slots=args.prefix_checkpoint_slots,
        prefix_checkpoint_interval=args.prefix_checkpoint_interval,
    )
    engine_config.validate()
    check_checkpoint_files(args.model)
    _check_can_listen(args.host, bound)
    server_config = ServerConfig(
        host=args.host,
        port=args.port,
        metrics_port=args.metrics_port,
        health_port=args.health_port,
        max_queue=args.max_queue,
        grace_period_s=args.grace_period_s,
        stall_timeout_s=args.engine_stall_timeout,
        auth_token=token,
        tls_cert_pem=None if args.tls_cert is None else _read_file(args.tls_cert, "TLS certificate", "--tls-cert"),
        tls_key_pem=None if args.tls_key is None else _read_file(args.tls_key, "TLS key", "--tls-key"),
        http_port=args.http_port,
        served_model_name=args.served_model_name,
        tool_call_parser=args.tool_call_parser,
        reasoning_parser=args.reasoning_parser,
    )
    if server_config.tls:  # a certificate and key that do not load, or do not match, stop here, not at start-up
        server_ssl_context(server_config.tls_cert_pem, server_config.tls_key_pem)
    return engine_config, server_config


def _run_serve(args: argparse.Namespace) -> int:
    import asyncio
    import logging

    from hybridkv.sidecar import configure_logging
    from hybridkv.sidecar.serving.server import serve

    engine_config, server_config = build_configs(args)
    configure_logging(logging.INFO)
    asyncio.run(serve(engine_config, server_config))
    return 0
