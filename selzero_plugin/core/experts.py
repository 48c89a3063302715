"""Which (virtual) parameters make up each expert, for per-expert presence on ``StepResult``.

An expert is named by the module that holds it and its index, the same for both layouts:
``layers.0.mlp.experts.3`` is the ModuleList member ``...experts.3`` (all of its tensors), and
row 3 of every fused tensor of the module ``layers.0.mlp.experts`` (``expert_dim=0``; a module
that holds a split tensor of 3 or more dimensions, whose name says "expert", or that declares
``expert_offset``). Under expert parallelism the
index is the global one. A selected tensor that is neither (a router, even split by
``expert_dim=0``; attention) belongs to no expert.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from .layout import Layout
from .selection import SelectedEntry

__all__ = ["ExpertIndex", "index_experts"]

_MEMBER = re.compile(r"^((?:.*\.)?[^.]*expert[^.]*\.\d+)\.", re.I)
_EXPERTS_MODULE = re.compile(r"(^|\.)[^.]*expert[^.]*$", re.I)  # its own name says "expert"


@dataclass(frozen=True)
class ExpertIndex:
    names: tuple[str, ...]
    members: tuple[tuple[int, ...], ...]  # the virtual parameters of each expert

    def presence(self, per_virtual: tuple[int, ...]) -> dict[str, int]:
        """Each expert's count of group ranks that had a gradient for it (any of its tensors)."""
        if not per_virtual:
            return {}
        return {n: max(per_virtual[i] for i in m) for n, m in zip(self.names, self.members)}


def _key(entry: SelectedEntry, expert: int | None, fused: set[str]) -> str | None:
    place = entry.placement
    if expert is not None:  # a row of a fused tensor: of an experts module, not a router
        module = entry.name.rpartition(".")[0]
        if place is None and module not in fused and not _EXPERTS_MODULE.search(module):
            return None  # a router's (E, hidden) weight split by expert_dim=0, or the like
        first = place.first if place is not None else 0
        return f"{module}.{first + expert}" if module else str(first + expert)
    if place is not None and place.member is not None:
        return f"{place.container}.{place.first}"
    m = _MEMBER.match(entry.name)
    return m.group(1) if m else None


def index_experts(trainable: list[SelectedEntry], layout: Layout) -> ExpertIndex:
    # a module holding a split tensor of 3 or more dims, (E, out, in), holds experts, whatever
    # its name (review finding: `ffn`, `moe_mlp`); a router's (E, hidden) weight is 2-D
    fused = {e.name.rpartition(".")[0] for e in trainable
             if e.num_experts is not None and e.param.dim() >= 3}
    groups: dict[str, list[int]] = {}
    for i, spec in enumerate(layout.virtuals):
        key = _key(trainable[spec.entry], spec.expert, fused)
        if key is not None:
            groups.setdefault(key, []).append(i)
    return ExpertIndex(tuple(groups), tuple(tuple(m) for m in groups.values()))
