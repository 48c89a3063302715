"""Which parameters selzero owns: globs / regexes / module classes resolved against a model.

[Note: fused experts]
transformers 5 stores an MoE layer's experts as one tensor stacked on dim 0 inside a module that
declares ``num_experts`` (Qwen3-MoE, Mixtral, gpt-oss). With ``expert_dim=0`` a selected
parameter is split into per-expert virtual parameters when it has at least two dims and the
module that holds it declares ``num_experts`` (or ``num_local_experts``) equal to its size on
dim 0. Anything else stays whole. A custom fused module opts in by declaring ``num_experts``.
"""

from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass

import torch
from torch import nn

from ..errors import SelectionError

__all__ = ["SelectedEntry", "resolve_selection", "matches_any", "SUPPORTED_DTYPES"]

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class SelectedEntry:
    """One selected tensor: all the names it is reachable under, in model visitation order."""

    name: str  # canonical (first-visited) name
    aliases: tuple[str, ...]  # the other names of the same tensor
    param: nn.Parameter
    num_experts: int | None  # set when split into per-expert virtual parameters

    @property
    def frozen(self) -> bool:
        return not self.param.requires_grad

    @property
    def names(self) -> tuple[str, ...]:
        return (self.name, *self.aliases)


def matches_any(name: str, patterns: list[str]) -> bool:
    """fnmatch globs, or ``re:<regex>`` matched against the whole name."""
    for p in patterns:
        if p.startswith("re:"):
            if re.fullmatch(p[3:], name):
                return True
        elif fnmatch.fnmatchcase(name, p):
            return True
    return False


def resolve_selection(model: nn.Module, *, params: list[str], modules: list[str],
                      expert_dim: int | None) -> list[SelectedEntry]:
    """Selected entries in model visitation order; refuses ties crossing the selection boundary."""
    by_tensor: dict[int, list[str]] = {}
    tensors: dict[int, nn.Parameter] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        by_tensor.setdefault(id(p), []).append(name)
        tensors[id(p)] = p
    in_modules = _names_under_modules(model, modules)
    entries: list[SelectedEntry] = []
    for key, names in by_tensor.items():
        picked = [n for n in names if n in in_modules or matches_any(n, params)]
        if not picked:
            continue
        if len(picked) != len(names):
            other = next(n for n in names if n not in picked)
            raise SelectionError(
                f"parameter {picked[0]!r} is selected but the same tensor is also reachable as "
                f"{other!r}, which is not: a tie may not cross the selection boundary. Select both "
                f"names (e.g. add {other!r} to params) or neither.")
        p = tensors[key]
        _check_dtype(names[0], p)
        entries.append(SelectedEntry(names[0], tuple(names[1:]), p,
                                     _num_experts(model, names[0], p, expert_dim)))
    _check_one_device(entries)
    return entries


def _names_under_modules(model: nn.Module, classes: list[str]) -> set[str]:
    if not classes:
        return set()
    wanted = set(classes)
    names: set[str] = set()
    for prefix, module in model.named_modules(remove_duplicate=False):
        if type(module).__name__ in wanted:
            for n, _ in module.named_parameters(remove_duplicate=False):
                names.add(f"{prefix}.{n}" if prefix else n)
    return names


def _num_experts(model: nn.Module, name: str, p: torch.Tensor, expert_dim: int | None) -> int | None:
    if expert_dim is None or p.dim() < 2:
        return None
    owner = model
    # walk _modules, not get_submodule: getattr finds a method first when a submodule is named
    # like one (`model.half = nn.Linear(...)` -> Module.half), and get_submodule then raises
    for part in filter(None, name.rpartition(".")[0].split(".")):
        owner = owner._modules[part]
    declared = getattr(owner, "num_experts", None)
    if not isinstance(declared, int):
        declared = getattr(owner, "num_local_experts", None)
    if isinstance(declared, int) and declared == p.shape[expert_dim] and declared > 1:
        return declared
    return None


def _check_dtype(name: str, p: torch.Tensor) -> None:
    if p.dtype not in SUPPORTED_DTYPES:
        raise SelectionError(
            f"parameter {name!r} has dtype {p.dtype}; selzero shards float32, bfloat16 and float16 "
            "parameters (FP32 communication and state). Cast the model or leave this parameter "
            "out of `params`.")


def _check_one_device(entries: list[SelectedEntry]) -> None:
    devices = {e.param.device for e in entries}
    if len(devices) > 1:
        where = {str(e.param.device): e.name for e in entries}
        raise SelectionError(f"selected parameters live on several devices ({where}); move the "
                             "model to one device before constructing SelectedZero2.")
