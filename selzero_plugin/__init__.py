"""selzero: ZeRO-2 for a chosen subset of a model's parameters, beside any host strategy."""

from .config import SelZeroConfig
from .core.clip import clip_grad_norm_
from .core.report import MemoryReport, StepResult
from .core.zero2 import SelectedZero2
from .ddp import wrap_ddp
from .errors import (CheckpointError, CollectiveError, ConfigError, ContractError,
                     MissingGradientError, NonFiniteGradientError, OptimizerNotSupportedError,
                     SelectionError, SelZeroError, UsageError)
from . import checkpoint  # noqa: E402,F401 - registers the engine's checkpoint reader/writer
from . import amp as _amp, failed_backward as _failed_backward, torch_clip as _torch_clip

_amp.install()  # torch.amp.GradScaler unscales and checks selzero's gradients too (amp.py)
_failed_backward.install()  # a backward that raises completes its schedule (failed_backward.py)
_torch_clip.install()  # torch.nn.utils.clip_grad_norm_/value_ see the subset (torch_clip.py)
from . import log as _log  # noqa: E402

_log.install()  # the `selzero_plugin` logger, SELZERO_LOG_LEVEL; the per-instance INFO line

__version__ = "0.1.0"

__all__ = [
    "SelectedZero2", "SelZeroConfig", "StepResult", "MemoryReport", "wrap_ddp", "clip_grad_norm_",
    "SelZeroError", "ConfigError", "SelectionError", "ContractError", "OptimizerNotSupportedError",
    "UsageError", "MissingGradientError", "NonFiniteGradientError", "CheckpointError",
    "CollectiveError",
    "__version__",
]
