"""The optimizer over segment parameters: elementwise allowlist, groups, host mirroring.

[Note: segment parameters]
The update runs an unmodified ``torch.optim`` optimizer over *segment parameters*: one FP32
tensor per selected (virtual) parameter holding this rank's real chunk (an alias of the
parameter's storage for fp32 parameters, an FP32 master otherwise). Because each segment is its
own optimizer parameter, per-parameter state, step counts and torch's "grad is None -> skip"
rule give exactly the presence semantics, and an elementwise optimizer computes on a chunk what
it would compute on the whole tensor. Optimizers whose update reads a whole matrix or tensor
(factored moments, orthogonalization, trust ratios, line searches) cannot run on chunks.
"""

from __future__ import annotations

import difflib
import importlib
import inspect
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..errors import ConfigError, OptimizerNotSupportedError
from .selection import SelectedEntry, matches_any

__all__ = ["ELEMENTWISE", "GroupPlan", "SegmentOptimizer", "resolve_optimizer_class",
           "check_elementwise", "check_hyperparameters", "plan_groups", "plan_groups_from_host",
           "build_optimizer", "qualified_name", "jsonable", "stepped_state"]

ELEMENTWISE: tuple[type[torch.optim.Optimizer], ...] = (
    torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adamax, torch.optim.NAdam,
    torch.optim.RAdam, torch.optim.Adagrad, torch.optim.RMSprop, torch.optim.Adadelta,
)

_WHY_REFUSED = {
    "Adafactor": "its second moment is factored into row and column statistics of the whole matrix",
    "Muon": "it orthogonalizes the whole update matrix (Newton-Schulz)",
    "Shampoo": "its preconditioners are built from whole matrices",
    "DistributedShampoo": "its preconditioners are built from whole matrices",
    "LAMB": "its trust ratio uses the norm of the whole tensor",
    "Lamb": "its trust ratio uses the norm of the whole tensor",
    "FusedLamb": "its trust ratio uses the norm of the whole tensor",
    "LARS": "its trust ratio uses the norm of the whole tensor",
    "LBFGS": "its line search and curvature pairs span all parameters at once",
    "SparseAdam": "it needs sparse gradients of whole tensors",
}


def qualified_name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def resolve_optimizer_class(optimizer: type | str) -> type[torch.optim.Optimizer]:
    """A class, a torch.optim name (``"AdamW"``) or a qualified name (``"pkg.mod.Lion"``)."""
    if isinstance(optimizer, type):
        return optimizer
    if isinstance(optimizer, str):
        if "." not in optimizer:
            found = getattr(torch.optim, optimizer, None)
            if isinstance(found, type):
                return found
            raise ConfigError(f"optimizer={optimizer!r}: not a torch.optim class; give the class "
                              "itself or its qualified name ('package.module.Class').")
        module, _, name = optimizer.rpartition(".")
        try:
            return getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError) as e:
            raise ConfigError(f"optimizer={optimizer!r}: cannot import it ({e}).") from None
    raise ConfigError(f"optimizer={optimizer!r}: expected an optimizer class, its name, or a "
                      "torch.optim.Optimizer instance.")


def check_elementwise(cls: type, extra: list[str]) -> None:
    """Refuse optimizers whose update needs whole tensors; admit the allowlist and ``extra``."""
    if cls in ELEMENTWISE or _listed(cls, extra):
        return
    why = _WHY_REFUSED.get(cls.__name__)
    if why is not None:
        raise OptimizerNotSupportedError(
            f"optimizer {qualified_name(cls)} cannot run on selzero's flat shards: {why}, and "
            "each rank holds only a slice of every tensor. Use an elementwise optimizer (AdamW, "
            "Adam, SGD, ...) for the selected parameters, or leave them out of selzero's `params` "
            "so the host strategy (or a whole-parameter ZeRO-1) keeps them.")
    raise OptimizerNotSupportedError(
        f"optimizer {qualified_name(cls)} is not known to be elementwise, and selzero runs the "
        "update on flat slices of each tensor. Known: "
        f"{', '.join(c.__name__ for c in ELEMENTWISE)}. If every state tensor of "
        f"{cls.__name__} has the parameter's shape and the update never mixes elements, add "
        f"{qualified_name(cls)!r} to `extra_elementwise_optimizers`.")


def check_hyperparameters(cls: type, keys: list[str], *, where: str) -> None:
    """Refuse keys the optimizer's constructor does not take (plain torch raises TypeError)."""
    accepted = inspect.signature(cls.__init__).parameters
    if any(p.kind is p.VAR_KEYWORD for p in accepted.values()):
        return
    valid = [k for k in accepted if k not in ("self", "params")]
    for key in keys:
        if key not in valid:
            close = difflib.get_close_matches(key, valid, n=1, cutoff=0.5)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError(f"{where}: {cls.__name__} has no hyperparameter {key!r}{hint}; it "
                              f"takes {', '.join(valid)}.")


def _listed(cls: type, extra: list[str]) -> bool:
    for name in extra:
        if name in (qualified_name(cls), cls.__qualname__):
            return True
        module, _, attr = name.rpartition(".")
        if module:
            try:
                if getattr(importlib.import_module(module), attr, None) is cls:
                    return True
            except ImportError:
                continue
    return False


@dataclass
class GroupPlan:
    """One selzero optimizer group: its hyperparameters and which trainable entries it holds."""

    hyper: dict[str, Any]
    members: list[int]  # indices into the trainable entries
    host_group: int | None = None  # host optimizer group mirrored at every step


def plan_groups(trainable: list[SelectedEntry], defaults: dict[str, Any],
                overrides: list[dict[str, Any]]) -> list[GroupPlan]:
    """Group 0 holds the defaults; ``overrides[i]`` (first match wins) becomes group i + 1."""
    plans = [GroupPlan(dict(defaults), [])] + [
        GroupPlan({**defaults, **{k: v for k, v in o.items() if k != "params"}}, [])
        for o in overrides]
    for t, entry in enumerate(trainable):
        g = next((i + 1 for i, o in enumerate(overrides)
                  if any(matches_any(n, list(o["params"])) for n in entry.names)), 0)
        plans[g].members.append(t)
    return plans


def plan_groups_from_host(trainable: list[SelectedEntry],
                          host: torch.optim.Optimizer) -> list[GroupPlan]:
    """One group per host group; a parameter the host does not hold mirrors host group 0."""
    where: dict[int, int] = {}
    for g, group in enumerate(host.param_groups):
        for p in group["params"]:
            where.setdefault(id(p), g)
    plans = [GroupPlan(_hyper(group), [], g) for g, group in enumerate(host.param_groups)]
    for t, entry in enumerate(trainable):
        plans[where.get(id(entry.param), 0)].members.append(t)
    return plans


def _hyper(group: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in group.items() if k != "params"}


def build_optimizer(cls: type[torch.optim.Optimizer], plans: list[GroupPlan],
                    segments_of: list[list[nn.Parameter]],
                    defaults: dict[str, Any]) -> torch.optim.Optimizer:
    groups = [{"params": segs, **plan.hyper} for plan, segs in zip(plans, segments_of)]
    accepted = inspect.signature(cls.__init__).parameters
    takes_any = any(p.kind is p.VAR_KEYWORD for p in accepted.values())
    return cls(groups, **{k: v for k, v in defaults.items() if takes_any or k in accepted})


def refresh_from_host(optimizer: torch.optim.Optimizer, plans: list[GroupPlan],
                      host: torch.optim.Optimizer) -> None:
    """Re-read scheduled values (lr, ...) from the host groups each selzero group mirrors."""
    for group, plan in zip(optimizer.param_groups, plans):
        if plan.host_group is not None:
            group.update(_hyper(host.param_groups[plan.host_group]))


def jsonable(value: Any) -> Any:
    """Hyperparameter values as JSON (tensors become floats, tuples lists)."""
    if isinstance(value, torch.Tensor):
        return value.item() if value.numel() == 1 else value.tolist()
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return repr(value)


class SegmentOptimizer:
    """An unmodified ``torch.optim`` optimizer over this rank's segment parameters.

    ``plans[g]`` lists the trainable entries of optimizer group g; each segment joins the group
    of its entry. A host optimizer instance, when given, is mirrored: its scheduled values are
    re-read into the groups before every step.
    """

    def __init__(self, cls: type[torch.optim.Optimizer], defaults: dict[str, Any],
                 plans: list[GroupPlan], segments: list[nn.Parameter], entry_of_segment: list[int],
                 host: torch.optim.Optimizer | None) -> None:
        self.cls = cls
        self.plans = plans
        self.host = host
        self.group_of_entry = {t: g for g, plan in enumerate(plans) for t in plan.members}
        per_group: list[list[nn.Parameter]] = [[] for _ in plans]
        for seg, t in zip(segments, entry_of_segment):
            per_group[self.group_of_entry[t]].append(seg)
        self.optimizer = build_optimizer(cls, plans, per_group, defaults)

    def prepare(self, lr: float | None) -> None:
        """The hyperparameters of this step: the host's scheduled values, then ``lr``."""
        if self.host is not None:
            refresh_from_host(self.optimizer, self.plans, self.host)
        if lr is not None:
            for group in self.optimizer.param_groups:
                group["lr"] = lr


def stepped_state(state: Any) -> bool:
    """Whether a host optimizer's state for a parameter comes from a step (Adagrad makes its
    ``step == 0`` state in its constructor: that one is the host's initial value, not history)."""
    if not state:
        return False
    step = state.get("step") if isinstance(state, dict) else None
    if step is None:
        return True
    return float(step) > 0
