"""The one module that calls fla's internals refuses an fla-core it was not tested with, by name, before any kernel
runs; the range it accepts is the one the package pins."""

from __future__ import annotations

import importlib
import importlib.metadata
import sys
import tomllib
from pathlib import Path

import pytest

pytest.importorskip("torch")

from hybridkv.errors import UserError  # noqa: E402
from hybridkv.kernels import fla_adapter  # noqa: E402

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"


@pytest.mark.parametrize("installed", ["0.6.0", "0.6", "0.6.4", "0.6.1+cu128"])
def test_supported_releases_are_accepted(installed):
    fla_adapter.check_fla_core_version(installed)


@pytest.mark.parametrize("installed", ["0.5.9", "0.7.0", "0.7.0rc1", "1.0.0", "nightly"])
def test_other_releases_are_refused_naming_installed_and_supported(installed):
    with pytest.raises(fla_adapter.FlaVersionError) as refused:
        fla_adapter.check_fla_core_version(installed)
    assert str(refused.value).startswith(f"fla-core {installed} is installed")
    assert "fla-core>=0.6.0,<0.7" in str(refused.value)
    assert isinstance(refused.value, UserError)


def test_a_missing_fla_core_says_how_to_install_it_or_avoid_it():
    with pytest.raises(fla_adapter.FlaVersionError, match="fla-core is not installed.*HYBRIDKV_KERNELS=reference"):
        fla_adapter.check_fla_core_version(None)


def test_importing_the_adapter_checks_the_installed_release(monkeypatch):
    real_version = importlib.metadata.version
    monkeypatch.setattr(importlib.metadata, "version",
                        lambda name: "0.7.1" if name == "fla-core" else real_version(name))
    monkeypatch.delitem(sys.modules, fla_adapter.__name__)  # restored after the test
    with pytest.raises(UserError, match=r"fla-core 0\.7\.1 is installed"):
        importlib.import_module(fla_adapter.__name__)


def test_the_package_pins_the_range_the_adapter_accepts():
    engine = tomllib.loads(PYPROJECT.read_text())["project"]["optional-dependencies"]["engine"]
    assert f"fla-core{fla_adapter.SUPPORTED_FLA_CORE}" in engine
