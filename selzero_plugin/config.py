"""SelZeroConfig: what to select and how to reduce it.

Each value is resolved once: an explicit argument (``SelZeroConfig(...)`` / ``from_dict``), a file
(``from_file``, or the path in ``SELZERO_CONFIG``), then ``SELZERO_<FIELD>`` variables
(``from_env``), then the defaults below. Environment variables are read here and nowhere else.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import os
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from .errors import ConfigError

__all__ = ["SelZeroConfig", "REDUCTIONS", "NORMALIZE_OVER", "MISSING_GRAD", "NONFINITE",
           "PARTITIONS"]

REDUCTIONS = ("mean", "weighted", "sum")
NORMALIZE_OVER = ("group", "world")
MISSING_GRAD = ("zero", "error", "skip")
NONFINITE = ("error", "skip")
PARTITIONS = ("chunks", "tensors")
ENV_PREFIX = "SELZERO_"
ENV_CONFIG_FILE = "SELZERO_CONFIG"
ENV_LOG_LEVEL = "SELZERO_LOG_LEVEL"  # selzero_plugin/log.py, not a field
ENV_GLOO_REDUCE = "SELZERO_GLOO_REDUCE"  # core/p2p.py ([Note: p2p reduce-scatter]), not a field


@dataclass(frozen=True, kw_only=True)
class SelZeroConfig:
    params: list[str]
    """fnmatch globs over parameter names (``"*.experts.*"``); ``"re:<regex>"`` for a regex."""
    modules: list[str] = field(default_factory=list)
    """Module class names (``"MixtralExperts"``) whose direct and nested parameters are selected too."""
    reduction: str = "mean"
    """``mean``: divide by the group size (beside DDP / Accelerate / the HF Trainer);
    ``weighted``: divide by the all-reduced ``step(weight=...)``; ``sum``: no division."""
    normalize_over: Any = "group"
    """The ranks the loss is averaged over: ``group`` (selzero's group), ``world``, a process
    group or a list of global ranks (stored as the sorted list). Under expert parallelism expert
    gradients arrive summed over the expert-parallel ranks, so the mean is over the
    data-parallel ranks: the world, or under pipeline parallelism a group of the stage."""
    missing_grad: str = "zero"
    """A parameter without gradient on some ranks: ``zero`` (they contribute zeros), ``error``, ``skip``."""
    nonfinite: str = "error"
    """inf/NaN in a reduced gradient: ``error`` (names the parameters) or ``skip`` (no update)."""
    expert_dim: int | None = None
    """``0``: treat fused expert tensors ``(E, ...)`` as E virtual parameters (see selection.py)."""
    bucket_mb: float = 25.0
    """Size of a communication bucket in MiB of FP32 gradient."""
    param_groups: list[dict[str, Any]] = field(default_factory=list)
    """Hyperparameter overrides: ``[{"params": ["*.bias"], "weight_decay": 0.0}]``; first match
    wins. A group may name its own optimizer class (``"optimizer": "torch.optim.AdamW"``): its
    parameters then run that optimizer with the group's hyperparameters alone (the class's
    defaults for the rest), e.g. AdamW for biases and norms beside Muon for the matrices."""
    partition: str = "chunks"
    """How the subset is split over the group. ``chunks``: every (virtual) parameter in N equal
    flat chunks (elementwise optimizers only). ``tensors``: each group rank owns whole (virtual)
    parameters, planned so that the optimizer's work per rank is balanced; admits matrix-wise
    optimizers (``torch.optim.Muon``, ``torch.optim.Adafactor``, ``extra_matrix_optimizers``)."""
    extra_elementwise_optimizers: list[str] = field(default_factory=list)
    """Qualified class names (``"lion_pytorch.Lion"``) admitted as elementwise optimizers."""
    extra_matrix_optimizers: list[str] = field(default_factory=list)
    """Qualified class names admitted, under ``partition="tensors"``, as optimizers that need
    whole tensors (a third-party Muon or Shampoo); each owner runs it on whole (virtual)
    parameters."""
    timeout_s: float = 600.0
    """Timeout of selzero's own communicator."""
    name: str = "selected_zero2"
    """Instance name: logs and checkpoint sub-folders."""
    broadcast: bool = True
    """Broadcast the selected parameters from group rank 0 at construction."""
    overlap: bool = True
    """Launch reduce-scatters during backward at the launch points (DESIGN.md); ``False``:
    every bucket at the reduction point, strictly after the host's own collectives."""
    launch_modules: list[str] = field(default_factory=list)
    """Globs over module names: the launch unit of a selected parameter is the outermost matching
    module that contains it (default: the block that holds an ``experts`` container, a fused
    experts module itself, else the parameter's own module)."""

    def __post_init__(self) -> None:
        _check_str_list("params", self.params)
        _check_str_list("modules", self.modules)
        _check_str_list("extra_elementwise_optimizers", self.extra_elementwise_optimizers)
        _check_str_list("extra_matrix_optimizers", self.extra_matrix_optimizers)
        _check_choice("partition", self.partition, PARTITIONS)
        _check_str_list("launch_modules", self.launch_modules)
        _check_choice("reduction", self.reduction, REDUCTIONS)
        object.__setattr__(self, "normalize_over", _normalize_over(self.normalize_over))
        _check_choice("missing_grad", self.missing_grad, MISSING_GRAD)
        _check_choice("nonfinite", self.nonfinite, NONFINITE)
        if self.expert_dim is not None and (isinstance(self.expert_dim, bool) or self.expert_dim != 0):
            raise ConfigError(
                f"expert_dim={self.expert_dim!r}: only 0 (experts stacked on the first dim, as in "
                "transformers 5) or None is supported; set expert_dim=0 or leave it unset."
            )
        _check_positive("bucket_mb", self.bucket_mb)
        _check_positive("timeout_s", self.timeout_s)
        if not isinstance(self.name, str) or not self.name or "/" in self.name:
            raise ConfigError(f"name={self.name!r}: expected a non-empty string without '/'.")
        for flag in ("broadcast", "overlap"):
            if not isinstance(getattr(self, flag), bool):
                raise ConfigError(f"{flag}={getattr(self, flag)!r}: expected true or false.")
        _check_param_groups(self.param_groups)
        for pattern in self.params:
            _check_pattern(pattern)

    @property
    def launches_in_backward(self) -> bool:
        """Do buckets launch (and finish) during the backward? ``overlap``, except under
        ``reduction="sum"``, whose ranks' ``active`` flags are known only at the reduction
        point (every bucket launches there)."""
        return self.overlap and self.reduction != "sum"

    # ---- builders -------------------------------------------------------------------------

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "SelZeroConfig":
        """Build from a mapping; unknown keys are refused naming the closest valid one."""
        if not isinstance(d, Mapping):
            raise ConfigError(f"selzero config: expected a mapping of fields, got {type(d).__name__}.")
        valid = [f.name for f in dataclasses.fields(cls)]
        for key in d:
            if key not in valid:
                raise ConfigError(f"selzero config: unknown key {key!r}{_did_you_mean(key, valid)}. "
                                  f"Valid keys: {', '.join(valid)}.")
        if "params" not in d:
            raise ConfigError("selzero config: 'params' is required (e.g. params: ['*.experts.*']).")
        return cls(**dict(d))

    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> "SelZeroConfig":
        """Build from a JSON or YAML file: the fields themselves, or a ``selected_zero2`` block."""
        return cls.from_dict(_read_file(Path(path)))

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> "SelZeroConfig":
        """Build from ``SELZERO_CONFIG`` (a file) overridden by ``SELZERO_<FIELD>`` variables."""
        env = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        if env.get(ENV_CONFIG_FILE):
            values.update(_read_file(Path(env[ENV_CONFIG_FILE])))
        fields = {f.name: f for f in dataclasses.fields(cls)}
        env_names = [ENV_PREFIX + n.upper() for n in fields] + [ENV_CONFIG_FILE]
        for var, raw in env.items():
            if not var.startswith(ENV_PREFIX) or \
                    var in (ENV_CONFIG_FILE, ENV_LOG_LEVEL, ENV_GLOO_REDUCE):
                continue
            name = var[len(ENV_PREFIX):].lower()
            if name not in fields:  # another tool's variable, or a typo: say so, go on
                warnings.warn(f"environment variable {var} starts with {ENV_PREFIX} but is not a "
                              f"selzero field{_did_you_mean(var, env_names)}; it is ignored.",
                              stacklevel=2)
                continue
            values[name] = _parse_env_value(var, name, raw)
        if not values:
            raise ConfigError(f"selzero config from the environment: neither {ENV_CONFIG_FILE} nor any "
                              f"SELZERO_<FIELD> variable is set (at least SELZERO_PARAMS is needed).")
        return cls.from_dict(values)

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able dict (round-trips through ``from_dict``)."""
        return json.loads(json.dumps(dataclasses.asdict(self)))


# ---- validation helpers -------------------------------------------------------------------


def _did_you_mean(key: str, valid: list[str]) -> str:
    close = difflib.get_close_matches(key, valid, n=1, cutoff=0.5)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _check_str_list(name: str, value: Any) -> None:
    if isinstance(value, str) or not isinstance(value, (list, tuple)) or not all(
        isinstance(v, str) and v for v in value
    ):
        raise ConfigError(f"{name}={value!r}: expected a list of non-empty strings, "
                          f"e.g. {name}=['*.experts.*'].")


def _normalize_over(value: Any) -> str | list[int]:
    """A choice, or the sorted global ranks of a process group or list."""
    if isinstance(value, str):
        _check_choice("normalize_over", value, NORMALIZE_OVER)
        return value
    if not isinstance(value, (list, tuple)) and type(value).__name__ == "ProcessGroup":
        import torch.distributed as dist

        value = dist.get_process_group_ranks(value)
    if isinstance(value, (list, tuple)) and value and all(
            isinstance(r, int) and not isinstance(r, bool) and r >= 0 for r in value) \
            and len(set(value)) == len(value):
        return sorted(value)
    raise ConfigError(f"normalize_over={value!r}: expected 'group', 'world', a process group or a "
                      "non-empty list of distinct global ranks (e.g. [0, 1, 2, 3]).")


def _check_choice(name: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ConfigError(f"{name}={value!r}: expected one of {', '.join(map(repr, choices))}"
                          f"{_did_you_mean(str(value), list(choices))}.")


def _check_positive(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or value <= 0:
        raise ConfigError(f"{name}={value!r}: expected a positive finite number.")


def _check_pattern(pattern: str) -> None:
    if pattern.startswith("re:"):
        import re

        try:
            re.compile(pattern[3:])
        except re.error as e:
            raise ConfigError(f"params entry {pattern!r}: invalid regular expression ({e}).") from None


def _check_param_groups(groups: Any) -> None:
    if not isinstance(groups, (list, tuple)):
        raise ConfigError(f"param_groups={groups!r}: expected a list of dicts like "
                          "{'params': ['*.bias'], 'weight_decay': 0.0}.")
    for i, g in enumerate(groups):
        if not isinstance(g, Mapping) or "params" not in g:
            raise ConfigError(f"param_groups[{i}]={g!r}: expected a dict with a 'params' list of "
                              "globs and the hyperparameters to override.")
        _check_str_list(f"param_groups[{i}].params", g["params"])
        for pattern in g["params"]:
            _check_pattern(pattern)
        if "optimizer" in g and (not isinstance(g["optimizer"], str) or not g["optimizer"]):
            raise ConfigError(f"param_groups[{i}].optimizer={g['optimizer']!r}: expected the "
                              "optimizer's class name, e.g. 'torch.optim.AdamW' or 'AdamW'.")


def _read_file(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise ConfigError(f"selzero config file {str(path)!r} does not exist.")
    text = path.read_text()
    if path.suffix in (".yaml", ".yml"):
        import yaml

        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
            raise ConfigError(f"selzero config file {str(path)!r} is not valid YAML{where}: "
                              f"{getattr(e, 'problem', None) or e}. Fix the file (e.g. "
                              "params: [\"*.experts.*\"] on one line).") from None
    elif path.suffix == ".json":
        try:
            data = json.loads(text)
        except ValueError as e:
            raise ConfigError(f"selzero config file {str(path)!r} is not valid JSON: {e}. Fix "
                              "the file (JSON allows no comments or trailing commas).") from None
    else:
        raise ConfigError(f"selzero config file {str(path)!r}: expected a .json, .yaml or .yml file.")
    if isinstance(data, Mapping) and "selected_zero2" in data:
        data = data["selected_zero2"]
    if not isinstance(data, Mapping):
        raise ConfigError(f"selzero config file {str(path)!r}: expected a mapping of fields at the top "
                          "(or under 'selected_zero2').")
    return dict(data)


def _parse_env_value(var: str, name: str, raw: str) -> Any:
    if name in ("params", "modules", "param_groups", "extra_elementwise_optimizers",
                "extra_matrix_optimizers", "launch_modules") or \
            (name == "normalize_over" and raw.lstrip().startswith("[")):
        try:
            return json.loads(raw)
        except json.JSONDecodeError:
            raise ConfigError(f"{var}={raw!r}: expected a JSON list, e.g. {var}='[\"*.experts.*\"]'.") \
                from None
    if name in ("broadcast", "overlap"):
        if raw.lower() in ("1", "true", "yes"):
            return True
        if raw.lower() in ("0", "false", "no"):
            return False
        raise ConfigError(f"{var}={raw!r}: expected true or false.")
    if name == "expert_dim":
        if raw.lower() in ("", "none", "null"):
            return None
        return _number(var, raw, int)
    if name in ("bucket_mb", "timeout_s"):
        return _number(var, raw, float)
    return raw


def _number(var: str, raw: str, kind: type) -> Any:
    try:
        return kind(raw)
    except ValueError:
        raise ConfigError(f"{var}={raw!r}: expected {'an integer' if kind is int else 'a number'}.") \
            from None
