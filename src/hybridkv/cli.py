"""The `hybridkv` command.

Each component registers its own subcommands through a `register(subparsers)` function in its `cli` module.
Registration imports only argparse-level code; heavy dependencies (torch, kopf) are imported by the handler
when the subcommand runs, so the torch-free install (sizing, api, operator) still has a working command.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from hybridkv import __version__
from hybridkv.errors import UserError

# Component CLI modules, in the order their subcommands appear in --help.
_COMPONENT_CLIS = (
    "hybridkv.demo",
    "hybridkv.sizing.cli",
    "hybridkv.sidecar.cli",
    "hybridkv.api.cli",
    "hybridkv.operator.cli",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hybridkv",
        description="Plan, run and operate hybrid (Gated DeltaNet + attention) LLM serving with honest KV capacity.",
    )
    parser.add_argument("--version", action="version", version=f"hybridkv {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module_name in _COMPONENT_CLIS:
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            # A component whose optional dependencies are not installed registers nothing.
            if exc.name and (exc.name == module_name or module_name.startswith(exc.name + ".")):
                continue
            raise
        module.register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    # Child interpreters (the engine process, tensor-parallel workers, a local sidecar) start with `-c`, which puts
    # the current directory first on sys.path; from a checkout of this repository ./operator/ would then shadow the
    # standard library's `operator` before any of our code runs.
    os.environ.setdefault("PYTHONSAFEPATH", "1")
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "handler", None):
        parser.print_help()
        return 2
    try:
        return int(args.handler(args) or 0)
    except UserError as exc:
        print(f"hybridkv {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # The reader went away (`hybridkv plan | head`): not an error of ours; keep Python from reporting it at exit.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    raise SystemExit(main())
