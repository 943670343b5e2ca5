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


def _wrapped_kernel(pre_hook=None):
    """A JIT function under a heuristic and a two-config autotuner, the way fla wraps its kernels."""
    import triton
    from triton.runtime.jit import JITFunction

    def kernel(x, n, USE_X, BLOCK):
        pass

    configs = [triton.Config({"BLOCK": 16}, num_warps=2), triton.Config({"BLOCK": 64}, num_warps=4, pre_hook=pre_hook)]
    jit = JITFunction(kernel)
    return jit, triton.heuristics({"USE_X": lambda args: args["x"] is not None})(
        triton.autotune(configs=configs, key=["n"])(jit)), configs


def test_tuned_launches_go_past_the_wrappers_with_what_they_settled(monkeypatch):
    """The first launch of a key runs through the heuristic and the autotuner; later ones call the JIT function with
    the heuristic's value and the configuration the autotuner ran with, the same arguments the wrappers would add."""
    from triton.runtime import autotuner
    from triton.runtime.jit import JITFunction

    jit, kernel, configs = _wrapped_kernel()
    through_wrappers, direct = [], []

    def tuner_run(tuner, *args, **kwargs):  # the autotuner's pick, as a run that benchmarked would leave it
        tuner.best_config = configs[1]
        through_wrappers.append(kwargs)

    monkeypatch.setattr(autotuner.Autotuner, "run", tuner_run)
    monkeypatch.setattr(JITFunction, "run", lambda fn, *args, grid, warmup, **kwargs: direct.append((fn, grid, kwargs)))
    monkeypatch.setattr(fla_adapter, "_SETTLED", {})
    fla_adapter._launch_tuned(kernel, (3, 1), ("key",), x=1.0, n=8)
    assert len(through_wrappers) == 1 and through_wrappers[0]["USE_X"] is True and not direct
    fla_adapter._launch_tuned(kernel, (3, 1), ("key",), x=2.0, n=9)
    assert len(through_wrappers) == 1
    fn, grid, kwargs = direct[0]
    assert fn is jit and grid == (3, 1)
    assert kwargs == {"x": 2.0, "n": 9, "USE_X": True, **configs[1].all_kwargs()}
    assert kwargs["BLOCK"] == 64 and kwargs["num_warps"] == 4
    # Another key settles on its own first launch.
    fla_adapter._launch_tuned(kernel, (3, 1), ("other key",), x=None, n=8)
    assert len(through_wrappers) == 2 and through_wrappers[1]["USE_X"] is False


def test_a_configuration_with_a_hook_keeps_every_launch_in_the_wrappers(monkeypatch):
    from triton.runtime import autotuner
    from triton.runtime.jit import JITFunction

    _, kernel, configs = _wrapped_kernel(pre_hook=lambda args: None)
    through_wrappers = []

    def tuner_run(tuner, *args, **kwargs):
        tuner.best_config = configs[1]
        through_wrappers.append(kwargs)

    monkeypatch.setattr(autotuner.Autotuner, "run", tuner_run)
    monkeypatch.setattr(JITFunction, "run", lambda *args, **kwargs: pytest.fail("launched past the wrappers"))
    monkeypatch.setattr(fla_adapter, "_SETTLED", {})
    for _ in range(3):
        fla_adapter._launch_tuned(kernel, (1,), ("key",), x=1.0, n=8)
    assert len(through_wrappers) == 3
