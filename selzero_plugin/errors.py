"""The package's error classes. Every user mistake raises one of these; all subclass ValueError."""

from __future__ import annotations

__all__ = [
    "SelZeroError",
    "ConfigError",
    "SelectionError",
    "ContractError",
    "OptimizerNotSupportedError",
    "UsageError",
    "MissingGradientError",
    "NonFiniteGradientError",
    "CheckpointError",
]


class SelZeroError(ValueError):
    """Base class of every error selzero raises for a user mistake."""


class ConfigError(SelZeroError):
    """A configuration value is invalid or unknown."""


class SelectionError(SelZeroError):
    """The selection cannot be applied to this model (crossing ties, bad dtype, ...)."""


class ContractError(SelZeroError):
    """Ranks of the group disagree on something they must agree on."""


class OptimizerNotSupportedError(SelZeroError):
    """The optimizer's update needs whole tensors and cannot run on flat shards."""


class UsageError(SelZeroError):
    """The phases of a step were called in an order that cannot work."""


class MissingGradientError(SelZeroError):
    """`missing_grad="error"` and a selected parameter got no gradient on some rank."""


class NonFiniteGradientError(SelZeroError):
    """`nonfinite="error"` and a reduced gradient holds inf or NaN."""


class CheckpointError(SelZeroError):
    """A checkpoint is missing, incomplete, corrupt or does not match this run."""
