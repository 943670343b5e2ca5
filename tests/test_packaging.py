"""The wheel builds without a setuptools warning and ships every module and data file of the mapped folders."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# What a package folder holds that the wheel must carry: code, type stubs, the proto and the bundled data.
SHIPPED_SUFFIXES = (".py", ".pyi", ".proto", ".json", ".yaml")


def test_the_wheel_builds_warning_free_and_holds_every_package_and_data_file(tmp_path):
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    package_dirs = project["tool"]["setuptools"]["package-dir"]
    # Only what the build reads, so build outputs never land in the checkout.
    source = tmp_path / "source"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    for folder in package_dirs.values():
        shutil.copytree(ROOT / folder, source / folder, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    # -P: the source folder's `kernels/` must not shadow an installed package of that name (Hugging Face's, which
    # transformers depends on, registers a setuptools egg_info writer that the build imports).
    build = subprocess.run(
        [sys.executable, "-P", "-W", "error", "-c",
         "import sys; from setuptools import build_meta; print(build_meta.build_wheel(sys.argv[1]))",
         str(tmp_path / "dist")],
        cwd=source, capture_output=True, text=True, timeout=120,
    )
    assert build.returncode == 0, build.stderr[-3000:]
    assert "Warning" not in build.stderr, build.stderr[-3000:]
    wheel = tmp_path / "dist" / build.stdout.strip().splitlines()[-1]
    shipped = set(zipfile.ZipFile(wheel).namelist())

    expected = set()
    for package, folder in package_dirs.items():
        # A mapped folder nested in another (none today) would be listed twice; the set keeps each file once.
        for path in (source / folder).rglob("*"):
            if path.suffix in SHIPPED_SUFFIXES and "__pycache__" not in path.parts:
                expected.add("/".join([*package.split("."), *path.relative_to(source / folder).parts]))
    assert expected - shipped == set()
    for data_file in ("hybridkv/sizing/data/models.json", "hybridkv/sizing/data/gpus.json",
                      "hybridkv/sizing/data/qwen3.5-4b-h200.yaml", "hybridkv/api/hybridkv/v1/generation.proto",
                      "hybridkv/api/generation_pb2.pyi", "hybridkv/sidecar/serving/server.py"):
        assert data_file in shipped
    metadata = zipfile.ZipFile(wheel).read(next(name for name in shipped if name.endswith("METADATA"))).decode()
    assert "License-Expression: Apache-2.0" in metadata
    assert 'Requires-Dist: numpy>=1.26; extra == "engine"' in metadata
