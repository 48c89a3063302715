"""Which parameters selzero owns: globs / regexes / module classes resolved against a model.

[Note: fused experts]
transformers 5 stores an MoE layer's experts as one tensor stacked on dim 0 inside a module that
declares ``num_experts`` (Qwen3-MoE, Mixtral, gpt-oss). With ``expert_dim=0`` a selected
parameter is split into per-expert virtual parameters when it has at least two dims and the
module that holds it declares ``num_experts`` (or ``num_local_experts``) equal to its size on
dim 0. Anything else stays whole. A custom fused module opts in by declaring ``num_experts``.

[Note: global expert names]
Under expert parallelism each rank holds a slice of the experts, under local names
(``moe.experts.0.w1.weight`` on every expert-parallel rank). A model tells selzero which global
expert each local one is with an integer attribute ``expert_offset`` (local expert ``i`` is
global expert ``expert_offset + i``), set on

- the ``nn.ModuleList`` of experts: ``moe.experts.3.w1.weight`` with offset 8 is globally
  ``moe.experts.11.w1.weight``;
- the module holding fused expert tensors split with ``expert_dim=0``: row ``i`` of
  ``mlp.experts.gate_up_proj`` is global expert ``expert_offset + i``
  (``mlp.experts.gate_up_proj[expert 11]``).

An ``expert_offset`` anywhere else is not selzero's and is ignored. Such an entry carries a
``Placement`` (which container, which global experts), part of the contract (the replicas of an
expert-data-parallel group must name their experts alike) and of the checkpoint, whose keys are
the global names: ``selzero reshard`` moves experts between expert-parallel ranks by them.
Without ``expert_offset`` the global name is the local one (no expert parallelism, or a
checkpoint tied to its layout).
"""

from __future__ import annotations

import difflib
import fnmatch
import re
from dataclasses import dataclass

import torch
from torch import nn

from ..errors import SelectionError

__all__ = ["SelectedEntry", "Placement", "resolve_selection", "matches_any", "SUPPORTED_DTYPES"]

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class Placement:
    """Where a selected tensor sits among the global experts ([Note: global expert names])."""

    container: str  # the ModuleList's name, or the fused parameter's own name
    first: int  # global index of its first expert
    count: int  # experts it holds: 1 for a ModuleList member, the rows of a fused tensor
    member: str | None  # the name inside the expert (ModuleList); None for a fused tensor

    def to_json(self) -> dict[str, object]:
        return {"container": self.container, "first": self.first, "count": self.count,
                "member": self.member}


@dataclass(frozen=True)
class SelectedEntry:
    """One selected tensor: all the names it is reachable under, in model visitation order."""

    name: str  # canonical (first-visited) name
    aliases: tuple[str, ...]  # the other names of the same tensor
    param: nn.Parameter
    num_experts: int | None  # set when split into per-expert virtual parameters
    global_name: str = ""  # the name under global expert indices; the canonical name otherwise
    global_aliases: tuple[str, ...] = ()
    placement: Placement | None = None

    @property
    def frozen(self) -> bool:
        return not self.param.requires_grad

    @property
    def virtual_shape(self) -> tuple[int, ...]:
        """The shape of each of its virtual parameters: an expert's, when split."""
        shape = tuple(self.param.shape)
        return shape[1:] if self.num_experts is not None else shape

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
    """Selected entries in model visitation order; refuses ties crossing the selection boundary
    and a selection that takes nothing (an instance owning nothing would leave the job to run
    as plain DDP, silently)."""
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
        experts = _num_experts(model, names[0], p, expert_dim)
        placement, global_name = _place(model, names[0], experts)
        entries.append(SelectedEntry(names[0], tuple(names[1:]), p, experts, global_name,
                                     tuple(_place(model, n, experts)[1] for n in names[1:]),
                                     placement))
    if not entries:
        raise SelectionError(_nothing_selected(params, modules, by_tensor, model))
    _check_one_device(entries)
    return entries


def _nothing_selected(params: list[str], modules: list[str], by_tensor: dict[int, list[str]],
                      model: nn.Module) -> str:
    """The message for a selection that takes no parameter: the closest names, the classes."""
    names = [n for group in by_tensor.values() for n in group]
    if not names:
        return "the model has no parameters: there is nothing for selzero to take."
    close: list[str] = []
    for pattern in params:
        literal = pattern[3:] if pattern.startswith("re:") else pattern
        literal = re.sub(r"[\[\]\\^$.|?*+(){}]+", ".", literal).strip(".")
        for n in difflib.get_close_matches(literal, names, n=3, cutoff=0.0):
            if n not in close:
                close.append(n)
    classes = sorted({type(m).__name__ for m in model.modules()})
    what = f"params={list(params)}" + (f" modules={list(modules)}" if modules else "")
    return (f"{what} select no parameter of the model ({len(names)} parameter names, e.g. "
            f"{names[:3]}). Closest names: {close[:5]}. Globs are fnmatch over the full names "
            "of model.named_parameters() ('*' also matches dots: '*.experts.*'), 're:<regex>' "
            f"a regular expression; modules= takes class names (this model's: {classes[:8]}). "
            "Check the names with model.named_parameters() or `selzero plan`.")


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


def _owner_chain(model: nn.Module, name: str) -> list[nn.Module]:
    """The modules on ``name``'s path, outermost first, ending at the one holding it. Walks
    ``_modules``, not get_submodule: getattr finds a method first when a submodule is named like
    one (`model.half = nn.Linear(...)` -> Module.half), and get_submodule then raises."""
    chain = [model]
    for part in filter(None, name.rpartition(".")[0].split(".")):
        chain.append(chain[-1]._modules[part])
    return chain


def _num_experts(model: nn.Module, name: str, p: torch.Tensor, expert_dim: int | None) -> int | None:
    if expert_dim is None or p.dim() < 2:
        return None
    owner = _owner_chain(model, name)[-1]
    for attr in ("num_experts", "num_local_experts"):  # the local count under expert parallelism
        declared = getattr(owner, attr, None)
        # one expert is split only under expert parallelism (its rows are a global expert's)
        if isinstance(declared, int) and not isinstance(declared, bool) and \
                declared == p.shape[expert_dim] and \
                (declared > 1 or declared == 1 and hasattr(owner, "expert_offset")):
            return declared
    return None


def _offset_of(module: nn.Module, where: str) -> int | None:
    offset = getattr(module, "expert_offset", None)
    if offset is None:
        return None
    if isinstance(offset, bool) or not isinstance(offset, int) or offset < 0:
        raise SelectionError(f"module {where or '<model>'!r} declares expert_offset={offset!r}; "
                             "expected a non-negative int: the global index of its local expert "
                             "0 (e.g. ep_rank * num_local_experts).")
    return offset


def _place(model: nn.Module, name: str, experts: int | None) -> tuple[Placement | None, str]:
    """The placement and global name of parameter ``name`` ([Note: global expert names])."""
    parts = name.split(".")
    chain = _owner_chain(model, name)
    for depth in range(len(chain) - 1, -1, -1):  # the innermost declaration applies
        module, path = chain[depth], ".".join(parts[:depth])
        if depth == len(chain) - 1 and not isinstance(module, nn.ModuleList):
            offset = _offset_of(module, path)
            if offset is None:
                continue
            if experts is None:
                raise SelectionError(
                    f"parameter {name!r}: its module declares expert_offset={offset} (fused "
                    "experts) but the tensor is not split per expert; set expert_dim: 0 in the "
                    "selzero config (and num_experts / num_local_experts on the module equal to "
                    "its size on dim 0), or remove expert_offset.")
            return Placement(name, offset, experts, None), name
        if isinstance(module, nn.ModuleList) and depth < len(chain) - 1:
            offset = _offset_of(module, path)
            if offset is None:
                continue
            local = int(parts[depth])
            member = ".".join(parts[depth + 1:])
            g = offset + local
            return Placement(path, g, 1, member), ".".join([*parts[:depth], str(g), member])
    return None, name


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
