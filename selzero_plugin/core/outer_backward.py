"""The outermost ``torch.autograd.backward`` call that is running, as the wrapper in
selzero_plugin/failed_backward.py sees it ([Note: seeing a failed backward]).

The window reads it when a backward opens a micro-step: which call opened it (so a call that
raises finds its micro-step even when a nested backward, a reentrant checkpoint's, already
closed it) and whether that call's roots were scaled by a GradScaler (selzero_plugin/amp.py
marks the nodes ``scaler.scale`` makes). Without the wrapper both stay at their defaults.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["OuterBackward", "CURRENT", "SCALED_KEY"]

SCALED_KEY = "selzero_scaled"  # in the ``metadata`` of a node GradScaler.scale() made


@dataclass
class OuterBackward:
    call: int = 0  # number of the running outermost call (0: none seen)
    scaled: bool = False  # its roots come from GradScaler.scale()
    scaler_seen: bool = False  # a GradScaler scaled something in this process


CURRENT = OuterBackward()
