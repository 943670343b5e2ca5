"""`hybridkv generate`: stream a completion from a running sidecar to the terminal (torch-free)."""

from __future__ import annotations

import argparse

from hybridkv.cli import bounded

# The wire types' ranges (uint32 max_tokens, int32 top_k) and the server's seed range, [0, 2^63).
MAX_TOKENS_LIMIT = 2**32 - 1
TOP_K_LIMIT = 2**31 - 1
SEED_LIMIT = 2**63 - 1


def _target(text: str) -> str:
    """host:port with a port gRPC will dial as written (it wraps larger numbers modulo 65536)."""
    host, sep, port = text.rpartition(":")
    if not sep or not host or not (port.isascii() and port.isdigit() and 1 <= int(port) <= 65535):
        raise argparse.ArgumentTypeError(f"expected host:port with a port in [1, 65535], got {text!r}")
    return text


def _prompt(text: str) -> str:
    """The prompt as UTF-8 text (argv bytes that are not UTF-8 arrive as surrogate escapes)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise argparse.ArgumentTypeError("the prompt is not valid UTF-8 text") from None
    return text


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "generate",
        help="stream a completion from a running sidecar",
        description="Send one prompt to a hybridkv sidecar and print the generated text as it streams in.",
    )
    parser.add_argument("prompt", type=_prompt, help="prompt text")
    parser.add_argument("--target", type=_target, default="localhost:50051",
                        help="sidecar address host:port (default %(default)s)")
    parser.add_argument("--max-tokens", type=bounded(int, 1, MAX_TOKENS_LIMIT), default=64,
                        help="most tokens to generate (default %(default)s)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default %(default)s)")
    parser.add_argument("--top-k", type=bounded(int, 0, TOP_K_LIMIT), default=0,
                        help="0 keeps all tokens (default %(default)s)")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus mass in (0, 1] (default %(default)s)")
    parser.add_argument("--seed", type=bounded(int, 0, SEED_LIMIT), default=None, help="seed for reproducible sampling")
    parser.add_argument("--stop", action="append", default=[], metavar="TEXT", help="stop string (repeatable)")
    parser.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-sequence tokens")
    parser.add_argument("--timeout-s", type=bounded(float, 0.0, 86400.0, low_open=True, what="seconds"), default=None,
                        help="deadline of the call in seconds")
    parser.add_argument("--auth-token-file", default=None, help="file holding the sidecar's bearer token")
    parser.add_argument("--tls-ca", default=None, metavar="PEM", help="CA certificate: connect with TLS")
    parser.add_argument("--usage", action="store_true", help="print token counts and the finish reason at the end")
    parser.set_defaults(handler=_run_generate)


def _read_file(path: str | None, what: str, binary: bool = False):
    from hybridkv.errors import UserError

    if path is None:
        return None
    try:
        with open(path, "rb" if binary else "r", encoding=None if binary else "utf-8") as handle:
            return handle.read() if binary else handle.read().strip()
    except OSError as exc:
        raise UserError(f"cannot read the {what} {path!r}: {exc.strerror}; pass a readable file") from exc
    except UnicodeDecodeError:
        raise UserError(f"the {what} {path!r} is not UTF-8 text") from None


def _run_generate(args: argparse.Namespace) -> int:
    import sys

    import grpc

    from hybridkv.api.client import FINISH_REASON_NAMES, GenerationClient

    token = _read_file(args.auth_token_file, "auth token file")
    tls_ca = _read_file(args.tls_ca, "TLS CA certificate", binary=True)
    with GenerationClient(args.target, token=token, tls_ca=tls_ca) as client:
        try:
            last = None
            for response in client.generate(
                args.prompt,
                max_tokens=args.max_tokens,
                temperature=args.temperature,
                top_k=args.top_k,
                top_p=args.top_p,
                seed=args.seed,
                stop=args.stop,
                ignore_eos=args.ignore_eos,
                timeout_s=args.timeout_s,
            ):
                sys.stdout.write(response.text)
                sys.stdout.flush()
                last = response
            sys.stdout.write("\n")
        except grpc.RpcError as exc:
            print(f"hybridkv generate: error: {exc.code().name}: {exc.details()}", file=sys.stderr)
            return 1
    finish_reason = None if last is None else FINISH_REASON_NAMES[last.finish_reason]
    if args.usage and last is not None:
        print(
            f"[{finish_reason}] prompt_tokens={last.usage.prompt_tokens} "
            f"completion_tokens={last.usage.completion_tokens}",
            file=sys.stderr,
        )
    if finish_reason == "abort":
        # The server ended the stream early (a drain past its grace period): the text above is incomplete.
        print("hybridkv generate: error: the sidecar aborted the request before it finished", file=sys.stderr)
        return 1
    return 0
