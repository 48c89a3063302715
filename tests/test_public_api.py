"""The public surface other checks rely on: names, signatures, errors, the command line."""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest

import selzero_plugin
from selzero_plugin import errors

PUBLIC_METHODS = ["no_sync", "end_microstep", "reduce_gradients", "grad_norm_squared",
                  "scale_gradients_", "step", "sync_from_params", "memory_report"]
PUBLIC_ATTRIBUTES = ["selected_names", "trainable_names", "rank", "world_size",
                     "state_parameter_count"]


def test_documented_imports_work():
    from selzero_plugin import (SelectedZero2, SelZeroConfig, StepResult, clip_grad_norm_,
                                wrap_ddp)

    assert inspect.isclass(SelectedZero2) and inspect.isclass(SelZeroConfig)
    assert dataclasses.is_dataclass(StepResult)
    assert callable(wrap_ddp) and callable(clip_grad_norm_)


def test_every_name_in_dunder_all_exists():
    for name in selzero_plugin.__all__:
        assert hasattr(selzero_plugin, name), name


def test_every_error_class_is_a_value_error():
    classes = [getattr(errors, name) for name in errors.__all__]
    assert len(classes) >= 9
    for cls in classes:
        assert issubclass(cls, errors.SelZeroError), cls
        assert issubclass(cls, ValueError), cls
        assert getattr(selzero_plugin, cls.__name__) is cls, f"{cls.__name__} not exported"


def test_no_module_defines_an_error_outside_errors_py():
    """A user mistake raised from any module is catchable as ValueError: every exception class
    the package defines lives in errors.py, which makes them all SelZeroError subclasses."""
    package = Path(selzero_plugin.__file__).parent
    for info in pkgutil.iter_modules([str(package)]):
        module = importlib.import_module(f"selzero_plugin.{info.name}")
        for name, obj in vars(module).items():
            if inspect.isclass(obj) and issubclass(obj, BaseException) \
                    and obj.__module__ == module.__name__:
                assert module is errors, f"{module.__name__}.{name} defined outside errors.py"


def test_step_result_has_the_documented_fields():
    from selzero_plugin import MemoryReport, StepResult

    assert [f.name for f in dataclasses.fields(StepResult)] == [
        "global_weight", "updated", "skipped_absent", "skipped_nonfinite", "presence"]
    assert StepResult(2, 8, 0, 0) == StepResult(2, 8, 0, 0, (1, 2))  # compared by the counts
    assert StepResult(2, 8, 0, 0).expert_presence == {} and StepResult(2, 8, 0, 0).dead_experts == 0
    assert {"grad_shard", "optimizer_state", "master", "total", "ideal_total"} <= {
        f.name for f in dataclasses.fields(MemoryReport)}


def test_selected_zero2_signature_and_methods():
    from selzero_plugin import SelectedZero2

    params = inspect.signature(SelectedZero2.__init__).parameters
    assert list(params)[:5] == ["self", "model", "config", "optimizer", "optimizer_kwargs"]
    assert params["group"].kind is inspect.Parameter.KEYWORD_ONLY
    assert params["group"].default is None
    assert params["optimizer"].default is __import__("torch").optim.AdamW
    for name in PUBLIC_METHODS:
        assert callable(getattr(SelectedZero2, name, None)), name
    for name in PUBLIC_ATTRIBUTES:
        assert isinstance(inspect.getattr_static(SelectedZero2, name, None), property), name
    step = inspect.signature(SelectedZero2.step).parameters
    assert [n for n in step if n != "self"] == ["lr", "weight", "active"]
    reduce = inspect.signature(SelectedZero2.reduce_gradients).parameters
    assert [n for n in reduce if n != "self"] == ["weight", "active"]


def test_config_defaults_are_the_documented_ones():
    from selzero_plugin import SelZeroConfig

    config = SelZeroConfig(params=["*.experts.*"])
    assert config.to_dict() == {
        "params": ["*.experts.*"], "modules": [], "reduction": "mean", "normalize_over": "group",
        "missing_grad": "zero", "nonfinite": "error", "expert_dim": None, "bucket_mb": 25.0,
        "param_groups": [], "partition": "chunks", "extra_elementwise_optimizers": [],
        "extra_matrix_optimizers": [], "timeout_s": 600.0,
        "name": "selected_zero2", "broadcast": True,
        "overlap": True, "launch_modules": []}


def test_config_without_params_is_refused():
    from selzero_plugin import ConfigError, SelZeroConfig

    with pytest.raises(TypeError):
        SelZeroConfig()  # type: ignore[call-arg]
    with pytest.raises(ConfigError, match="'params' is required"):
        SelZeroConfig.from_dict({})


def _run(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(argv), capture_output=True, text=True, timeout=120)


def test_python_dash_m_cli_help_works():
    proc = _run(sys.executable, "-m", "selzero_plugin.cli", "--help")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("usage: selzero")
    assert "demo" in proc.stdout


def test_selzero_console_script_help_works():
    script = Path(sys.executable).parent / "selzero"
    assert script.exists(), "the `selzero` console script is not installed (pip install -e .)"
    proc = _run(str(script), "--help")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == _run(sys.executable, "-m", "selzero_plugin.cli", "--help").stdout


def test_cli_without_a_command_fails_with_usage():
    proc = _run(sys.executable, "-m", "selzero_plugin.cli")
    assert proc.returncode != 0
    assert "usage: selzero" in proc.stderr
