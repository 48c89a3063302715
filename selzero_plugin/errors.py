"""The package's error classes. Every user mistake raises one of these; all subclass ValueError.

``CollectiveError`` is not a mistake of this rank's user code but a fault of another rank (died,
stalled past ``timeout_s``, raised before a collective); it also subclasses RuntimeError, which
is what torch.distributed raises for the same fault."""

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
    "CollectiveError",
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


class CollectiveError(SelZeroError, RuntimeError):
    """One of selzero's collectives failed: another rank of the group died, stalled longer than
    ``timeout_s`` or raised before reaching it. The message names the collective, the group and
    the timeout; the rank's selzero state must not be stepped further (restart from the last
    complete checkpoint, which the failure does not touch)."""
