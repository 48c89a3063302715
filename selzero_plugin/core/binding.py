"""Whether each selected parameter is still the tensor selzero was built on.

[Note: bindings]
selzero's hooks sit on the parameter objects, its fp32 segments view their storage and, for
bf16/fp16 parameters, its FP32 masters are the truth the next all-gather writes back. Ordinary
torch calls break that silently: ``load_state_dict(assign=True)`` or a move under
``torch.__future__.set_overwrite_module_params_on_conversion`` puts new objects in the model
(the hooks stay on the old ones: the subset stops training), so does replacing the module
that holds them (``model.experts[0] = copy.deepcopy(...)``), ``swap_tensors`` moves the
hooks' tensor away, ``model.to(dtype)`` changes the dtype (a bucket's gather would round other
parameters), ``param.data = ...`` replaces the storage, and an in-place load into a bf16
parameter is overwritten by the stale master at the next step (an in-place write through
``param.data`` leaves no trace in the parameter's version counter: it is not detected, call
``sz.sync_from_params()`` after one). The reduction point checks all
of that for every trainable entry (a few attribute reads each) and every rank raises the same
error, naming the parameters and the fix (build selzero after such changes, or call
``sz.sync_from_params()`` after an in-place load or a storage move).

The hook takes every selected gradient and sets ``p.grad = None``, so a selected parameter that
holds a ``.grad`` at the reduction point got it from someone else: almost always a DDP (or
another data-parallel wrapper) built *before* SelectedZero2, whose reducer all-reduces every
parameter's gradient and writes the average back into ``.grad`` (measured: DDP built first
leaves the averaged gradient there, and a host optimizer over ``model.parameters()`` would then
step the subset a second time, silently). That is the fifth flag; the fix is to build selzero
first and wrap with ``wrap_ddp`` (or put the selected names in the host's ignore list).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .selection import SelectedEntry

__all__ = ["Bindings", "REPLACED", "RECAST", "MOVED", "EDITED", "STRAY_GRAD"]

REPLACED, RECAST, MOVED, EDITED, STRAY_GRAD = 0, 1, 2, 3, 4
KINDS = 5


@dataclass
class _Binding:
    prefix: str  # the owning module's name, looked up at every check (it may be replaced)
    attr: str
    dtype: torch.dtype
    storage: int
    version: int | None  # bf16/fp16 parameters: the master is the truth


class Bindings:
    def __init__(self, model: nn.Module, trainable: list[SelectedEntry], owner: Any) -> None:
        self.model = model
        self.trainable = trainable
        self.owner = owner  # the object the parameters' _selzero_owner weakref must point at
        self.items: list[_Binding] = []
        for e in trainable:
            prefix, _, attr = e.name.rpartition(".")
            self.items.append(_Binding(prefix, attr, e.param.dtype, 0, None))
        self.record()

    def record(self) -> None:
        """Take the current storage and, for non-fp32 parameters, the version as the bound
        state (after construction, an all-gather, sync_from_params, a load)."""
        for b, e in zip(self.items, self.trainable):
            b.storage = e.param.untyped_storage().data_ptr()
            b.version = e.param._version if e.param.dtype != torch.float32 else None

    def problems(self) -> list[int]:
        """Per trainable entry, KINDS flags (0/1) in the order REPLACED, RECAST, MOVED, EDITED,
        STRAY_GRAD."""
        flags = [0] * (KINDS * len(self.items))
        modules: dict[str, nn.Module | None] = {"": self.model}
        for t, (b, e) in enumerate(zip(self.items, self.trainable)):
            p = e.param
            owner = getattr(p, "_selzero_owner", None)
            module = _submodule(modules, b.prefix)
            if module is None or not _holds(module, b.attr, p) or (
                    owner is not None and owner() is not self.owner) or (
                    self.owner is not None and owner is None):
                flags[KINDS * t + REPLACED] = 1
            elif p.dtype != b.dtype:
                flags[KINDS * t + RECAST] = 1
            elif p.untyped_storage().data_ptr() != b.storage:
                flags[KINDS * t + MOVED] = 1
            elif b.version is not None and p._version != b.version:
                flags[KINDS * t + EDITED] = 1
            elif p.grad is not None:
                flags[KINDS * t + STRAY_GRAD] = 1
        return flags


def _attribute(module: nn.Module, registry: dict[str, Any], name: str) -> Any:
    """``name`` of ``module``: the registered child first (``getattr`` finds a method first
    when a child is named like one, ``model.half = nn.Linear(...)``: review finding, as
    selection.py's ``_owner_chain`` says), else ``getattr`` (wrappers that forward attribute
    access: an activation-checkpoint wrapper, ``torch.compile``'s module). A ``__getattr__``
    that raises counts as not found: the flag is agreed, never raised on one rank alone."""
    found = registry.get(name)
    if found is not None:
        return found
    try:
        return getattr(module, name, None)
    except Exception:  # noqa: BLE001 - any user __getattr__
        return None


def _holds(module: nn.Module, attr: str, p: torch.Tensor) -> bool:
    return _attribute(module, module._parameters, attr) is p


def _submodule(found: dict[str, nn.Module | None], prefix: str) -> nn.Module | None:
    """The module at ``prefix``, resolved level by level (``_attribute``), memoized per prefix
    (``get_submodule`` per parameter took most of a reduction point's time on a model of
    thousands of experts); None where the path no longer leads to a module."""
    if prefix in found:
        return found[prefix]
    parent_prefix, _, name = prefix.rpartition(".")
    parent = _submodule(found, parent_prefix)
    module = _attribute(parent, parent._modules, name) if parent is not None else None
    found[prefix] = module if isinstance(module, nn.Module) else None
    return found[prefix]
