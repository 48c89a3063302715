"""The one true global gradient norm over a host's parameters and selzero subsets."""

from __future__ import annotations

from typing import Iterable

import torch

from ..errors import SelZeroError, UsageError
from .window import WindowState
from .zero2 import SelectedZero2

__all__ = ["clip_grad_norm_", "global_grad_norm"]


def global_grad_norm(host_parameters: Iterable[torch.nn.Parameter] | torch.Tensor,
                     subsets: Iterable[SelectedZero2] = (), *, norm_type: float = 2.0
                     ) -> tuple[torch.Tensor, list[torch.Tensor], list[SelectedZero2]]:
    """(total norm, host grads, subsets). Host gradients are taken as replicated (DDP averaged).

    Each subset element counts once across the world: a subset over the whole world is summed
    over its group; one over a proper subgroup (expert parallelism: each group holds its own
    experts) sums its shards over the world, so experts held by different groups are each
    counted once and every rank gets the same norm (DeepSpeed#8475 is the bug avoided).
    """
    if float(norm_type) != 2.0:
        raise UsageError(f"clip_grad_norm_: norm_type={norm_type!r}; selzero computes the L2 "
                         "norm only (norm_type=2.0).")
    params = [host_parameters] if isinstance(host_parameters, torch.Tensor) else list(host_parameters)
    grads = [p.grad for p in params if p.grad is not None]
    subsets = list(subsets)
    device = grads[0].device if grads else (subsets[0].comm.device if subsets else torch.device("cpu"))
    total = torch.zeros((), dtype=torch.float32, device=device)
    if grads:
        norms = torch._foreach_norm(grads, 2.0)
        total = total + torch.stack([n.float() for n in norms]).pow(2).sum()
    groups = [sz for sz in subsets if not sz.spans_world]  # each holds its own experts
    error: SelZeroError | None = None
    world_sq = torch.zeros(2, dtype=torch.float32, device=groups[0].comm.device) \
        if groups else None
    for sz in subsets:
        if sz.spans_world:
            if sz.state is not WindowState.REDUCED:
                sz.reduce_gradients()
            total = total + sz.grad_norm_squared().to(device)
            continue
        try:  # an agreed error of one expert group must reach the others, not leave them waiting
            if error is None and sz.state is not WindowState.REDUCED:
                sz.reduce_gradients()
            if error is None:
                world_sq[0] += sz.local_grad_norm_squared().to(world_sq.device)
        except SelZeroError as e:
            error = e
    if world_sq is not None:
        world_sq[1] = float(error is not None)
        groups[0].world_communicator().all_reduce(world_sq)
        if error is not None:
            raise error
        if float(world_sq[1]) > 0:
            for sz in groups:
                sz.zero_grad()
            raise UsageError(f"clip_grad_norm_: reducing the gradients failed on "
                             f"{int(world_sq[1])} other expert group(s) (their ranks raised the "
                             "reason); this rank's windows were dropped too.")
        total = total + world_sq[0].to(device)
    return total.sqrt(), grads, subsets


def clip_grad_norm_(host_parameters: Iterable[torch.nn.Parameter] | torch.Tensor, max_norm: float,
                    subsets: Iterable[SelectedZero2] = (), *, norm_type: float = 2.0) -> torch.Tensor:
    """Clip host gradients and every subset's reduced shards by the global norm; return the norm.

    Same formula as ``torch.nn.utils.clip_grad_norm_``: ``coef = min(1, max_norm / (norm + 1e-6))``.
    Subsets that were not reduced yet are reduced here (``mean`` mode needs no arguments; call
    ``reduce_gradients(weight=...)`` yourself first under ``weighted``).
    """
    total, grads, subsets = global_grad_norm(host_parameters, subsets, norm_type=norm_type)
    coef = torch.clamp(float(max_norm) / (total + 1e-6), max=1.0)
    if grads:
        torch._foreach_mul_(grads, coef.to(grads[0].device))
    for sz in subsets:
        sz.scale_gradients_(coef.to(sz.comm.device))
    return total
