"""What the checkpoint code sees of an engine: a small public view (DESIGN.md section 4).

The checkpoint package never reaches into the engine's parts; it reads this rank's chunks and
optimizer state through ``ShardView``, writes loaded state in place with ``install`` (local) and,
once every rank agreed, rebuilds the full parameters with ``gather_installed`` (one all-gather,
the window reset).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from ..config import SelZeroConfig
from .comm import Communicator
from .layout import ShardSlot, VirtualSpec
from .selection import SelectedEntry

__all__ = ["ShardView", "Chunk"]


@dataclass(frozen=True)
class Chunk:
    """One slot: a virtual parameter's real chunk on this rank."""

    slot: ShardSlot
    segment: nn.Parameter  # FP32 values (the parameter's own elements, or its master)
    state: dict[str, Any]  # the optimizer's state of that segment (empty before its first step)


@dataclass(frozen=True)
class ShardView:
    comm: Communicator
    config: SelZeroConfig
    entries: list[SelectedEntry]
    trainable: list[SelectedEntry]
    virtuals: tuple[VirtualSpec, ...]
    group_of_entry: dict[int, int]  # trainable entry -> optimizer group
    group_hyperparameters: list[dict[str, Any]]  # as planned (before torch's defaults)
    optimizer_class: type[torch.optim.Optimizer]
    group_classes: list[type]  # each group's class (its own, or optimizer_class)
    optimizer: torch.optim.Optimizer
    idle: bool  # no micro-step open, nothing reduced: a load may replace the state
    window_state: str
    expert_parallel: tuple[int, int] | None  # (ep_rank, ep_size) of an expert-parallel instance
    partition: str  # "chunks", or "tensors": whole (virtual) parameters, VirtualSpec.owner
    _chunks: Callable[[], list[Chunk]]
    _install: Callable[[Callable[[int], tuple[torch.Tensor, dict[str, torch.Tensor] | None]],
                        list[dict[str, Any] | None]], None]
    _gather: Callable[[], None]
    _refuse: Callable[[str], None]
    _check: Callable[[], None]
    refused: str | None = None  # why saving is refused (a load failed part way), or None

    def check_installable(self) -> None:
        """Raise (a UsageError) where install() could not bind the parameters (replaced or
        recast since construction): local, so it belongs in the read phase every rank agrees
        on, not in install() (review finding: one rank raised alone there, the others had
        swapped their state in and waited)."""
        self._check()

    def chunks(self) -> list[Chunk]:
        return self._chunks()

    def install(self, source: Callable[[int], tuple[torch.Tensor,
                                                    dict[str, torch.Tensor] | None]],
                scheduled: list[dict[str, Any] | None] | None = None) -> None:
        """Local: write loaded state in place, slot by slot (``source(i)``: slot i's value in
        the segment's shape and its optimizer state, None when it never stepped), one slot's
        tensors in memory at a time. ``scheduled``: for each optimizer group, the saved
        hyperparameters of the group its parameters were saved in, or None ([Note: scheduled
        lr]). Every rank then agrees on the outcome and calls ``gather_installed`` or, when
        any rank failed, ``refuse_steps``."""
        self._install(source, scheduled or [])

    def gather_installed(self) -> None:
        """Every rank of the group: all-gather the full parameters after ``install``."""
        self._gather()

    def refuse_steps(self, reason: str) -> None:
        """Every rank of the group, when an install failed on some rank: the instance refuses
        to step or save until a load succeeds."""
        self._refuse(reason)
