"""`hybridkv make-model`, plus the sidecar's server subcommands from `hybridkv.sidecar.serving.cli` when present.

Only argparse-level code runs at import; torch and the model are imported when the command runs.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
from pathlib import Path

from hybridkv.errors import UserError

SERVER_CLI_MODULE = "hybridkv.sidecar.serving.cli"
MAX_OVERRIDES = 64


def _parse_override(text: str) -> tuple[str, object]:
    """`key=value`; the value is read as JSON (numbers, true/false, lists), else kept as a string."""
    key, sep, raw = text.partition("=")
    if not sep or not key.strip():
        raise argparse.ArgumentTypeError(f"expected key=value, got {text!r}")
    try:
        value = json.loads(raw)
    except json.JSONDecodeError:
        value = raw
    return key.strip(), value


def make_model_command(args: argparse.Namespace) -> int:
    from hybridkv.sidecar.random_checkpoint import make_model
    from hybridkv.sizing import read_config_file
    from hybridkv.sizing.geometry import catalog_entry

    if len(args.set) > MAX_OVERRIDES:
        raise UserError(f"at most {MAX_OVERRIDES} --set overrides are accepted, got {len(args.set)}")
    out = Path(args.out)
    if not args.force and ((out / "config.json").exists() or any(out.glob("*.safetensors"))):
        raise UserError(f"--out {args.out!r} already holds a checkpoint; pass --force to replace it, or choose "
                        "another folder")
    source = catalog_entry(args.catalog).config if args.catalog else read_config_file(args.config)
    try:
        folder = make_model(out, source, args.seed, tiny=args.tiny, overrides=dict(args.set), dtype=args.dtype,
                            max_shard_bytes=args.max_shard_mib * 1024 * 1024, quantize=args.quantize,
                            weights=not args.config_only)
    except OSError as exc:
        raise UserError(f"--out {args.out!r}: cannot write the checkpoint: {exc.strerror}; pass a writable "
                        "folder") from None
    weights_bytes = sum(path.stat().st_size for path in folder.glob("*.safetensors"))
    config = json.loads((folder / "config.json").read_text())
    weights = ("no weights (serve it with --load-format random)" if args.config_only
               else f"{weights_bytes / 2**20:.1f} MiB of weights, seed {args.seed}")
    print(
        f"wrote {folder}: hidden {config['hidden_size']}, {config['num_hidden_layers']} layers, vocab "
        f"{config['vocab_size']}, {config['dtype']}{', ' + args.quantize if args.quantize else ''}, {weights}"
    )
    return 0


def _output_folder(text: str) -> str:
    """An --out that names a folder: an empty one would write the checkpoint into the current directory."""
    if not text.strip():
        raise argparse.ArgumentTypeError("expected a folder to write, got an empty path")
    return text


def register(subparsers) -> None:
    from hybridkv.cli import bounded

    parser = subparsers.add_parser(
        "make-model",
        help="write a random-weight Qwen3.5/3.6 checkpoint with a tokenizer (tests, demo, benchmarks)",
        description="Write config.json, safetensors and a byte-level BPE tokenizer for a random-weight model. "
        "The same seed and options give identical files.",
    )
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--catalog", metavar="NAME", help="catalog model, e.g. qwen3.5-4b or Qwen/Qwen3.5-4B")
    source.add_argument("--config", metavar="FILE", help="a Hugging Face config.json")
    parser.add_argument("--out", required=True, type=_output_folder, metavar="DIR",
                        help="folder to write (created if missing)")
    parser.add_argument("--force", action="store_true", help="replace a checkpoint already in --out")
    parser.add_argument("--seed", type=bounded(int, 0, 2**63 - 1), default=0,
                        help="random seed of the weights (default 0)")
    parser.add_argument("--tiny", action="store_true",
                        help="scale down to a few MB: hidden 64, 4 layers, vocab 512 (then --set applies)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"),
                        help="stored weight dtype (default: the config's)")
    parser.add_argument("--quantize", choices=("fp8", "awq", "w4a16"),
                        help="store the projections as FP8 block-scaled, AWQ 4-bit or compressed-tensors W4A16")
    parser.add_argument("--set", type=_parse_override, action="append", default=[], metavar="KEY=VALUE",
                        help="override a config key; VALUE is JSON (e.g. --set num_hidden_layers=8)")
    parser.add_argument("--config-only", action="store_true",
                        help="write config.json and the tokenizer but no weights, for `serve --load-format random` "
                             "(which builds the weights this --seed would write)")
    parser.add_argument("--max-shard-mib", type=bounded(int, 1, 1024**2), default=4096, metavar="MIB",
                        help="split the weights into files of at most this size (default 4096)")
    parser.set_defaults(handler=make_model_command, extra="engine")
    # The server subcommands live in their own module; register them when it is installed.
    if importlib.util.find_spec(SERVER_CLI_MODULE) is not None:
        importlib.import_module(SERVER_CLI_MODULE).register(subparsers)
