"""Launch units: the module whose post-backward launches a selected parameter's bucket.

[Note: launch units]
A bucket is reduce-scattered when the backward has passed every unit its parameters belong to
(DESIGN.md "Launch points"). A unit must run forward on every rank whatever the routing, so
that every rank launches bucket b at the same point of its backward. For a selected parameter
with canonical name ``a.b.c.weight`` (module path ``a.b.c``), the unit is, first match wins:

1. the outermost module on that path (itself included) whose name matches a ``launch_modules``
   glob (fnmatch's ``*`` also matches dots, so ``layers.*`` names the layers, not what they
   hold);
2. its own module, if that module declares ``num_experts`` / ``num_local_experts`` (a fused
   experts tensor: the module is called with every token);
3. the owner of the deepest ``ModuleList`` / ``ModuleDict`` on the path whose attribute name
   contains "expert" (``experts``, ``local_experts``, ``deepspeed_experts``): experts are called
   selectively, the block that holds them is not;
4. its own module.

A unit whose forward inputs need no gradient (the root fed token ids) can never fire; its
buckets then launch in the end-of-backward callback (the window logs them once).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from .selection import SelectedEntry, matches_any

__all__ = ["Units", "resolve_units", "ROOT_NAME"]

ROOT_NAME = "<model>"  # how messages name the root module


@dataclass(frozen=True)
class Units:
    names: tuple[str, ...]  # qualified module names (ROOT_NAME for the root)
    modules: tuple[nn.Module, ...]
    of_entry: tuple[int, ...]  # unit index of each trainable entry


def resolve_units(model: nn.Module, trainable: list[SelectedEntry],
                  launch_modules: list[str]) -> Units:
    names: list[str] = []
    modules: list[nn.Module] = []
    index: dict[int, int] = {}
    of_entry = []
    for entry in trainable:
        name, module = _unit_of(model, entry.name, launch_modules)
        if id(module) not in index:
            index[id(module)] = len(modules)
            names.append(name or ROOT_NAME)
            modules.append(module)
        of_entry.append(index[id(module)])
    return Units(tuple(names), tuple(modules), tuple(of_entry))


def _unit_of(model: nn.Module, param_name: str, launch_modules: list[str]
             ) -> tuple[str, nn.Module]:
    parts = [p for p in param_name.split(".")[:-1] if p]
    path = [("", model)]
    for i, part in enumerate(parts):
        path.append((".".join(parts[:i + 1]), path[-1][1]._modules[part]))
    if launch_modules:
        for name, module in path:
            if name and matches_any(name, launch_modules):
                return name, module
    own_name, own = path[-1]
    if isinstance(getattr(own, "num_experts", None), int) or \
            isinstance(getattr(own, "num_local_experts", None), int):
        return own_name, own
    for i in range(len(path) - 1, 0, -1):
        container = path[i][1]
        if isinstance(container, (nn.ModuleList, nn.ModuleDict)) and "expert" in parts[i - 1].lower():
            return path[i - 1]
    return own_name, own
