"""What a step and a memory report tell the caller."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["StepResult", "MemoryReport"]


@dataclass(frozen=True)
class StepResult:
    """Outcome of one ``SelectedZero2.step()``; counts are of (virtual) parameters, group-wide."""

    global_weight: int
    """What the gradients were divided by: the ``normalize_over`` group's size under ``mean``,
    the all-reduced integer weight under ``weighted``, the number of active ranks under ``sum``
    (which divides by nothing). Zero means nothing was updated."""
    updated: int
    """Parameters the optimizer stepped."""
    skipped_absent: int
    """Parameters not stepped because they had no gradient: absent on every rank, or missing on
    some rank under ``missing_grad="skip"``, or every parameter when the global weight is zero."""
    skipped_nonfinite: int
    """Parameters not stepped because the step was skipped for non-finite gradients
    (``nonfinite="skip"``): every parameter that would otherwise have been updated."""


@dataclass(frozen=True)
class MemoryReport:
    """Per-rank bytes of the subset's sharded state, measured from live tensor storages."""

    grad_shard: int
    optimizer_state: int
    master: int
    total: int
    ideal_total: int
    """Real (unpadded) chunk lengths times bytes per element, over the same tensors."""
