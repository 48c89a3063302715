"""wrap_ddp: DDP over every parameter selzero does not own; its no_sync() covers selzero too."""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Sequence

from torch import nn
from torch.nn.parallel import DistributedDataParallel

from .errors import UsageError
from .core.zero2 import SelectedZero2, owning_instance

__all__ = ["wrap_ddp", "SelZeroDDP"]


class SelZeroDDP(DistributedDataParallel):
    """DistributedDataParallel whose ``no_sync()`` also makes selzero's micro-steps local."""

    selzero: SelectedZero2
    selzero_instances: list[SelectedZero2]

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            stack.enter_context(super().no_sync())
            for sz in self.selzero_instances:
                stack.enter_context(sz.no_sync())
            yield


def wrap_ddp(model: nn.Module, sz: SelectedZero2 | Sequence[SelectedZero2],
             **ddp_kwargs: Any) -> SelZeroDDP:
    """Wrap ``model`` in DDP, leaving selzero's parameters (all their names) to selzero.

    ``sz``: the instance, or every instance built on ``model`` (experts under one, another
    subset under a second). Parameters owned by any live selzero instance of the model are left
    out as well, so DDP never takes a subset's gradients. DDP neither averages nor broadcasts
    ignored parameters; selzero reduces them and broadcast them at construction. The returned
    module's ``no_sync()`` covers every instance given. ``ddp_kwargs`` go to
    DistributedDataParallel unchanged.
    """
    instances = [sz] if isinstance(sz, SelectedZero2) else list(sz)
    if not instances or not all(isinstance(i, SelectedZero2) for i in instances):
        raise UsageError(f"wrap_ddp(model, sz): sz must be a SelectedZero2 or a list of them, got "
                         f"{sz!r}.")
    for i in instances:
        if i.model is not model:
            raise UsageError(f"wrap_ddp(model, sz): instance {i.config.name!r} was built for a "
                             "different module; pass the same model object SelectedZero2 was "
                             "built on.")
    owned = {id(e.param) for i in instances for e in i.entries}
    ignored = [n for i in instances for e in i.entries for n in e.names]
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) not in owned and owning_instance(p) is not None:
            ignored.append(name)  # another instance's: never DDP's
    ignored_set = set(ignored)
    host = [n for n, p in model.named_parameters() if p.requires_grad and n not in ignored_set]
    if not host:
        raise UsageError("wrap_ddp: selzero owns every trainable parameter of the model, so there "
                         "is nothing left for DDP; use the model directly and call sz.step().")
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, ignored)
    wrapped = SelZeroDDP(model, **ddp_kwargs)
    wrapped.selzero = instances[0]
    wrapped.selzero_instances = instances
    return wrapped
