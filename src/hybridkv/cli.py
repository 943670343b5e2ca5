"""The `hybridkv` command.

Each component registers its own subcommands through a `register(subparsers)` function in its `cli` module.
Registration imports only argparse-level code; heavy dependencies (torch, kopf) are imported by the handler
when the subcommand runs, so the torch-free install (sizing, api, operator) still has a working command.
A subcommand that needs an optional extra says so with `parser.set_defaults(extra="engine")`: when that extra's
packages are not installed, the command stops with one line naming the `pip install` to run.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import os
import re
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


DISTRIBUTION = "hybridkv"
_REQUIREMENT_NAME = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)")
_EXTRA_MARKER = re.compile(r"""extra\s*==\s*["']([^"']+)["']""")


def bounded(kind: type, low: float, high: float | None = None, *, low_open: bool = False, what: str = ""):
    """An argparse type for an int or float in [low, high] ((low, high] with `low_open`); `what` names the value."""
    noun = what or ("an integer" if kind is int else "a number")
    shown = str if kind is int else "{:g}".format
    interval = f"{'(' if low_open else '['}{shown(low)}, {'inf)' if high is None else f'{shown(high)}]'}"

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {noun} in {interval}, got {text!r}") from None
        if (value != value or value < low or (low_open and value == low)  # value != value: NaN
                or (high is not None and value > high)):
            raise argparse.ArgumentTypeError(f"expected {noun} in {interval}, got {text}")
        return value

    return parse


def missing_extra_packages(extra: str) -> list[str]:
    """The distributions of hybridkv's `extra` that are not installed (none when hybridkv itself is not installed)."""
    try:
        requirements = importlib.metadata.requires(DISTRIBUTION) or []
    except importlib.metadata.PackageNotFoundError:
        return []
    missing = []
    for requirement in requirements:
        marker = _EXTRA_MARKER.search(requirement)
        name = _REQUIREMENT_NAME.match(requirement)
        if marker is None or marker.group(1) != extra or name is None or name.group(1) == DISTRIBUTION:
            continue
        try:
            importlib.metadata.distribution(name.group(1))
        except importlib.metadata.PackageNotFoundError:
            missing.append(name.group(1))
    return missing


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
    extra = getattr(args, "extra", None)
    missing = missing_extra_packages(extra) if extra else []
    if missing:
        print(f"hybridkv {args.command}: error: this command needs the {extra} extra ({', '.join(missing)} "
              f"missing): pip install '{DISTRIBUTION}[{extra}]'", file=sys.stderr)
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
