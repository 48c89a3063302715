"""What a run tells you: selzero's one logger, ``selzero_plugin``.

Silent below WARNING by default (no handler of its own; Python's last-resort handler prints
warnings). ``SELZERO_LOG_LEVEL=INFO`` (or ``DEBUG``, a level name or number) gives it a handler
that prefixes each line with the rank; the standard logging configuration works as well
(``logging.basicConfig(level=logging.INFO)``, or ``logging.getLogger("selzero_plugin")``).

- INFO, group rank 0, once per instance when it is built: what it took (tensors, elements, the
  first names), its group, buckets, launch units, and per-rank bytes of gradients + optimizer
  state + masters beside what DDP would hold for the same parameters (``selzero plan``'s
  arithmetic on the engine's own layout).
- DEBUG, group rank 0, every step: the buckets launched during backward and at its end,
  and the experts skipped (absent on every rank).
"""

from __future__ import annotations

import logging
import os
import warnings
from typing import Any, Mapping

import torch.distributed as dist

from .config import ENV_LOG_LEVEL  # (not a config field: config.from_env skips it)

__all__ = ["LOGGER_NAME", "ENV_LOG_LEVEL", "logger", "install", "describe"]

LOGGER_NAME = "selzero_plugin"
logger = logging.getLogger(LOGGER_NAME)
_HANDLER_MARK = "_selzero_handler"


class _Rank(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        initialized = dist.is_available() and dist.is_initialized()
        record.rank = dist.get_rank() if initialized else 0
        return True


def install(environ: Mapping[str, str] | None = None) -> None:
    """Applies ``SELZERO_LOG_LEVEL`` (at import; again by tests)."""
    from .core import zero2

    zero2.add_build_observer(_on_built)
    raw = (os.environ if environ is None else environ).get(ENV_LOG_LEVEL, "").strip()
    if not raw:
        return
    level = int(raw) if raw.isdigit() else logging.getLevelName(raw.upper())
    if not isinstance(level, int):
        warnings.warn(f"{ENV_LOG_LEVEL}={raw!r} is not a logging level; expected DEBUG, INFO, "
                      "WARNING, ERROR or a number. It is ignored.", stacklevel=2)
        return
    logger.setLevel(level)
    if not any(getattr(h, _HANDLER_MARK, False) for h in logger.handlers):
        handler = logging.StreamHandler()
        handler.addFilter(_Rank())
        handler.setFormatter(logging.Formatter("[selzero rank %(rank)s] %(levelname)s %(message)s"))
        setattr(handler, _HANDLER_MARK, True)
        logger.addHandler(handler)
        logger.propagate = False  # one line each, not also through the root's handlers


def _mib(n: int) -> str:
    for unit, scale in (("GiB", 2 ** 30), ("MiB", 2 ** 20), ("KiB", 2 ** 10)):
        if n >= scale:
            return f"{n / scale:,.1f} {unit}"
    return f"{n} B"


def describe(sz: Any) -> str:
    """The INFO line of a built instance."""
    from .plan import ddp_bytes, ddp_label, rank_plans, state_specs

    trainable, layout, units = sz.trainable, sz.layout, sz.units
    specs = state_specs(sz)
    ranks = rank_plans(layout, trainable, specs)
    top = max(ranks, key=lambda r: r.total)
    ddp = sum(ddp_bytes(e, specs[t]) for t, e in enumerate(trainable))
    elements = sum(e.param.numel() for e in trainable)
    frozen = len(sz.entries) - len(trainable)
    names = [e.name for e in trainable]
    used = sorted(set(units.of_entry))
    group = sz.comm.global_ranks
    shown = group if len(group) <= 8 else [*group[:4], "...", *group[-2:]]
    return (
        f"selzero {sz.config.name!r}: took {len(trainable)} tensor(s), {elements:,} elements "
        f"({len(layout.virtuals)} virtual parameter(s)"
        + (f"; {frozen} frozen" if frozen else "") + f"), e.g. {names[:3]}; group of "
        f"{len(group)} rank(s) {shown}; {len(layout.buckets)} bucket(s) of at most "
        f"{sz.config.bucket_mb:g} MiB; {len(used)} launch unit(s), e.g. "
        f"{[units.names[u] for u in used[:3]]}; optimizer {type(sz.optimizer).__name__}; per "
        f"rank (largest, rank {top.rank}): grads {_mib(top.grad_shard)} + state "
        f"{_mib(top.optimizer_state)} + masters {_mib(top.master)} = {_mib(top.total)}, where "
        f"{ddp_label(trainable)} would hold {_mib(ddp)} ({top.total / max(ddp, 1):.2f}x) once "
        "every parameter has stepped.")


def _on_built(sz: Any) -> None:
    if sz.comm.rank == 0 and logger.isEnabledFor(logging.INFO):
        logger.info(describe(sz))
