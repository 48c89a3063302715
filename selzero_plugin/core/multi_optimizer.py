"""Several torch optimizers seen as one: the segment optimizer when param groups name their
own optimizer classes (Muon for the matrices, AdamW for the rest).

[Note: several optimizer classes]
Each class runs unmodified over its own groups (one torch optimizer per class). ``MultiOptimizer``
is a ``torch.optim.Optimizer`` so that what takes one (an LR scheduler, ``sz.optimizer`` in a
user's loop) keeps working: its ``param_groups`` are the member optimizers' own group dicts in
selzero's group order (a change to one is a change to the optimizer that runs it), its
``state`` reads and clears the members' state, ``step`` steps each member, and
``state_dict``/``load_state_dict`` use torch's format over the groups in that order.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import MutableMapping
from typing import Any, Iterator

import torch

__all__ = ["MultiOptimizer"]


class _MergedState(MutableMapping):
    """The members' ``state`` dicts as one mapping (a parameter is in one member only)."""

    def __init__(self, optimizers: list[torch.optim.Optimizer]) -> None:
        self._optimizers = optimizers
        self._home = {id(p): o for o in optimizers for g in o.param_groups for p in g["params"]}

    def _find(self, key: Any) -> torch.optim.Optimizer | None:
        return self._home.get(id(key))

    def __getitem__(self, key: Any) -> Any:
        owner = self._find(key)
        if owner is None or key not in owner.state:
            raise KeyError(key)
        return owner.state[key]

    def __setitem__(self, key: Any, value: Any) -> None:
        owner = self._find(key)
        if owner is None:
            raise KeyError(f"{type(key).__name__} is not a parameter of this optimizer")
        owner.state[key] = value

    def __delitem__(self, key: Any) -> None:
        owner = self._find(key)
        if owner is None or key not in owner.state:
            raise KeyError(key)
        del owner.state[key]

    def __iter__(self) -> Iterator[Any]:
        for o in self._optimizers:
            yield from list(o.state)

    def __len__(self) -> int:
        return sum(len(o.state) for o in self._optimizers)

    def __contains__(self, key: object) -> bool:
        owner = self._find(key)
        return owner is not None and key in owner.state

    def clear(self) -> None:
        for o in self._optimizers:
            o.state.clear()


class MultiOptimizer(torch.optim.Optimizer):
    """One optimizer over the groups of several ([Note: several optimizer classes])."""

    def __init__(self, optimizers: list[torch.optim.Optimizer],
                 order: list[tuple[int, int]]) -> None:
        # torch's Optimizer.__init__ would copy the groups; set what it sets, sharing them
        self.optimizers = optimizers
        self.defaults = dict(optimizers[0].defaults)
        for hooks in ("_optimizer_step_pre_hooks", "_optimizer_step_post_hooks",
                      "_optimizer_state_dict_pre_hooks", "_optimizer_state_dict_post_hooks",
                      "_optimizer_load_state_dict_pre_hooks",
                      "_optimizer_load_state_dict_post_hooks"):
            setattr(self, hooks, OrderedDict())
        self._patch_step_function()
        self.param_groups = [optimizers[o].param_groups[g] for o, g in order]
        self.state = _MergedState(optimizers)  # type: ignore[assignment]
        self._order = order
        self._warned_capturable_if_run_uncaptured = True

    def __repr__(self) -> str:
        return "MultiOptimizer(" + ", ".join(type(o).__name__ for o in self.optimizers) + ")"

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for o in self.optimizers:
            o.step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        for o in self.optimizers:
            o.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        """torch's format: parameters numbered over the groups in selzero's order."""
        index = {id(p): n for n, p in enumerate(p for g in self.param_groups for p in g["params"])}
        state = {index[id(p)]: s for o in self.optimizers for p, s in o.state.items()
                 if id(p) in index}
        groups = [{**{k: v for k, v in g.items() if k != "params"},
                   "params": [index[id(p)] for p in g["params"]]} for g in self.param_groups]
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Each member loads its groups' share (the groups in selzero's order)."""
        groups = state_dict["param_groups"]
        if len(groups) != len(self.param_groups):
            raise ValueError(f"loaded state dict has {len(groups)} parameter groups, this "
                             f"optimizer {len(self.param_groups)}")
        for m, o in enumerate(self.optimizers):
            mine = [g for (owner, _), g in zip(self._order, groups) if owner == m]
            member_state = {}
            numbering = {}
            for group in mine:
                for i in group["params"]:
                    numbering[i] = len(numbering)
                    if i in state_dict["state"]:
                        member_state[numbering[i]] = state_dict["state"][i]
            o.load_state_dict({"state": member_state, "param_groups": [
                {**{k: v for k, v in g.items() if k != "params"},
                 "params": [numbering[i] for i in g["params"]]} for g in mine]})
        # torch's load_state_dict makes new group dicts: share those
        self.param_groups = [self.optimizers[o].param_groups[g] for o, g in self._order]
