"""tp=1 engine decode throughput of several source trees of this repository, timed in one run on one GPU.

Comparing two revisions from two separate runs mixes the change with the machine, its clocks and its temperature;
here every tree runs on the same device, the same checkpoint and the same prompts, in rounds that alternate the
order (ABBA: before, after; after, before; ...) so slow drift cancels. Each tree is a plain source tree (see
scripts/revision-trees.sh) laid out like the repository; it gets an import tree of its own in a temporary folder, built
from its pyproject.toml the way scripts/gpu.sh builds one, and runs in a child process with that import tree first
on PYTHONPATH. The child stops if any hybridkv module it loads comes from elsewhere, starts one engine (tp=1), runs
a warm-up, then for each batch size B: B random prompts, greedy, eos ignored, timed by bench/throughput.py's
`run_engine` (decode tokens/s = tokens after every request has its first token / time from then to the last token).
The child only uses engine API present at both sides of the tensor-parallel change.

The checkpoint is written once, by this checkout's code, before any child starts. Reported per tree and batch size:
the median over rounds; per later tree, its ratio to the first tree in each round, median and range.

    scripts/revision-trees.sh before=COMMIT after=76c366a      # writes .revisions/{before,after}; docs/performance.md
    python bench/revisions.py --out revisions.json              # before vs after on the GPU, the defaults
    python bench/revisions.py --device cpu --tiny --batch-sizes 1,2 --prompt-len 16 --new-tokens 4 \\
        --max-num-seqs 4 --max-num-batched-tokens 64 --max-model-len 256          # CPU smoke run, figures meaningless
"""

from __future__ import annotations

import argparse
import collections
import importlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import tomllib
from pathlib import Path

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
DEFAULT_TREES = [f"before={REPO / '.revisions' / 'before'}", f"after={REPO / '.revisions' / 'after'}"]
WARMUP_BATCH = 2
WARMUP_NEW_TOKENS = 4
OUTPUT_TAIL_LINES = 40


# `python -P` leaves this script's folder off sys.path. throughput imports no hybridkv at module level, so the child
# may load it before it checks where its hybridkv comes from.
sys.path.insert(0, str(BENCH))
import throughput  # noqa: E402


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tree", action="append", metavar="NAME=DIR",
                        help="a source tree to time; repeat it; the first is the baseline of the ratios "
                        "(default: before=.revisions/before after=.revisions/after)")
    throughput.add_engine_args(parser, batch_sizes="1,16,64", max_num_seqs=64)
    parser.add_argument("--rounds", type=int, default=2, help="each round runs every tree once, order alternating")
    parser.add_argument("--out", default="revisions.json", help="where to write the results (JSON)")
    parser.add_argument("--child", nargs=2, metavar=("SPEC", "RESULT"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    return args


def parse_trees(specs: list[str]) -> list[tuple[str, Path]]:
    trees = []
    for spec in specs:
        name, sep, folder = spec.partition("=")
        if not sep or not name or not folder:
            raise SystemExit(f"--tree takes NAME=DIR, got {spec!r}")
        path = Path(folder).resolve()
        if not (path / "pyproject.toml").is_file():
            raise SystemExit(f"tree {name}: {path} is not a source tree of this repository (no pyproject.toml); "
                             "prepare it with scripts/revision-trees.sh")
        trees.append((name, path))
    names = [name for name, _ in trees]
    if len(set(names)) != len(names):
        raise SystemExit(f"tree names must differ: {names}")
    return trees


def build_import_tree(source: Path, into: Path) -> Path:
    """What pip would install from `source`, as scripts/gpu.sh builds it: the top package copied, each mapped
    component folder linked under its package name. The mapping is the tree's own pyproject.toml `package-dir`."""
    with open(source / "pyproject.toml", "rb") as handle:
        package_dir = tomllib.load(handle)["tool"]["setuptools"]["package-dir"]
    shutil.copytree(source / package_dir["hybridkv"], into / "hybridkv")
    for package, folder in package_dir.items():
        if package == "hybridkv":
            continue
        top, _, sub = package.partition(".")
        if top != "hybridkv" or not sub or "." in sub or not (source / folder).is_dir():
            raise SystemExit(f"{source}: cannot map package {package!r} to {folder!r}")
        (into / "hybridkv" / sub).symlink_to(source / folder, target_is_directory=True)
    return into


def run_child(name: str, spec: dict, workdir: Path) -> dict:
    """One engine start of one tree in a fresh interpreter; its output is echoed with the tree's name in front."""
    spec_path, result_path = workdir / f"{name}-spec.json", workdir / f"{name}-result.json"
    spec_path.write_text(json.dumps(spec))
    result_path.unlink(missing_ok=True)
    env = dict(os.environ, PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join(p for p in (spec["import_tree"], os.environ.get("PYTHONPATH")) if p))
    started = time.perf_counter()
    tail: collections.deque[str] = collections.deque(maxlen=OUTPUT_TAIL_LINES)
    with subprocess.Popen([sys.executable, "-P", str(Path(__file__).resolve()), "--child", str(spec_path),
                           str(result_path)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True) as child:
        for line in child.stdout:
            tail.append(line.rstrip("\n"))
            print(f"  [{name}] {tail[-1]}", flush=True)
    wall_s = time.perf_counter() - started
    if child.returncode != 0 or not result_path.is_file():
        return {"tree": name, "returncode": child.returncode, "wall_s": wall_s, "output_tail": list(tail)}
    return {**json.loads(result_path.read_text()), "wall_s": wall_s}


def check_modules_from(import_tree: str) -> None:
    """Exit if a loaded hybridkv module lies outside `import_tree`. A tree that lacks a module its code imports must
    fail, not borrow it: an editable install's finder would otherwise supply the current checkout's copy."""
    foreign = []
    for name, module in list(sys.modules.items()):
        if name != "hybridkv" and not name.startswith("hybridkv."):
            continue
        places = [module.__file__] if getattr(module, "__file__", None) else list(getattr(module, "__path__", []))
        foreign += [f"{name} ({place})" for place in places
                    if not os.path.abspath(place).startswith(import_tree + os.sep)]
    if foreign:
        raise SystemExit(f"hybridkv modules not from this tree's {import_tree}: {', '.join(foreign)}")


def child_main(spec_path: str, result_path: str) -> int:
    """Runs in the child: every hybridkv module it loads must come from the spec's import tree."""
    spec = json.loads(Path(spec_path).read_text())
    import hybridkv

    import_tree = os.path.abspath(spec["import_tree"])
    print(f"hybridkv from {hybridkv.__file__}")
    import torch

    # Trees from before the sidecar's split into subpackages keep the engine at the top of the sidecar.
    # (Asked of the tree's folder: an installed hybridkv's import hook would answer for a module the tree lacks.)
    sidecar_dir = Path(importlib.import_module("hybridkv.sidecar").__file__).parent
    layout = "hybridkv.sidecar.core" if (sidecar_dir / "core").is_dir() else "hybridkv.sidecar"
    engine_module = importlib.import_module(f"{layout}.engine")
    EngineConfig = importlib.import_module(f"{layout}.config").EngineConfig
    Engine = engine_module.Engine

    check_modules_from(import_tree)
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    settings = spec["settings"]
    started = time.perf_counter()
    engine = Engine(EngineConfig(
        model=spec["checkpoint"], device=settings["device"], max_num_seqs=settings["max_num_seqs"],
        max_num_batched_tokens=settings["max_num_batched_tokens"], max_model_len=settings["max_model_len"],
        gpu_memory_utilization=settings["gpu_memory_utilization"],
    ))
    startup_s = time.perf_counter() - started
    print(f"engine start-up {startup_s:.1f} s")
    throughput.run_engine(engine, spec["warmup_prompts"], WARMUP_NEW_TOKENS)  # first-call compiles, off the clock
    rows = []
    for batch in settings["batch_sizes"]:
        row = throughput.run_engine(engine, spec["prompts"][str(batch)], settings["new_tokens"])
        rows.append(row)
        print(f"batch {batch}: decode {row['decode_tokens_per_s']:.1f} tok/s, {row['decode_ms_per_step']:.2f} ms/step")
    check_modules_from(import_tree)  # again: the engine may import modules lazily
    on_cuda = settings["device"].startswith("cuda")
    result = {
        "tree": spec["name"],
        "import_tree": import_tree,
        "hybridkv_file": os.path.abspath(hybridkv.__file__),
        "engine_file": os.path.realpath(engine_module.__file__),
        "hybridkv_modules": sorted(name for name in sys.modules if name.split(".")[0] == "hybridkv"),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "triton": triton_version,
        "device": torch.cuda.get_device_name(settings["device"]) if on_cuda else "cpu",
        "startup_s": startup_s,
        "rows": rows,
    }
    Path(result_path).write_text(json.dumps(result))
    return 0


def summarize(names: list[str], rounds: list[dict], batch_sizes: list[int]) -> dict:
    """Per tree and batch size: median and range over rounds; per later tree, its ratio to the first tree within
    each round (the two ran minutes apart on the same device), median and range."""
    def stats(values: list[float]) -> dict:
        return {"median": statistics.median(values), "min": min(values), "max": max(values)}

    def per_round(tree: str, batch: int, key: str) -> list[float]:
        return [next(r for r in rnd["runs"][tree]["rows"] if r["batch"] == batch)[key] for rnd in rounds]

    summary = {}
    for batch in batch_sizes:
        entry = {"trees": {}, "ratios": {}}
        for name in names:
            entry["trees"][name] = {key: stats(per_round(name, batch, key))
                                    for key in ("decode_tokens_per_s", "decode_ms_per_step")}
        base = per_round(names[0], batch, "decode_tokens_per_s")
        for name in names[1:]:
            ratios = [value / ref for value, ref in zip(per_round(name, batch, "decode_tokens_per_s"), base)]
            entry["ratios"][f"{name}/{names[0]}"] = {**stats(ratios), "per_round": ratios}
        summary[str(batch)] = entry
    return summary


def print_table(result: dict) -> None:
    """A Markdown table, ready for docs/performance.md."""
    names = [tree["name"] for tree in result["trees"]]
    settings = result["settings"]
    machine = result["machine"]
    scale = " (tiny: scaled down, a smoke run)" if settings["tiny"] else ""
    revisions = ", ".join(f"{tree['name']} = {(tree['revision'] or 'no REVISION')[:12]}" for tree in result["trees"])
    print(f"\n{settings['model']}{scale}, random bf16 weights, tp=1, {machine['device']}, torch {machine['torch']}, "
          f"triton {machine['triton']}; prompt {settings['prompt_len']}, {settings['new_tokens']} new tokens, greedy; "
          f"{len(result['rounds'])} round(s), order alternating; {revisions}; `{result['command']}`\n")
    print("Decode tok/s and ms/step: median over rounds (min-max). Ratio: the tree's decode tok/s over "
          f"{names[0]}'s in the same round, median (min-max) over rounds.\n")
    ratios = [f"{name}/{names[0]}" for name in names[1:]]
    header = ([f"{name} tok/s" for name in names] + ratios + [f"{name} ms/step" for name in names])
    print("| batch | " + " | ".join(header) + " |")
    print("|---:|" + "---:|" * len(header))
    for batch, entry in result["summary"].items():
        def cell(figures: dict, digits: int) -> str:
            return f"{figures['median']:.{digits}f} ({figures['min']:.{digits}f}-{figures['max']:.{digits}f})"

        cells = ([cell(entry["trees"][name]["decode_tokens_per_s"], 0) for name in names]
                 + [cell(entry["ratios"][ratio], 3) for ratio in ratios]
                 + [cell(entry["trees"][name]["decode_ms_per_step"], 2) for name in names])
        print(f"| {batch} | " + " | ".join(cells) + " |")


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.child:
        return child_main(*args.child)
    trees = parse_trees(args.tree or DEFAULT_TREES)
    import torch

    from hybridkv.sizing import geometry_from_config

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("bench/revisions.py measures GPU throughput; no CUDA device is visible", file=sys.stderr)
        return 2
    folder = throughput.ensure_checkpoint(args)
    with open(os.path.join(folder, "config.json"), encoding="utf-8") as handle:
        vocab = geometry_from_config(json.load(handle)).vocab_size
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    # The same prompts as bench/throughput.py's for each batch size, and for every tree.
    prompts = {str(b): throughput.random_prompts(b, args.prompt_len, vocab, args.seed + b) for b in batch_sizes}
    warmup = throughput.random_prompts(WARMUP_BATCH, args.prompt_len, vocab, args.seed + WARMUP_BATCH)
    settings = {key: getattr(args, key) for key in ("model", "tiny", "device", "prompt_len", "new_tokens",
                                                   "max_num_seqs", "max_num_batched_tokens", "max_model_len",
                                                   "gpu_memory_utilization", "seed")}
    settings["batch_sizes"] = batch_sizes
    names = [name for name, _ in trees]
    result = {
        "command": " ".join([os.path.basename(sys.argv[0]), *sys.argv[1:]]),
        "machine": None,
        "settings": settings,
        "checkpoint": folder,
        "trees": [{"name": name, "path": str(path),
                   "revision": (path / "REVISION").read_text().strip() if (path / "REVISION").is_file() else None}
                  for name, path in trees],
        "rounds": [],
        "summary": None,
    }
    with tempfile.TemporaryDirectory(prefix="hybridkv-revisions-") as scratch:
        scratch = Path(scratch)
        import_trees = {name: build_import_tree(path, scratch / name) for name, path in trees}
        for index in range(args.rounds):
            order = names if index % 2 == 0 else names[::-1]
            print(f"round {index + 1} of {args.rounds}: {', '.join(order)}", flush=True)
            runs = {}
            result["rounds"].append({"round": index + 1, "order": order, "runs": runs})
            for name in order:
                spec = {"name": name, "source": str(dict(trees)[name]), "import_tree": str(import_trees[name]),
                        "checkpoint": folder, "settings": settings, "prompts": prompts, "warmup_prompts": warmup}
                runs[name] = run_child(name, spec, scratch)
                if "rows" not in runs[name]:
                    throughput.write_json(args.out, result)
                    print(f"tree {name} ({dict(trees)[name]}) failed in round {index + 1} with exit status "
                          f"{runs[name]['returncode']}; its output is above", file=sys.stderr)
                    return 1
                result["machine"] = result["machine"] or {key: runs[name][key]
                                                          for key in ("python", "torch", "triton", "device")}
                throughput.write_json(args.out, result)  # the rounds so far survive a run cut short
    result["summary"] = summarize(names, result["rounds"], batch_sizes)
    throughput.write_json(args.out, result)
    print_table(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
