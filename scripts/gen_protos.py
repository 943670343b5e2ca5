#!/usr/bin/env python3
"""Generates the committed Python stubs of protos/hybridkv/v1/*.proto, or checks them for drift (--check).

The stubs live flat in protos/ (the `hybridkv.api` package): protoc names their imports after the proto path
(`hybridkv.v1`), so that one import prefix is rewritten to `hybridkv.api`. The descriptors keep the proto path
`hybridkv/v1/<name>.proto`, which is what reflection serves.
"""

from __future__ import annotations

import argparse
import difflib
import sys
import tempfile
from pathlib import Path

PROTOS_DIR = Path(__file__).resolve().parent.parent / "protos"
PROTO_SUBDIR = Path("hybridkv") / "v1"
GENERATED_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")


def proto_files() -> list[Path]:
    return sorted((PROTOS_DIR / PROTO_SUBDIR).glob("*.proto"))


def generate(out_dir: Path) -> list[Path]:
    """Writes the stubs of every proto into out_dir (flat) and returns their paths, sorted."""
    from grpc_tools import protoc

    with tempfile.TemporaryDirectory() as raw_dir:
        raw_path = Path(raw_dir)
        proto_args = [str(path.relative_to(PROTOS_DIR)) for path in proto_files()]
        include_dir = Path(protoc.__file__).parent / "_proto"
        rc = protoc.main(
            [
                "grpc_tools.protoc",
                f"-I{PROTOS_DIR}",
                f"-I{include_dir}",
                f"--python_out={raw_path}",
                f"--pyi_out={raw_path}",
                f"--grpc_python_out={raw_path}",
                *proto_args,
            ]
        )
        if rc != 0:
            raise SystemExit(f"protoc failed with exit code {rc}")
        written = []
        for raw_file in sorted((raw_path / PROTO_SUBDIR).iterdir()):
            if not raw_file.name.endswith(GENERATED_SUFFIXES):
                continue
            text = raw_file.read_text()
            text = text.replace("from hybridkv.v1 import ", "from hybridkv.api import ")
            target = out_dir / raw_file.name
            target.write_text(text)
            written.append(target)
    return written


def committed_stubs() -> list[Path]:
    return sorted(path for path in PROTOS_DIR.iterdir() if path.name.endswith(GENERATED_SUFFIXES))


def check() -> list[str]:
    """Regenerates into a scratch folder and returns a unified diff against the committed stubs (empty: no drift)."""
    with tempfile.TemporaryDirectory() as scratch:
        fresh = {path.name: path.read_text() for path in generate(Path(scratch))}
    committed = {path.name: path.read_text() for path in committed_stubs()}
    diff: list[str] = []
    for name in sorted(set(fresh) | set(committed)):
        diff.extend(
            difflib.unified_diff(
                committed.get(name, "").splitlines(keepends=True),
                fresh.get(name, "").splitlines(keepends=True),
                fromfile=f"committed/{name}",
                tofile=f"regenerated/{name}",
            )
        )
    return diff


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail with a diff if the committed stubs are stale")
    args = parser.parse_args()
    if args.check:
        diff = check()
        if diff:
            sys.stdout.writelines(diff)
            print("\nstubs are stale: run scripts/gen_protos.py and commit the result", file=sys.stderr)
            return 1
        print("stubs match the protos")
        return 0
    for path in generate(PROTOS_DIR):
        print(f"wrote {path.relative_to(PROTOS_DIR.parent)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
