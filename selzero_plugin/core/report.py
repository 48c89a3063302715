"""What a step and a memory report tell the caller."""

from __future__ import annotations

from dataclasses import dataclass, field

from .experts import ExpertIndex

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
    presence: tuple[int, ...] = field(default=(), repr=False, compare=False)
    """Per (virtual) parameter, in ``sz.virtual_names`` order: how many ranks of the group had
    a gradient for it in this step's window (the reduction point's agreed count; no extra
    collective). Empty when nothing was reduced (a step DeepSpeed skipped). Not part of ``==``
    or ``repr`` (the four counts are: ``StepResult(2, 8, 0, 0)`` compares as before)."""

    def naming(self, experts: ExpertIndex) -> "StepResult":
        """This result with the engine's expert index (not a field: ``StepResult`` keeps its
        documented fields, and ``dataclasses.asdict`` stays small)."""
        object.__setattr__(self, "_experts", experts)
        return self

    @property
    def expert_presence(self) -> dict[str, int]:
        """Per expert (``layers.0.mlp.experts.3``; fused rows and ModuleList members alike, core/
        experts.py): how many ranks of the group routed tokens to it this step."""
        experts = getattr(self, "_experts", None)
        return experts.presence(self.presence) if experts is not None else {}

    @property
    def dead_experts(self) -> int:
        """Experts no rank of the group routed a token to this step (not updated, not decayed)."""
        return sum(1 for n in self.expert_presence.values() if n == 0)


@dataclass(frozen=True)
class MemoryReport:
    """Per-rank bytes of the subset's sharded state, measured from live tensor storages."""

    grad_shard: int
    optimizer_state: int
    master: int
    total: int
    ideal_total: int
    """Real (unpadded) chunk lengths times bytes per element, over the same tensors."""
