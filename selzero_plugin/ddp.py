"""wrap_ddp: DDP over every parameter selzero does not own; its no_sync() covers selzero too."""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

from torch import nn
from torch.nn.parallel import DistributedDataParallel

from .errors import UsageError
from .core.zero2 import SelectedZero2

__all__ = ["wrap_ddp", "SelZeroDDP"]


class SelZeroDDP(DistributedDataParallel):
    """DistributedDataParallel whose ``no_sync()`` also makes selzero's micro-steps local."""

    selzero: SelectedZero2

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        with super().no_sync(), self.selzero.no_sync():
            yield


def wrap_ddp(model: nn.Module, sz: SelectedZero2, **ddp_kwargs: Any) -> SelZeroDDP:
    """Wrap ``model`` in DDP, leaving ``sz``'s parameters (all their names) to selzero.

    DDP neither averages nor broadcasts ignored parameters; selzero reduces them and broadcast
    them at construction. ``ddp_kwargs`` go to DistributedDataParallel unchanged.
    """
    if sz.model is not model:
        raise UsageError("wrap_ddp(model, sz): sz was built for a different module; pass the same "
                         "model object SelectedZero2 was built on.")
    ignored = [n for e in sz.entries for n in e.names]
    host = [n for n, p in model.named_parameters() if p.requires_grad and n not in set(ignored)]
    if not host:
        raise UsageError("wrap_ddp: selzero owns every trainable parameter of the model, so there "
                         "is nothing left for DDP; use the model directly and call sz.step().")
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, ignored)
    wrapped = SelZeroDDP(model, **ddp_kwargs)
    wrapped.selzero = sz
    return wrapped
