"""selzero: ZeRO-2 for a chosen subset of a model's parameters, beside any host strategy."""

from .clip import clip_grad_norm_
from .config import SelZeroConfig
from .ddp import wrap_ddp
from .errors import (CheckpointError, ConfigError, ContractError, MissingGradientError,
                     NonFiniteGradientError, OptimizerNotSupportedError, SelectionError,
                     SelZeroError, UsageError)
from .report import MemoryReport, StepResult
from .zero2 import SelectedZero2

__version__ = "0.1.0"

__all__ = [
    "SelectedZero2", "SelZeroConfig", "StepResult", "MemoryReport", "wrap_ddp", "clip_grad_norm_",
    "SelZeroError", "ConfigError", "SelectionError", "ContractError", "OptimizerNotSupportedError",
    "UsageError", "MissingGradientError", "NonFiniteGradientError", "CheckpointError",
    "__version__",
]
