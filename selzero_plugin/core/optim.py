"""The optimizer over segment parameters: elementwise allowlist, groups, host mirroring.

[Note: segment parameters]
The update runs an unmodified ``torch.optim`` optimizer over *segment parameters*: one FP32
tensor per selected (virtual) parameter holding this rank's real chunk (an alias of the
parameter's storage for fp32 parameters, an FP32 master otherwise). Because each segment is its
own optimizer parameter, per-parameter state, step counts and torch's "grad is None -> skip"
rule give exactly the presence semantics, and an elementwise optimizer computes on a chunk what
it would compute on the whole tensor. Optimizers whose update reads a whole matrix or tensor
(factored moments, orthogonalization, trust ratios, line searches) cannot run on chunks; under
whole-tensor ownership (``partition="tensors"``) a segment is a whole (virtual) parameter in
its own shape, so Muon, Adafactor and the classes in ``extra_matrix_optimizers`` run there
unmodified. How a step hands the segments to the optimizer (runs of them as one tensor, for
torch's elementwise classes): [Note: flat step] in flat_step.py.

[Note: param groups with their own optimizer]
A param group may name its own optimizer class (``"optimizer": "torch.optim.AdamW"``). Its
parameters run that class with the group's hyperparameters alone (the class's own defaults for
the rest: the main optimizer's kwargs are Muon's, not AdamW's), also when it names the main
class (a DeepSpeed run may replace the main class by another; the group must not change with
it). Beside a host optimizer instance, such groups are the only
``param_groups`` allowed (the rest mirror the host's groups). Scheduling: ``step(lr=x)`` and a
mirrored host set the lr of the main class's groups; a group with its own class follows the
same schedule *factor* (its lr times the main lr now over the main lr at construction, or the
host's ``initial_lr`` when an LR scheduler set one), which is exactly what a torch LambdaLR over
all groups would do.
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
from .multi_optimizer import MultiOptimizer
from .selection import SelectedEntry, matches_any

__all__ = ["ELEMENTWISE", "MATRIX", "GroupPlan", "SegmentOptimizer", "resolve_optimizer_class",
           "check_elementwise", "check_admitted", "check_hyperparameters", "plan_groups",
           "plan_groups_from_host", "build_optimizer", "qualified_name", "jsonable",
           "stepped_state"]

ELEMENTWISE: tuple[type[torch.optim.Optimizer], ...] = (
    torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adamax, torch.optim.NAdam,
    torch.optim.RAdam, torch.optim.Adagrad, torch.optim.RMSprop, torch.optim.Adadelta,
)

# need whole tensors; admitted under partition="tensors"
MATRIX: tuple[type[torch.optim.Optimizer], ...] = (torch.optim.Muon, torch.optim.Adafactor)

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


def check_admitted(cls: type, *, partition: str, extra_elementwise: list[str],
                   extra_matrix: list[str]) -> None:
    """Under ``chunks`` only elementwise optimizers; under ``tensors`` also the matrix-wise ones
    (Muon, Adafactor, ``extra_matrix_optimizers``)."""
    if partition == "tensors" and (cls in MATRIX or _listed(cls, extra_matrix)):
        return
    if partition != "tensors" and _listed(cls, extra_matrix):
        raise OptimizerNotSupportedError(
            f"optimizer {qualified_name(cls)} is listed in extra_matrix_optimizers: it needs "
            "whole tensors, and partition='chunks' gives each rank a flat slice of every "
            "tensor. Set partition='tensors' (each rank then owns whole tensors).")
    check_elementwise(cls, extra_elementwise, partition=partition)


# whole tensors are not enough for these: their update spans parameters or sparse tensors
_BEYOND_TENSORS = ("LBFGS", "SparseAdam")


def check_elementwise(cls: type, extra: list[str], *, partition: str = "chunks") -> None:
    """Refuse optimizers whose update needs whole tensors; admit the allowlist and ``extra``."""
    if cls in ELEMENTWISE or _listed(cls, extra):
        return
    why = _WHY_REFUSED.get(cls.__name__)
    if why is not None and cls.__name__ in _BEYOND_TENSORS:
        raise OptimizerNotSupportedError(
            f"optimizer {qualified_name(cls)} cannot run on selzero's shards: {why}, and each "
            "rank holds only a slice of every tensor (partition='chunks') or some whole tensors "
            "(partition='tensors'), never all of them. Use an elementwise optimizer (AdamW, "
            "Adam, SGD, ...) for the selected parameters, or leave them out of selzero's "
            "`params` so the host strategy keeps them.")
    if why is not None and partition != "tensors":
        raise OptimizerNotSupportedError(
            f"optimizer {qualified_name(cls)} cannot run on selzero's flat chunks: {why}, and "
            "with partition='chunks' each rank holds only a slice of every tensor. Set "
            "partition='tensors': each rank then owns whole tensors and runs "
            f"{cls.__name__} on them unmodified (torch.optim.Muon and Adafactor are admitted "
            "as they are, other classes through extra_matrix_optimizers). Use an elementwise "
            "optimizer (AdamW, Adam, SGD, ...) otherwise, or leave the parameters out of "
            "selzero's `params` so the host strategy keeps them.")
    if why is not None:
        raise OptimizerNotSupportedError(
            f"optimizer {qualified_name(cls)} is not admitted by default under "
            f"partition='tensors' ({why}). If its update needs each tensor whole and nothing "
            f"more, add {qualified_name(cls)!r} to `extra_matrix_optimizers`; torch.optim.Muon "
            "and Adafactor are admitted as they are.")
    raise OptimizerNotSupportedError(
        f"optimizer {qualified_name(cls)} is not known to be elementwise, and selzero runs the "
        "update on flat slices of each tensor. Known: "
        f"{', '.join(c.__name__ for c in ELEMENTWISE)}. If every state tensor of "
        f"{cls.__name__} has the parameter's shape and the update never mixes elements, add "
        f"{qualified_name(cls)!r} to `extra_elementwise_optimizers`"
        + ("; if it needs each tensor whole, to `extra_matrix_optimizers`." if partition ==
           "tensors" else "; if it needs whole tensors, set partition='tensors' and add it to "
           "`extra_matrix_optimizers`."))


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
    cls: type | None = None  # a class of its own ([Note: param groups with their own optimizer])
    own: bool = False  # named its own optimizer: its own hyperparameters, the schedule factor


def override_class(override: dict[str, Any]) -> type | None:
    """The class a ``param_groups`` entry names, or None."""
    name = override.get("optimizer")
    return None if name is None else resolve_optimizer_class(name)


def _override_hyper(override: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in override.items() if k not in ("params", "optimizer")}


def plan_groups(trainable: list[SelectedEntry], defaults: dict[str, Any],
                overrides: list[dict[str, Any]], cls: type | None = None) -> list[GroupPlan]:
    """Group 0 holds the defaults; ``overrides[i]`` (first match wins) becomes group i + 1. An
    override naming an optimizer class takes its own hyperparameters and that class's
    defaults ([Note: param groups with their own optimizer])."""
    plans = [GroupPlan(dict(defaults), [])]
    for o in overrides:
        own = override_class(o)
        if own is None:
            plans.append(GroupPlan({**defaults, **_override_hyper(o)}, []))
        else:  # also when it names the main class (review finding: it took the main kwargs
            # and the main lr)
            plans.append(GroupPlan({**class_defaults(own), **_override_hyper(o)}, [], None,
                                   own, True))
    _assign(trainable, overrides, plans, lambda t: 0)
    return plans


def _assign(trainable: list[SelectedEntry], overrides: list[dict[str, Any]],
            plans: list[GroupPlan], fallback: Any, first: int = 1) -> None:
    for t, entry in enumerate(trainable):
        g = next((first + i for i, o in enumerate(overrides)
                  if any(matches_any(n, list(o["params"])) for n in entry.names)), None)
        plans[fallback(t) if g is None else g].members.append(t)


def plan_groups_from_host(trainable: list[SelectedEntry], host: torch.optim.Optimizer,
                          overrides: list[dict[str, Any]] | None = None) -> list[GroupPlan]:
    """One group per host group; a parameter the host does not hold mirrors host group 0.
    ``overrides`` (each naming its own optimizer class) come after, first match wins."""
    where: dict[int, int] = {}
    for g, group in enumerate(host.param_groups):
        for p in group["params"]:
            where.setdefault(id(p), g)
    plans = [GroupPlan(_hyper(group), [], g) for g, group in enumerate(host.param_groups)]
    overrides = overrides or []
    # no host group to mirror: each takes its own hyperparameters and its class's defaults,
    # also when it names the host's class (review finding: it took the host's defaults and no
    # schedule)
    plans += [GroupPlan({**class_defaults(c), **_override_hyper(o)}, [], None, c, True)
              for o in overrides for c in [override_class(o)]]
    _assign(trainable, overrides, plans, lambda t: where.get(id(trainable[t].param), 0),
            first=len(host.param_groups))
    return plans


def class_defaults(cls: type | None) -> dict[str, Any]:
    """The keyword defaults of an optimizer class's constructor (what torch fills a group
    with when the class is built without arguments)."""
    if cls is None:
        return {}
    return {k: p.default for k, p in inspect.signature(cls.__init__).parameters.items()
            if k not in ("self", "params") and p.default is not inspect.Parameter.empty
            and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}


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
    """Unmodified ``torch.optim`` optimizers over this rank's segment parameters.

    ``plans[g]`` lists the trainable entries of optimizer group g; each segment joins the group
    of its entry. Groups of the main class ``cls`` form one torch optimizer, those naming a
    class of their own one per class ([Note: param groups with their own optimizer]);
    ``optimizer`` is the one, or a ``MultiOptimizer`` over them. A host optimizer instance,
    when given, is mirrored: its scheduled values are re-read before every step.
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
        # one torch optimizer per class, in order of first use; order[g]: (optimizer, its group)
        by_class: dict[type, list[int]] = {}
        for g, plan in enumerate(plans):
            by_class.setdefault(plan.cls or cls, []).append(g)
        built, order = [], [(0, 0)] * len(plans)
        for m, (c, mine) in enumerate(by_class.items()):
            built.append(build_optimizer(c, [plans[g] for g in mine],
                                         [per_group[g] for g in mine],
                                         defaults if c is cls else {}))
            for i, g in enumerate(mine):
                order[g] = (m, i)
        self.optimizer: torch.optim.Optimizer = built[0] if len(built) == 1 else \
            MultiOptimizer(built, order)
        self.members: list[torch.optim.Optimizer] = built  # the torch optimizers, one per class
        self.order = order
        self.main = next(g for g, plan in enumerate(plans) if not plan.own)
        # a group of its own class: its lr as built (the group's, else its class's default)
        self.own_lr = {g: float(self.optimizer.param_groups[g]["lr"])
                       for g, plan in enumerate(plans) if plan.own
                       and isinstance(self.optimizer.param_groups[g].get("lr"), (int, float))}
        self.base_lr = self._main_lr(initial=True)
        self.base_given = False

    def set_schedule_base(self, lr: float) -> None:
        """The main lr the schedule factor is taken against (a host scheduler's peak)."""
        self.base_lr, self.base_given = float(lr), True

    def _main_lr(self, initial: bool = False) -> float | None:
        group = self.optimizer.param_groups[self.main]
        if initial and self.host is not None and self.plans[self.main].host_group is not None:
            host_group = self.host.param_groups[self.plans[self.main].host_group]
            value = host_group.get("initial_lr", host_group.get("lr"))
        else:
            value = group.get("initial_lr", group.get("lr")) if initial else group.get("lr")
        try:
            return float(value)
        except (TypeError, ValueError):
            return None

    def prepare(self, lr: float | None) -> None:
        """The hyperparameters of this step: the host's scheduled values, then ``lr``; groups
        with a class of their own follow the main lr's schedule factor when selzero drives the
        main lr (a host or ``lr``), and are left as they are otherwise."""
        if self.host is not None:
            refresh_from_host(self.optimizer, self.plans, self.host)
        groups = self.optimizer.param_groups
        if lr is not None:
            for g in range(len(groups)):
                if not self.plans[g].own:
                    groups[g]["lr"] = lr
        if self.own_lr and (lr is not None or self.host is not None):
            if self.host is not None and not self.base_given and "initial_lr" in \
                    self.host.param_groups[self.plans[self.main].host_group or 0]:
                self.base_lr = self._main_lr(initial=True)  # a scheduler made after selzero
            now, base = self._main_lr(), self.base_lr
            factor = now / base if now is not None and base else 1.0
            for g, own in self.own_lr.items():
                groups[g]["lr"] = own * factor


_PROXY_DIMS = (2, 3, 5, 7, 11, 13)
StateShape = tuple[str, torch.dtype, tuple[int, ...]]  # kind, dtype, shape


def probe_state_shapes(cls: type[torch.optim.Optimizer], hyper: dict[str, Any],
                       defaults: dict[str, Any], device: torch.device,
                       shape: tuple[int, ...]) -> dict[str, StateShape]:
    """The state one step of ``cls`` makes for a whole parameter of ``shape`` (whole-tensor
    ownership): found on a small parameter of the same rank whose dims are distinct primes, so
    each dim of a state tensor is told apart as 1 or one of the parameter's dims (Adafactor's
    ``row_var`` (m, 1), a Shampoo preconditioner (n, n)). Kinds: ``scalar`` (0-dim),
    ``elementwise`` (the parameter's shape), ``tensor`` (any other)."""
    if len(shape) > len(_PROXY_DIMS):
        raise OptimizerNotSupportedError(
            f"a parameter of shape {list(shape)}: selzero describes optimizer state for "
            f"parameters of at most {len(_PROXY_DIMS)} dims.")
    proxy = _PROXY_DIMS[:len(shape)]
    dummy = nn.Parameter(torch.zeros(proxy, device=device))
    optimizer = build_optimizer(cls, [GroupPlan(dict(hyper), [])], [[dummy]], defaults)
    dummy.grad = torch.zeros_like(dummy)
    optimizer.step()
    out: dict[str, StateShape] = {}
    for key, value in optimizer.state[dummy].items():
        if not isinstance(value, torch.Tensor):
            raise OptimizerNotSupportedError(
                f"optimizer {qualified_name(cls)} keeps state {key!r} as "
                f"{type(value).__name__}; selzero saves tensors only (checkpoints hold no "
                "pickle).")
        if value.dim() == 0:
            out[key] = ("scalar", value.dtype, ())
        elif tuple(value.shape) == proxy:
            out[key] = ("elementwise", value.dtype, tuple(shape))
        elif all(d == 1 or d in proxy for d in value.shape):
            out[key] = ("tensor", value.dtype, tuple(
                1 if d == 1 else shape[proxy.index(d)] for d in value.shape))
        else:
            raise OptimizerNotSupportedError(
                f"optimizer {qualified_name(cls)} keeps state {key!r} of shape "
                f"{list(value.shape)} for a parameter of shape {list(proxy)}: its dims are "
                "neither the parameter's dims nor 1, so selzero cannot save it for a "
                "parameter of another shape.")
    return out


def stepped_state(state: Any) -> bool:
    """Whether a host optimizer's state for a parameter comes from a step (Adagrad makes its
    ``step == 0`` state in its constructor: that one is the host's initial value, not history)."""
    if not state:
        return False
    step = state.get("step") if isinstance(state, dict) else None
    if step is None:
        return True
    return float(step) > 0
