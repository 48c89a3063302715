"""Accelerate: ``selzero-accelerate launch --selzero_config FILE ...`` and ``prepare()``.

``selzero-accelerate launch`` takes every ``accelerate launch`` flag (it reuses Accelerate's own
parser) plus ``--selzero_config``; it checks the config before any process starts, exports it
as ``SELZERO_CONFIG`` and hands over to Accelerate's launch, running the training script through
a small bootstrap that routes the script's first ``Accelerator.prepare(model, optimizer, ...)``
through :func:`prepare`. A script can also call ``selzero_plugin.accelerate.prepare(accelerator,
*objects)`` itself.

[Note: Accelerate adapter]
Host DDP: the selected parameters are marked ignored before Accelerate wraps the model (DDP then
neither averages nor broadcasts them; selzero broadcasts them at construction). Host DeepSpeed:
the config's ``"selected_zero2"`` entry is set from the selzero config and the DeepSpeed
registration does the rest. Accelerate's vocabulary maps onto the core's phases: micro-steps
inside ``accelerator.accumulate`` / ``no_sync`` are local (the prepared model's ``no_sync``
covers selzero), a backward outside it that is not at a sync step ends a micro-step,
``accelerator.clip_grad_norm_`` computes the one global norm, the prepared optimizer's step
(at a sync step) is followed by ``sz.step()``, which mirrors the host optimizer's scheduled
values; ``save_state`` / ``load_state`` carry ``selected_zero2/`` inside the state folder.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
from pathlib import Path
from typing import Any, Iterator, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ._methods import replace_method
from .checkpoint import host as host_checkpoint
from .config import ENV_CONFIG_FILE, SelZeroConfig
from .core.clip import clip_grad_norm_
from .core.selection import resolve_selection
from .core.window import WindowState
from .core.zero2 import SelectedZero2
from .errors import ConfigError, SelectionError, UsageError

__all__ = ["prepare", "main", "resolve_config", "refuse_trainer_without_callback"]


def resolve_config(config: Any = None) -> SelZeroConfig:
    """A SelZeroConfig from ``config`` (a SelZeroConfig, a dict, a path) or ``SELZERO_CONFIG``."""
    if isinstance(config, SelZeroConfig):
        return config
    if isinstance(config, dict):
        return SelZeroConfig.from_dict(config)
    if config is not None:
        return SelZeroConfig.from_file(config)
    if not os.environ.get(ENV_CONFIG_FILE):
        raise ConfigError(f"selzero_plugin.accelerate.prepare: no config given and "
                          f"{ENV_CONFIG_FILE} is not set; pass config=... or launch with "
                          "`selzero-accelerate launch --selzero_config FILE ...`.")
    return SelZeroConfig.from_env()  # the file, then SELZERO_<FIELD> overrides


def refuse_trainer_without_callback() -> None:
    """The launcher's routing reached from a ``transformers.Trainer`` (its prepare) that has no
    ``SelectedZero2Callback``: selzero would train, but the Trainer's checkpoints would not hold
    selzero's folder, so a resume would silently reset the subset's optimizer state. With the
    callback the Trainer's prepare goes through it and never reaches the launcher's routing."""
    trainers = sys.modules.get("transformers")
    trainer_cls = getattr(trainers, "Trainer", None) if trainers is not None else None
    if trainer_cls is None:
        return
    from .trainer import SelectedZero2Callback

    frame = sys._getframe(1)
    while frame is not None:
        trainer = frame.f_locals.get("self")
        if isinstance(trainer, trainer_cls):
            handler = getattr(trainer, "callback_handler", None)
            if any(isinstance(cb, SelectedZero2Callback)
                   for cb in getattr(handler, "callbacks", [])):
                return
            raise ConfigError(
                "selzero-accelerate launch runs a transformers Trainer without "
                "SelectedZero2Callback: the Trainer's checkpoints would not hold selzero's state "
                "(a resume would silently restart the experts' optimizer state). Add the "
                "callback: Trainer(..., callbacks=[SelectedZero2Callback()]) (it reads the "
                "launcher's --selzero_config), and launch as before.")
        frame = frame.f_back


def _config_source() -> str:
    path = os.environ.get(ENV_CONFIG_FILE)
    return f"the selzero config ({path})" if path else "the selzero config"


def _refuse_conflicting_block(block: Any, cfg: SelZeroConfig) -> None:
    """A DeepSpeed file that has its own "selected_zero2" block beside --selzero_config: the
    same fields may repeat, different values are refused (the file's would win silently)."""
    if block is None:
        return
    if not isinstance(block, dict):
        raise ConfigError(f"the DeepSpeed config's \"selected_zero2\" is {block!r}, not an object "
                          f"of selzero fields; remove it and keep {_config_source()}.")
    mine = cfg.to_dict()
    differ = {}
    for key, value in block.items():
        if key == "group":
            continue
        try:
            theirs = SelZeroConfig.from_dict({**mine, key: value}).to_dict()[key]
        except ConfigError as e:
            raise ConfigError(f"the DeepSpeed config's \"selected_zero2\" block: {e}") from None
        if theirs != mine.get(key):
            differ[key] = (value, mine.get(key))
    if differ:
        details = "; ".join(f"{k}: DeepSpeed file {a!r}, --selzero_config {b!r}"
                            for k, (a, b) in differ.items())
        raise ConfigError(
            f"the DeepSpeed config has its own \"selected_zero2\" block that differs from "
            f"{_config_source()} ({details}). One of them would be dropped silently: remove the "
            "block from the DeepSpeed file, or launch without --selzero_config.")


def _refuse_nothing_left_for_ddp(model: nn.Module, sz: SelectedZero2 | None,
                                 cfg: SelZeroConfig) -> None:
    if sz is not None:
        selected = {id(e.param) for e in sz.entries}
        if any(p.requires_grad and id(p) not in selected for p in model.parameters()):
            return
    raise ConfigError(
        f"{_config_source()} selects every trainable parameter (params={list(cfg.params)!r}): "
        "nothing is left for Accelerate's DistributedDataParallel, which then refuses the model "
        "(\"DistributedDataParallel is not needed...\"). Select the subset to shard (e.g. "
        "params: [\"*.experts.*\"]) and leave the rest to DDP; to shard every parameter, use "
        "FSDP2 (fsdp_version: 2) or DeepSpeed ZeRO as Accelerate's host instead.")


def prepare(accelerator: Any, *objects: Any, config: Any = None, **prepare_kwargs: Any) -> Any:
    """``accelerator.prepare(*objects)`` with selzero on the config's parameters (same return)."""
    from accelerate.utils import DistributedType

    pending = getattr(accelerator, "_selzero_pending", None)
    if pending is not None:  # the model was prepared alone before: this call has its optimizer
        return _complete(accelerator, pending, objects, prepare_kwargs)
    if getattr(accelerator, "selzero", None) is not None:
        raise UsageError("selzero_plugin.accelerate.prepare: this Accelerator already prepared "
                         "a model with selzero; prepare the model and its optimizer once.")
    cfg = resolve_config(config)
    kind = accelerator.distributed_type
    if str(getattr(accelerator, "mixed_precision", "no")) == "fp16":
        raise ConfigError("selzero with Accelerate's fp16 mixed precision: Accelerate's loss "
                          "scaling is not tested with selzero (a plain loop's "
                          "torch.amp.GradScaler is); use --mixed_precision bf16 (or no).")
    if kind == DistributedType.DEEPSPEED:
        import selzero_plugin.deepspeed  # noqa: F401 - the registration does the work

        ds = accelerator.state.deepspeed_plugin.deepspeed_config
        block = ds.get("selected_zero2")
        _refuse_conflicting_block(block, cfg)
        # the file's block agrees with the config where it says anything: the config's fields
        # (also those the block leaves out: review finding, they fell back to defaults), plus
        # the block's "group" (expert parallelism), which a SelZeroConfig has no field for
        group = {"group": block["group"]} if isinstance(block, dict) and "group" in block else {}
        ds["selected_zero2"] = {**cfg.to_dict(), **group}
        out = accelerator.prepare(*objects, **prepare_kwargs)
        return out
    fsdp = kind == DistributedType.FSDP
    if fsdp and not accelerator.is_fsdp2:
        raise UsageError("selzero_plugin.accelerate.prepare: FSDP1 is not supported; use FSDP2 "
                         "(fsdp_version: 2 in the Accelerate config).")
    if kind not in (DistributedType.NO, DistributedType.MULTI_CPU, DistributedType.MULTI_GPU) \
            and not fsdp:
        raise UsageError(f"selzero_plugin.accelerate.prepare: Accelerate's distributed type "
                         f"{kind} is not supported yet; use DDP (multi-CPU/GPU), FSDP2 or "
                         "DeepSpeed.")
    models = [o for o in objects if isinstance(o, nn.Module)]
    optimizers = [o for o in objects if isinstance(o, torch.optim.Optimizer)]
    if len(models) != 1 or len(optimizers) > 1:
        raise UsageError(f"selzero_plugin.accelerate.prepare: expected one model (and its "
                         f"optimizer) among the objects, got {len(models)} model(s) and "
                         f"{len(optimizers)} optimizer(s); prepare one model with selzero.")
    model = models[0]
    earlier = None if optimizers else _prepared_optimizer_of(accelerator, model)
    if not optimizers and earlier is None:
        if fsdp:
            raise UsageError("selzero_plugin.accelerate.prepare: under FSDP2 prepare the model "
                             "together with its optimizer: accelerator.prepare(model, "
                             "optimizer, ...).")
        return _prepare_model_first(accelerator, model, cfg, kind, objects, prepare_kwargs)
    host_opt = optimizers[0] if optimizers else earlier.optimizer
    _check_optimizer_holds_selection(model, cfg, host_opt)
    if fsdp and str(accelerator.mixed_precision) != "no":
        # Accelerate's FSDP2 prepare upcasts every trainable non-fp32 parameter to fp32
        # (fsdp_utils.fsdp2_prepare_model): do the same to the selected ones first, so selzero
        # is built on the dtype they train in
        with torch.no_grad():
            for p in model.parameters():
                if p.requires_grad and p.dtype != torch.float32 and p.is_floating_point():
                    p.data = p.data.to(torch.float32)
    if getattr(accelerator, "device_placement", True):
        # where prepare would put it, before selzero binds its segments to the parameters'
        # storage (moving the module later would replace that storage)
        model.to(accelerator.device)
    sz = SelectedZero2(model, cfg, host_opt)  # (a selection of nothing is refused there)
    if kind in (DistributedType.MULTI_CPU, DistributedType.MULTI_GPU):
        _refuse_nothing_left_for_ddp(model, sz, cfg)
    if fsdp:
        _ignore_in_fsdp_plugin(accelerator.state.fsdp_plugin, model, [e.param for e in sz.entries])
    elif kind != DistributedType.NO:
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(
            model, [n for e in sz.entries for n in e.names])
    accelerator._selzero_preparing = True  # the launcher's patched prepare steps aside
    try:
        out = accelerator.prepare(*objects, **prepare_kwargs)
    finally:
        accelerator._selzero_preparing = False
    # prepare may have moved the model again (model.to(cpu:0) copies parameters that are on
    # "cpu"): point selzero at the parameters' storage as it is now
    sz.sync_from_params()
    prepared = list(out) if isinstance(out, (tuple, list)) else [out]
    wrapped_model = prepared[_index(objects, model)]
    wrapped_opt = prepared[_index(objects, host_opt)] if optimizers else earlier
    _install(accelerator, sz, wrapped_model, wrapped_opt)
    return out


def _index(objects: Sequence[Any], obj: Any) -> int:
    return next(i for i, o in enumerate(objects) if o is obj)


def _prepared_optimizer_of(accelerator: Any, model: nn.Module) -> Any:
    """An optimizer prepared before the model (``accelerator.prepare(optimizer)`` first) that
    holds the model's parameters: the AcceleratedOptimizer, or None."""
    params = {id(p) for p in model.parameters()}
    for wrapped in getattr(accelerator, "_optimizers", []):
        inner = getattr(wrapped, "optimizer", wrapped)
        if any(id(p) in params for g in inner.param_groups for p in g["params"]):
            return wrapped
    return None


# [Note: model prepared alone]
# Many scripts prepare the model and the optimizer in separate calls (model first). DDP must be
# told which parameters to leave to selzero before it wraps the model, but selzero is built on
# the host optimizer: the model's call resolves the selection, marks it ignored for DDP and
# prepares the model; the optimizer's call builds selzero (on the unwrapped model) and installs
# it. A forward before that call would train the selection as nobody's (DDP ignores it): it
# raises on every rank instead.


def _prepare_model_first(accelerator: Any, model: nn.Module, cfg: SelZeroConfig, kind: Any,
                         objects: Sequence[Any], prepare_kwargs: dict[str, Any]) -> Any:
    from accelerate.utils import DistributedType

    entries = resolve_selection(model, params=list(cfg.params), modules=list(cfg.modules),
                                expert_dim=cfg.expert_dim)
    if kind != DistributedType.NO:
        selected = {id(e.param) for e in entries}
        if not any(p.requires_grad and id(p) not in selected for p in model.parameters()):
            _refuse_nothing_left_for_ddp(model, None, cfg)
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(
            model, [n for e in entries for n in e.names])
    if getattr(accelerator, "device_placement", True):
        model.to(accelerator.device)

    def not_yet(_module: nn.Module, _args: Any) -> None:
        raise UsageError(
            "selzero: the model was prepared without its optimizer and has not been given it "
            "yet; call accelerator.prepare(optimizer) (selzero is built there) before the first "
            "forward.")

    guard = model.register_forward_pre_hook(not_yet)
    accelerator._selzero_preparing = True
    try:
        out = accelerator.prepare(*objects, **prepare_kwargs)
    finally:
        accelerator._selzero_preparing = False
    prepared = list(out) if isinstance(out, (tuple, list)) else [out]
    accelerator._selzero_pending = (model, prepared[_index(objects, model)], cfg, guard)
    return out


def _complete(accelerator: Any, pending: tuple[Any, ...], objects: Sequence[Any],
              prepare_kwargs: dict[str, Any]) -> Any:
    model, wrapped_model, cfg, guard = pending
    optimizers = [o for o in objects if isinstance(o, torch.optim.Optimizer)]
    if not optimizers:  # a dataloader or scheduler in between
        return _prepare_plain(accelerator, objects, prepare_kwargs)
    host_opt = optimizers[0]
    _check_optimizer_holds_selection(model, cfg, host_opt)
    sz = SelectedZero2(model, cfg, host_opt)
    out = _prepare_plain(accelerator, objects, prepare_kwargs)
    sz.sync_from_params()
    prepared = list(out) if isinstance(out, (tuple, list)) else [out]
    guard.remove()
    del accelerator._selzero_pending
    _install(accelerator, sz, wrapped_model, prepared[_index(objects, host_opt)])
    return out


def _prepare_plain(accelerator: Any, objects: Sequence[Any], prepare_kwargs: dict[str, Any]
                   ) -> Any:
    accelerator._selzero_preparing = True  # the launcher's patched prepare steps aside
    try:
        return accelerator.prepare(*objects, **prepare_kwargs)
    finally:
        accelerator._selzero_preparing = False


def _check_optimizer_holds_selection(model: nn.Module, cfg: SelZeroConfig,
                                     optimizer: torch.optim.Optimizer) -> None:
    """Without selzero, a parameter the optimizer does not hold is not trained: refuse rather
    than train it (selzero's optimizer mirrors the host's groups)."""
    held = {id(p) for g in optimizer.param_groups for p in g["params"]}
    try:
        entries = resolve_selection(model, params=list(cfg.params), modules=list(cfg.modules),
                                    expert_dim=cfg.expert_dim)
    except SelectionError:
        return  # SelectedZero2 reports it on every rank
    missing = [e.name for e in entries if not e.frozen and id(e.param) not in held]
    if missing:
        raise UsageError(
            f"selzero: {len(missing)} selected parameter(s) are not in the optimizer given to "
            f"prepare, e.g. {missing[:3]}; without selzero they would not be trained. Add them "
            "to the optimizer (selzero takes their group's hyperparameters) or leave them out of "
            "params.")


class _IgnoredParameters(nn.Module):
    """The selected parameters as one module of their own, for Accelerate's FSDP2
    ``ignored_modules`` (a list of modules whose ``parameters()`` become ``fully_shard``'s
    ``ignored_params``). It is a real ``nn.Module`` because Accelerate treats it as one: since
    1.16 it calls ``.to(accelerator.device)`` on every entry. It is not a child of the model:
    the model's names, state dict and modules are unchanged."""

    def __init__(self, params: list[nn.Parameter]) -> None:
        super().__init__()
        for i, p in enumerate(params):
            self.register_parameter(f"selected_{i}", p)


def _ignore_in_fsdp_plugin(plugin: Any, model: nn.Module, params: list[nn.Parameter]) -> None:
    """Add the selected parameters to the FSDP2 plugin's ``ignored_modules`` (Accelerate passes
    them to every ``fully_shard`` as ``ignored_params``), keeping what it already held."""
    import re

    existing = plugin.ignored_modules
    if isinstance(existing, str):
        pattern = re.compile(existing)
        existing = [m for n, m in model.named_modules() if pattern.fullmatch(n)]
    plugin.ignored_modules = [*(existing or []), _IgnoredParameters(params)]


def _install(accelerator: Any, sz: SelectedZero2, model: Any, optimizer: Any) -> None:
    selected = {id(e.param) for e in sz.entries}
    if isinstance(model, DistributedDataParallel):
        # the prepared model's no_sync covers selzero (Accelerate's no_sync and accumulate
        # enter it too)
        ddp_no_sync = model.no_sync

        @contextlib.contextmanager
        def model_no_sync() -> Iterator[None]:
            with ddp_no_sync(), sz.no_sync():
                yield

        model.no_sync = model_no_sync
    else:  # FSDP2 (set_requires_gradient_sync) or one process: through Accelerate's no_sync
        orig_no_sync = accelerator.no_sync

        @contextlib.contextmanager
        def no_sync(model: Any) -> Iterator[None]:  # also what accelerator.accumulate enters
            with orig_no_sync(model), sz.no_sync():
                yield

        accelerator.no_sync = no_sync

    orig_backward = accelerator.backward

    @functools.wraps(orig_backward)
    def backward(loss: torch.Tensor, **kwargs: Any) -> Any:
        if sz.state is WindowState.AWAITING_CLOSE:
            # manual accumulation without no_sync (DDP reduces every micro-step): the previous
            # backward's micro-step ends here, before this one reaches selzero
            sz.end_microstep()
        out = orig_backward(loss, **kwargs)
        if not accelerator.sync_gradients and sz.state in (WindowState.OPEN,
                                                           WindowState.AWAITING_CLOSE):
            sz.end_microstep()  # a reduced micro-step outside no_sync, before the sync step
        return out

    orig_clip = accelerator.clip_grad_norm_

    @functools.wraps(orig_clip)
    def clip(parameters: Any, max_norm: float, norm_type: float = 2) -> torch.Tensor:
        params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        host = [p for p in params if id(p) not in selected]
        given = len(params) - len(host)
        if given == 0:  # the caller clips host parameters only
            return orig_clip(host, max_norm, norm_type)
        if given < len(selected):
            raise UsageError(
                f"accelerator.clip_grad_norm_: {given} of selzero's {len(selected)} parameters "
                "were given; selzero clips its subset as a whole. Pass all of them (e.g. "
                "model.parameters()) or none.")
        return clip_grad_norm_(host, max_norm, subsets=[sz], norm_type=norm_type)

    orig_step = optimizer.step

    @functools.wraps(orig_step)
    def step(*args: Any, **kwargs: Any) -> Any:
        if not accelerator.sync_gradients:
            return orig_step(*args, **kwargs)
        out = orig_step(*args, **kwargs)
        if getattr(optimizer, "step_was_skipped", False):  # fp16 overflow: the host skipped
            sz.zero_grad()
        else:
            accelerator.selzero_step_result = sz.step()
        return out

    orig_zero_grad = optimizer.zero_grad

    @functools.wraps(orig_zero_grad)
    def zero_grad(*args: Any, **kwargs: Any) -> Any:
        # what the host's zero_grad drops (Accelerate's zeroes at sync steps only), selzero's
        # window drops too: a batch skipped after backward (a loss-spike guard) is not folded
        # into the next step. At every sync step, so that every rank makes the same call
        # (sz.zero_grad is a small collective; after step() the window is empty already)
        out = orig_zero_grad(*args, **kwargs)
        if accelerator.sync_gradients:
            sz.zero_grad()
        return out

    orig_save, orig_load = accelerator.save_state, accelerator.load_state

    @functools.wraps(orig_save)
    def save_state(output_dir: str | None = None, *args: Any, **kwargs: Any) -> Any:
        location = orig_save(output_dir, *args, **kwargs)
        host_checkpoint.save_into(location, [sz])
        return location

    @functools.wraps(orig_load)
    def load_state(input_dir: str | None = None, *args: Any, **kwargs: Any) -> Any:
        folder = os.path.expanduser(input_dir) if input_dir is not None \
            else _latest_state(accelerator)
        out = orig_load(folder, *args, **kwargs)
        host_checkpoint.load_from(folder, [sz])
        return out

    accelerator.backward = backward
    accelerator.clip_grad_norm_ = clip
    replace_method(optimizer, "step", step)
    replace_method(optimizer, "zero_grad", zero_grad)
    accelerator.save_state = save_state
    accelerator.load_state = load_state
    accelerator.selzero = sz
    accelerator.selzero_step_result = None


def _latest_state(accelerator: Any) -> str:
    """The folder ``load_state()`` picks without an argument (Accelerate's own rule: the
    highest-numbered folder under ``project_dir/checkpoints`` with automatic naming)."""
    import re

    if not accelerator.project_configuration.automatic_checkpoint_naming:
        raise UsageError("accelerator.load_state() without a folder needs "
                         "ProjectConfiguration(automatic_checkpoint_naming=True); pass the "
                         "state folder (input_dir=...).")
    root = os.path.join(accelerator.project_dir, "checkpoints")
    folders = [os.path.join(root, f) for f in os.listdir(root)]
    folders.sort(key=lambda f: [int(x) for x in re.findall(r"[\/]?([0-9]+)(?=[^\/]*$)", f)][0])
    return folders[-1]


# ---- the launcher -------------------------------------------------------------------------


BOOTSTRAP = Path(__file__).with_name("_accelerate_bootstrap.py")


def _launch_parser() -> Any:
    """Accelerate's own ``launch`` parser with ``--selzero_config`` added."""
    from accelerate.commands.launch import launch_command_parser

    parser = launch_command_parser()
    parser.prog = "selzero-accelerate launch"
    parser.description = ("Accelerate's `accelerate launch`, with one more flag: --selzero_config "
                          "FILE gives the parameters it selects to selzero (ZeRO-2 for a chosen "
                          "subset); the training script needs no change.")
    parser.add_argument("--selzero_config", default=None,
                        help="selzero YAML/JSON config: ZeRO-2 for the parameters it selects")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """``selzero-accelerate launch [accelerate launch flags] --selzero_config FILE script ...``"""
    from accelerate.commands.launch import launch_command

    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] in (["-h"], ["--help"]):
        _launch_parser().print_help()
        return 0
    if argv[:1] == ["--version"]:
        from . import __version__

        print(f"selzero-accelerate (selzero {__version__})")
        return 0
    if not argv or argv[0] != "launch":
        print("usage: selzero-accelerate launch --selzero_config FILE [accelerate launch flags] "
              "script.py [script args]\n(selzero-accelerate --help: every flag)", file=sys.stderr)
        return 2
    parser = _launch_parser()
    args = parser.parse_args(argv[1:])
    if args.selzero_config is not None:
        path = os.path.abspath(args.selzero_config)
        try:  # a clear error before any process starts (the file and SELZERO_* overrides)
            SelZeroConfig.from_env({**os.environ, ENV_CONFIG_FILE: path})
        except ConfigError as e:
            print(f"selzero-accelerate: --selzero_config {args.selzero_config}: {e}",
                  file=sys.stderr)
            return 2
        os.environ[ENV_CONFIG_FILE] = path
        if getattr(args, "module", False):
            print("selzero-accelerate: --module with --selzero_config is not supported; pass "
                  "the script's path.", file=sys.stderr)
            return 2
        args.training_script_args = [args.training_script, *args.training_script_args]
        args.training_script = str(BOOTSTRAP)
    launch_command(args)
    return 0
