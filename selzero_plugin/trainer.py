"""HF Trainer: ``Trainer(..., callbacks=[SelectedZero2Callback(config)])``.

[Note: Trainer adapter]
Beside DDP (or one process) the callback alone is enough. At ``on_init_end`` (the Trainer's
``Accelerator`` exists, the model is not wrapped yet) it finds the Trainer that is calling it and
routes that Trainer's one ``accelerator.prepare(model, optimizer)`` through
:func:`selzero_plugin.accelerate.prepare`: the selected parameters are left to selzero (ignored
by DDP, broadcast once), the subset's optimizer mirrors the Trainer's own (its class and the
decay / no-decay group of every parameter) and re-reads its scheduled lr every step, micro-steps
follow ``accelerator.backward`` and ``sync_gradients``, and ``accelerator.clip_grad_norm_`` is the
one global norm, so the ``grad_norm`` the Trainer logs is the true one. The Trainer's optimizer
keeps the selected parameters in its groups but they never get a gradient, so it never makes
state for them (its ``optimizer.pt`` holds none).

Checkpoints: ``on_save`` writes ``selected_zero2/`` into ``checkpoint-N`` (rotation removes it
with the rest); on ``train(resume_from_checkpoint=...)``, once the Trainer has loaded the weights,
selzero refreshes its masters from them and loads its folder. selzero's own figures (parameters
skipped this step) are added to the training logs before the Trainer records them.

Beside DeepSpeed (``TrainingArguments(deepspeed=...)``) the registered ``deepspeed.initialize``
does the work (the callback sets the config's ``"selected_zero2"`` entry when it has none) and
the DeepSpeed engine's ``save_checkpoint`` / ``load_checkpoint`` carry the folder; the callback
only adds the logs.
"""

from __future__ import annotations

import functools
import logging
import os
import sys
import warnings
from typing import Any

import torch
import torch.distributed as dist

from .accelerate import prepare as accelerate_prepare
from .accelerate import resolve_config
from .checkpoint import host as host_checkpoint
from .config import SelZeroConfig
from .core.selection import resolve_selection
from .core.zero2 import SelectedZero2
from .errors import CheckpointError, ConfigError, UsageError

try:  # the callback is a TrainerCallback when transformers is installed
    from transformers import TrainerCallback as _Base
except ImportError:  # pragma: no cover - exercised only without transformers
    _Base = object  # type: ignore[assignment,misc]

logger = logging.getLogger("selzero_plugin")

__all__ = ["SelectedZero2Callback"]

LOG_KEYS = ("selzero/updated", "selzero/skipped_absent", "selzero/skipped_nonfinite")


class SelectedZero2Callback(_Base):  # type: ignore[misc,valid-type]
    """ZeRO-2 for the parameters ``config`` selects, inside a ``transformers.Trainer``.

    ``config``: a :class:`SelZeroConfig`, a dict of its fields, a YAML/JSON path, or ``None``
    for ``SELZERO_CONFIG``. It is used exactly as given; the Trainer's loss is token-normalized
    and scaled for DDP averaging, so its ``reduction`` must be ``mean``. ``fresh_start=True``
    resumes from a checkpoint saved without selzero (its optimizer state for the selected
    parameters starts anew; by default that is an error).
    """

    def __init__(self, config: Any = None, *, fresh_start: bool = False) -> None:
        self.config: SelZeroConfig = resolve_config(config)
        if self.config.reduction != "mean":
            raise ConfigError(
                f"SelectedZero2Callback: reduction={self.config.reduction!r}, expected 'mean'. "
                "The Trainer divides its loss by the global token count and multiplies it by the "
                "number of processes to undo DDP's averaging, so selzero must average too; set "
                "reduction: mean.")
        self.fresh_start = bool(fresh_start)
        self.trainer: Any = None
        self._resume: str | None = None
        self._figures = dict.fromkeys(LOG_KEYS, 0)
        self._presence: dict[str, int] = {}  # per expert: most ranks that routed to it
        self._steps_since_log = 0
        self._saved_in: str | None = None  # the checkpoint folder selzero last wrote into

    # ---- where selzero comes in ------------------------------------------------------------

    @property
    def selzero(self) -> Any:
        """The SelectedZero2 instance (None before training starts)."""
        return getattr(self._owner(), "selzero", None)

    def _owner(self) -> Any:
        """What holds ``selzero`` and ``selzero_step_result``: the Trainer's accelerator (DDP,
        one process) or the DeepSpeed engine."""
        if self.trainer is None:
            return None
        acc = self.trainer.accelerator
        if getattr(acc, "selzero", None) is not None:
            return acc
        return getattr(self.trainer, "model_wrapped", None)

    def on_init_end(self, args: Any, state: Any, control: Any, model: Any = None,
                    **kwargs: Any) -> Any:
        trainer = _calling_trainer()
        if self.trainer is not None and self.trainer is not trainer:
            raise UsageError("SelectedZero2Callback: this callback is already attached to another "
                             "Trainer; give each Trainer its own SelectedZero2Callback(config).")
        others = [cb for cb in trainer.callback_handler.callbacks
                  if isinstance(cb, SelectedZero2Callback) and cb is not self]
        if others:
            raise UsageError(
                f"SelectedZero2Callback: the Trainer has {len(others) + 1} of them; give it one, "
                "whose config selects every parameter selzero should own (params takes a list "
                "of patterns).")
        self.trainer = trainer
        if getattr(args, "fp16", False):
            raise ConfigError("SelectedZero2Callback with TrainingArguments(fp16=True): the "
                              "Trainer's fp16 loss scaling is not tested with selzero (a plain "
                              "loop's torch.amp.GradScaler is); use bf16=True (or neither).")
        _warn_fused_experts(trainer.model, self.config)
        if trainer.is_deepspeed_enabled:
            self._via_deepspeed(trainer)
        else:
            self._route_prepare(trainer)
        self._wrap_train(trainer)
        self._wrap_log(trainer)
        self._wrap_save(trainer)
        return control

    def _wrap_save(self, trainer: Any) -> None:
        """selzero's folder is written inside the Trainer's checkpoint save, with its optimizer
        state and before the Trainer rotates old checkpoints away: a save that fails leaves the
        previous complete checkpoint in place. (Under DeepSpeed the engine's save_checkpoint,
        called from the same method, writes it.)"""
        original = getattr(trainer, "_save_optimizer_and_scheduler", None)
        if original is None or trainer.is_deepspeed_enabled:
            return
        callback = self

        @functools.wraps(original)
        def save_optimizer_and_scheduler(output_dir: str, *args: Any, **kwargs: Any) -> Any:
            out = original(output_dir, *args, **kwargs)
            sz = callback.selzero
            if sz is not None:
                host_checkpoint.save_into(output_dir, [sz])
            callback._saved_in = output_dir
            return out

        trainer._save_optimizer_and_scheduler = save_optimizer_and_scheduler

    def _route_prepare(self, trainer: Any) -> None:
        acc = trainer.accelerator
        original = acc.prepare
        config = self.config

        @functools.wraps(original)
        def prepare(*objects: Any, **kwargs: Any) -> Any:
            models = [o for o in objects if isinstance(o, torch.nn.Module)]
            built = getattr(acc, "selzero", None)
            if built is not None and any(m is not built.model for m in models):
                raise UsageError(
                    "SelectedZero2Callback: the Trainer prepares a new model (model_init, "
                    "hyperparameter_search, or a second train() that rebuilt it) but selzero is "
                    "bound to the first one; build a new Trainer (with a new callback) for "
                    "each model.")
            takes_over = built is None and models \
                and not getattr(acc, "_selzero_preparing", False) \
                and any(isinstance(o, torch.optim.Optimizer) for o in objects)
            if not takes_over:
                return original(*objects, **kwargs)
            acc.prepare = original  # selzero's prepare calls the Accelerator's own
            try:
                return accelerate_prepare(acc, *objects, config=config, **kwargs)
            finally:
                acc.prepare = prepare

        acc.prepare = prepare

    def _via_deepspeed(self, trainer: Any) -> None:
        import selzero_plugin.deepspeed  # noqa: F401 - registers the wrapped deepspeed.initialize

        acc = trainer.accelerator
        if self.fresh_start:  # the Trainer's deepspeed_load_checkpoint cannot pass the flag
            original = acc.prepare

            @functools.wraps(original)
            def prepare(*objects: Any, **kwargs: Any) -> Any:
                out = original(*objects, **kwargs)
                for o in out if isinstance(out, (tuple, list)) else [out]:
                    if getattr(o, "selzero", None) is not None:
                        o.selzero_fresh_start = True
                return out

            acc.prepare = prepare
        ds = acc.state.deepspeed_plugin.deepspeed_config
        entry = ds.get("selected_zero2")
        if entry is None:
            ds["selected_zero2"] = self.config.to_dict()
            return
        mine = self.config.to_dict()
        # every field, not only the selection (review finding: the entry's partition and
        # param_groups silently won over the callback's)
        theirs = SelZeroConfig.from_dict({k: v for k, v in dict(entry).items()
                                          if k != "group"}).to_dict()
        differ = sorted(k for k in mine if theirs[k] != mine[k])
        if differ:
            raise ConfigError(
                f"SelectedZero2Callback: the DeepSpeed config's 'selected_zero2' entry and the "
                f"callback's config differ ({', '.join(differ)}: "
                f"{ {k: theirs[k] for k in differ} } vs { {k: mine[k] for k in differ} }); "
                "keep one of them (the entry alone is enough under DeepSpeed).")

    def _wrap_train(self, trainer: Any) -> None:
        original = trainer.train
        callback = self

        @functools.wraps(original)
        def train(resume_from_checkpoint: Any = None, *args: Any, **kwargs: Any) -> Any:
            folder = resume_from_checkpoint
            if isinstance(folder, bool):
                if folder:
                    from transformers.trainer_utils import get_last_checkpoint

                    folder = get_last_checkpoint(trainer.args.output_dir)
                else:
                    folder = None
            callback._resume = None if folder is None else str(folder)
            return original(resume_from_checkpoint, *args, **kwargs)

        trainer.train = train

    def _wrap_log(self, trainer: Any) -> None:
        original = trainer.log
        callback = self

        @functools.wraps(original)
        def log(logs: dict[str, float], *args: Any, **kwargs: Any) -> Any:
            # the Trainer appends a copy of `logs` to log_history before on_log runs
            if "loss" in logs and callback._steps_since_log:
                logs.update(callback._figures)
                if callback._presence:  # experts no rank routed a token to since the last log
                    logs["selzero/dead_experts"] = sum(
                        1 for k in callback._presence.values() if k == 0)
                    logs["selzero/experts"] = len(callback._presence)
                callback._figures = dict.fromkeys(LOG_KEYS, 0)
                callback._presence = {}
                callback._steps_since_log = 0
            return original(logs, *args, **kwargs)

        trainer.log = log

    # ---- events ----------------------------------------------------------------------------

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        sz = self.selzero
        if sz is None:
            raise UsageError(
                "SelectedZero2Callback: the Trainer started training but selzero was not built "
                "(its accelerator.prepare(model, optimizer) did not run, e.g. a model wrapped "
                "before the Trainer got it); pass the plain model to the Trainer.")
        model = kwargs.get("model")
        if model is not None and not self.trainer.is_deepspeed_enabled and model is not sz.model:
            raise UsageError("SelectedZero2Callback: the Trainer trains another model than the "
                             "one selzero was built on; build a new Trainer (with a new "
                             "callback) for each model.")
        if self._resume is not None and not self.trainer.is_deepspeed_enabled:
            # the Trainer loaded the weights (before prepare, or after it under FSDP): refresh
            # the masters from them, then load the folder (masters and optimizer state)
            sz.sync_from_params()
            if host_checkpoint.has_folder(self._resume):
                host_checkpoint.load_from(self._resume, [sz])
            elif not self.fresh_start:
                raise CheckpointError(
                    f"resume_from_checkpoint={self._resume!r}: no {host_checkpoint.FOLDER}/ "
                    "folder in it (saved without selzero?). Resume from a checkpoint saved with "
                    "SelectedZero2Callback, or pass SelectedZero2Callback(config, "
                    "fresh_start=True) to start the selected parameters' optimizer state anew.")
            else:
                _drop_host_state(sz)
        return control

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        result = getattr(self._owner(), "selzero_step_result", None)
        if result is not None:
            self._figures["selzero/updated"] += result.updated
            self._figures["selzero/skipped_absent"] += result.skipped_absent
            self._figures["selzero/skipped_nonfinite"] += result.skipped_nonfinite
            seen = self._presence
            for name, ranks in result.expert_presence.items():
                seen[name] = max(seen.get(name, 0), ranks)
        self._steps_since_log += 1
        return control

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        if self.trainer.is_deepspeed_enabled:
            return control  # the engine's save_checkpoint wrote it into its tag folder
        from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

        sz = self.selzero
        if sz is None:
            return control
        run_dir = self.trainer._get_output_dir(trial=getattr(self.trainer, "_trial", None)) \
            if hasattr(self.trainer, "_get_output_dir") else args.output_dir  # as _save_checkpoint
        folder = os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")
        written = self._saved_in is not None and \
            os.path.normpath(self._saved_in) == os.path.normpath(folder)
        if args.save_only_model or written:
            return control  # no optimizer state saved, or written inside the save already
        host_checkpoint.save_into(folder, [sz])
        return control


def _calling_trainer() -> Any:
    """The ``transformers.Trainer`` whose ``__init__`` fires ``on_init_end``."""
    from transformers import Trainer

    frame = sys._getframe(1)
    while frame is not None:
        candidate = frame.f_locals.get("self")
        if isinstance(candidate, Trainer):
            return candidate
        frame = frame.f_back
    raise UsageError("SelectedZero2Callback: on_init_end was not called by a transformers.Trainer; "
                     "add the callback with Trainer(..., callbacks=[SelectedZero2Callback(cfg)]).")


def _warn_fused_experts(model: Any, config: SelZeroConfig) -> None:
    """transformers' MoE layers store experts fused ((E, ...) tensors): without ``expert_dim``
    each is one parameter (an expert that got no tokens is still decayed and moved)."""
    if config.expert_dim is not None or model is None:
        return
    try:
        entries = resolve_selection(model, params=list(config.params),
                                    modules=list(config.modules), expert_dim=0)
    except Exception:  # the real selection reports its own errors at prepare
        return
    fused = [e.name for e in entries if e.num_experts]
    if fused:
        warnings.warn(
            f"selzero: {len(fused)} selected parameters are fused expert tensors (e.g. "
            f"{fused[0]!r}, {entries[[e.name for e in entries].index(fused[0])].num_experts} "
            "experts) and expert_dim is not set, so each is treated as one parameter: an expert "
            "that got no tokens is still updated (weight decay, momentum). Set expert_dim: 0 to "
            "treat each expert as its own parameter.", UserWarning, stacklevel=3)


def _drop_host_state(sz: SelectedZero2) -> None:
    """fresh_start: the Trainer loaded the host optimizer's state from a checkpoint saved
    without selzero, full-size state for the selected parameters among it, which nothing would
    read or update again (and every later optimizer.pt would carry): drop it, say so (review
    finding)."""
    host = sz.host_optimizer
    if host is None:
        return
    dropped = [e.name for e in sz.trainable if host.state.pop(e.param, None) is not None]
    if dropped and sz.comm.rank == 0:
        logger.warning("selzero: fresh_start: dropped the host optimizer's state for %d selected "
                       "parameter(s) loaded from a checkpoint saved without selzero (e.g. %s); "
                       "selzero starts their optimizer state anew.", len(dropped), dropped[0])
