"""What the checkpoint code sees of an engine: a small public view (DESIGN.md section 4).

The checkpoint package never reaches into the engine's parts; it reads this rank's chunks and
optimizer state through ``ShardView`` and swaps loaded state in with ``install``, which copies
values into the segments, loads the optimizer state, rebuilds the full parameters with one
all-gather and resets the window, as one step.
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
    _install: Callable[[list[torch.Tensor], dict[int, dict[str, torch.Tensor]],
                        list[dict[str, Any] | None]], None]
    _check: Callable[[], None]

    def check_installable(self) -> None:
        """Raise (a UsageError) where install() could not bind the parameters (replaced or
        recast since construction): local, so it belongs in the read phase every rank agrees
        on, not in install() (review finding: one rank raised alone there, the others had
        swapped their state in and waited)."""
        self._check()

    def chunks(self) -> list[Chunk]:
        return self._chunks()

    def install(self, values: list[torch.Tensor], states: dict[int, dict[str, torch.Tensor]],
                scheduled: list[dict[str, Any] | None] | None = None) -> None:
        """Swap in loaded values (one per slot, in slot order) and optimizer state (keyed by slot
        index), then all-gather the full parameters. Every rank of the group calls it.
        ``scheduled``: for each optimizer group, the saved hyperparameters of the group its
        parameters were saved in, or None ([Note: scheduled lr])."""
        self._install(values, states, scheduled or [])
