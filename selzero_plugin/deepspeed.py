"""DeepSpeed: the ``"selected_zero2"`` config entry.

``import selzero_plugin.deepspeed`` registers the plugin: ``deepspeed.initialize`` (yours,
Accelerate's, the HF Trainer's) then honours a top-level ``"selected_zero2"`` block of the
DeepSpeed config; ``selzero_plugin.deepspeed.initialize`` does the same explicitly. Without the
block nothing changes.

[Note: DeepSpeed adapter]
The selected parameters are never handed to DeepSpeed: they are left out of the parameters (and
of a client optimizer's groups) DeepSpeed's optimizer is built on, so ZeRO-1/2 neither partition
nor reduce them; stage 0, which walks every module parameter in ``allreduce_gradients``, is
given a view without them. selzero is built on the engine's module after ``initialize`` (after
DeepSpeed's bf16 cast and its broadcast), with its FP32 masters taken from values snapshotted
before the cast (broadcast from rank 0, as DeepSpeed broadcasts the module).
DeepSpeed's vocabulary maps onto the core's phases:
- a backward that is not at the accumulation boundary ends a micro-step (``end_microstep``),
  in ``engine.backward`` or, after a plain ``loss.backward()``, in ``engine.step``;
- ``engine.step`` at the boundary reduces (``reduce_gradients``) and hands the subset's squared
  norm to DeepSpeed's own norm computation (one patch point per DeepSpeed optimizer wrapper:
  ZeRO's ``scaled_global_norm``, BF16_Optimizer's ``get_grads_for_norm``, FP16_Optimizer's
  ``unscale_and_clip_grads``, stage 0 fp32's ``clip_fp32_gradients``), so DeepSpeed clips by the
  true global norm and ``get_global_grad_norm()`` reports it;
- inside DeepSpeed's optimizer step, once DeepSpeed decided (overflow or not) and before its
  lr scheduler moves, selzero scales its shards by the same clip coefficient and steps with the
  lr of that moment, or drops its window when DeepSpeed skipped the step.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import inspect
import logging
import math
import os
import warnings
from typing import Any, Callable

import torch
from torch import nn

from ._methods import replace_method
from .checkpoint import host as host_checkpoint
from .config import SelZeroConfig
from .core.comm import Communicator
from .core.contract import agree_on_local_errors
from .core.report import StepResult
from .core.optim import stepped_state
from .core.selection import resolve_selection
from .core.window import WindowState
from .core.zero2 import SelectedZero2, owning_instance
from .errors import CheckpointError, ConfigError, SelZeroError, UsageError
from .groups import expert_data_parallel_groups

__all__ = ["initialize", "register", "TESTED_VERSIONS", "ENTRY"]

ENTRY = "selected_zero2"
TESTED_VERSIONS = ("0.19.8", "0.20.0")  # [low, high): the range setup.cfg's extra declares
logger = logging.getLogger("selzero_plugin")

# DeepSpeed internals the plugin wraps: (owner, attribute, parameters it must accept)
_ENGINE_METHODS = {
    "backward": ["loss"], "step": ["lr_kwargs"], "is_gradient_accumulation_boundary": [],
    "allreduce_gradients": [], "clip_fp32_gradients": [], "gradient_clipping": [],
    "save_checkpoint": ["save_dir", "tag", "client_state", "save_latest"],
    "load_checkpoint": ["load_dir", "tag", "load_module_strict", "load_optimizer_states",
                        "load_lr_scheduler_states", "load_module_only"],
    "no_sync": [], "was_step_applied": [], "get_global_grad_norm": [],
    "zero_optimization_stage": [], "bfloat16_enabled": [], "fp16_enabled": [],
}


# ---- registration -------------------------------------------------------------------------


def _version_tuple(v: str) -> tuple[int, ...]:
    out = []
    for part in v.split("+")[0].split(".")[:3]:
        digits = "".join(ch for ch in part if ch.isdigit())
        out.append(int(digits or 0))
    return tuple(out)


def _check_deepspeed(deepspeed: Any) -> None:
    """Every DeepSpeed internal the plugin wraps exists with the parameters it passes."""
    from deepspeed.runtime.engine import DeepSpeedEngine

    problems = []
    for name, needed in _ENGINE_METHODS.items():
        fn = getattr(DeepSpeedEngine, name, None)
        if not callable(fn):
            problems.append(f"DeepSpeedEngine.{name} is missing")
            continue
        params = inspect.signature(inspect.unwrap(fn)).parameters
        takes_any = any(p.kind is p.VAR_KEYWORD for p in params.values())
        missing = [] if takes_any else [p for p in needed if p not in params]
        if missing:
            problems.append(f"DeepSpeedEngine.{name} lacks parameter(s) {missing}")
    try:
        from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer
        if "norm_type" not in inspect.signature(DeepSpeedZeroOptimizer.scaled_global_norm).parameters:
            problems.append("DeepSpeedZeroOptimizer.scaled_global_norm lacks norm_type")
    except (ImportError, AttributeError) as e:
        problems.append(f"DeepSpeedZeroOptimizer.scaled_global_norm: {e}")
    init_params = inspect.signature(deepspeed.initialize).parameters
    for p in ("args", "model", "optimizer", "model_parameters", "config", "config_params"):
        if p not in init_params:
            problems.append(f"deepspeed.initialize lacks parameter {p!r}")
    if problems:
        raise ImportError(
            f"selzero_plugin.deepspeed: DeepSpeed {deepspeed.__version__} does not have the "
            f"internals the plugin wraps: {'; '.join(problems)}. Install a DeepSpeed in the "
            f"tested range (>={TESTED_VERSIONS[0]},<{TESTED_VERSIONS[1]}, the 'deepspeed' extra "
            "of selzero_plugin).")
    version = _version_tuple(deepspeed.__version__)
    if not _version_tuple(TESTED_VERSIONS[0]) <= version < _version_tuple(TESTED_VERSIONS[1]):
        warnings.warn(f"selzero_plugin.deepspeed is tested with DeepSpeed >={TESTED_VERSIONS[0]},"
                      f"<{TESTED_VERSIONS[1]}; this is {deepspeed.__version__}. The internals it "
                      "wraps exist, but check the results.", stacklevel=3)


def register() -> None:
    """Make ``deepspeed.initialize`` honour the ``"selected_zero2"`` entry (idempotent), and
    make every engine construction that did not pass through it refuse the entry."""
    import deepspeed

    if getattr(deepspeed.initialize, "_selzero_wrapped", False):
        return
    _check_deepspeed(deepspeed)
    _guard_engine_construction()
    original = deepspeed.initialize

    @functools.wraps(original)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        return _initialize(original, *args, **kwargs)

    wrapped._selzero_wrapped = True  # type: ignore[attr-defined]
    wrapped._selzero_original = original  # type: ignore[attr-defined]
    deepspeed.initialize = wrapped


# [Note: every path to an engine]
# ``register`` replaces one module attribute, ``deepspeed.initialize``; a program that bound the
# function before (``from deepspeed import initialize`` above ``import selzero_plugin``) calls
# the original, and DeepSpeed ignores keys it does not know: stock ZeRO would train the experts
# (wrong under uneven routing). Every engine is built by ``DeepSpeedEngine.__init__`` (the
# hybrid and pipeline engines are subclasses), so that is where the bypass is caught: an engine
# whose config holds the entry (or a near-miss of its key) and that is not being built by
# selzero's ``_initialize`` raises before DeepSpeed does anything, on every rank (the config is
# the same on every rank; nothing is communicated).
_BUILDING = [0]  # engines under construction by _initialize (nesting: the Trainer's door)


def _guard_engine_construction() -> None:
    from deepspeed.runtime.engine import DeepSpeedEngine

    init = DeepSpeedEngine.__init__
    if getattr(init, "_selzero_wrapped", False):
        return

    @functools.wraps(init)
    def guarded(self: Any, *args: Any, **kwargs: Any) -> None:
        config_class = kwargs.get("config_class")
        params = getattr(config_class, "_param_dict", None)
        if isinstance(params, dict) and not _BUILDING[0]:
            _refuse_near_miss(params)
            if ENTRY in params:
                raise ConfigError(
                    f"the DeepSpeed config has a \"{ENTRY}\" block, but this engine was built "
                    "by a deepspeed.initialize that selzero did not wrap (it was bound before "
                    "`import selzero_plugin.deepspeed`, e.g. `from deepspeed import initialize` "
                    "at the top of the script). DeepSpeed would ignore the block and train the "
                    "selected parameters with stock ZeRO. Import selzero_plugin.deepspeed before "
                    "binding deepspeed.initialize, call deepspeed.initialize(...) through the "
                    "module, or call selzero_plugin.deepspeed.initialize(...).")
        init(self, *args, **kwargs)

    guarded._selzero_wrapped = True  # type: ignore[attr-defined]
    DeepSpeedEngine.__init__ = guarded


def _refuse_near_miss(config: dict[str, Any]) -> None:
    """A top-level key that is meant to be the entry but is not spelled as it is."""
    if ENTRY in config:
        return
    import difflib

    for key in config:
        if not isinstance(key, str):
            continue
        folded = "".join(ch for ch in key.lower() if ch.isalnum())
        if folded == "selectedzero2" or difflib.SequenceMatcher(None, key.lower(), ENTRY).ratio() \
                >= 0.85:
            raise ConfigError(
                f"DeepSpeed config key {key!r} is not {ENTRY!r}: DeepSpeed ignores unknown keys, "
                f"so selzero would not run and stock ZeRO would take the selected parameters. "
                f"Rename it to \"{ENTRY}\".")


def initialize(*args: Any, **kwargs: Any) -> Any:
    """``deepspeed.initialize`` with the ``"selected_zero2"`` entry honoured (same signature)."""
    import deepspeed

    register()
    return _initialize(deepspeed.initialize._selzero_original, *args, **kwargs)


# ---- initialize ---------------------------------------------------------------------------


def _load_config(bound: dict[str, Any]) -> tuple[str, Any]:
    """(where the config came from, the config) as deepspeed.initialize resolves it."""
    if bound.get("config") is not None:
        return "config", bound["config"]
    if bound.get("config_params") is not None:
        return "config_params", bound["config_params"]
    args = bound.get("args")
    for attr in ("deepspeed_config", "deepscale_config"):
        if getattr(args, attr, None) is not None:
            return attr, getattr(args, attr)
    return "", None


def _read_config(config: Any) -> dict[str, Any] | None:
    """The config as ``deepspeed.initialize`` reads it (a dict; a path to a JSON or hjson file;
    a base64 string), with DeepSpeed's own loader; None where DeepSpeed itself would fail (it
    then raises its own error)."""
    if config is None:
        return None
    if isinstance(config, dict):
        return config
    from deepspeed.runtime.tensor_parallel.init_utils import load_ds_config

    try:
        loaded = load_ds_config(config)
    except (ValueError, TypeError, OSError):
        return None
    return loaded if isinstance(loaded, dict) else None


def _refuse_unsupported(ds_config: dict[str, Any], bound: dict[str, Any]) -> None:
    zero = ds_config.get("zero_optimization") or {}
    stage = int(zero.get("stage", 0)) if isinstance(zero, dict) else 0
    if stage == 3:
        raise ConfigError(
            "selected_zero2 with zero_optimization.stage=3: ZeRO-3 takes every module parameter "
            "(deepspeed/runtime/zero/parameter_offload.py), so none can be left to selzero. Use "
            "stage 2 (or 0/1) with the entry, or FSDP2 as the host through Accelerate "
            "(selzero-accelerate launch --selzero_config ...).")
    if _precision(ds_config)[1]:
        raise ConfigError(
            "selected_zero2 with fp16.enabled: the subset's gradients would need DeepSpeed's "
            "dynamic loss scale and its overflow check, which selzero does not take part in. "
            "Use bf16 ({\"bf16\": {\"enabled\": true}}) or fp32.")
    if ds_config.get("managed_gradient_accumulation") in (False, "false"):
        raise ConfigError(
            "selected_zero2 with \"managed_gradient_accumulation\": false: DeepSpeed then "
            "decides the accumulation boundary inside its own step, after the entry's wrapper "
            "has to reduce the subset, so the subset would never be stepped (review finding). "
            "Remove the setting (the default, true) to use the entry.")
    if "expert_parallel" in ds_config:
        raise ConfigError(
            "selected_zero2 together with DeepSpeed's own \"expert_parallel\" block (AutoEP): "
            "AutoEP replaces the MoE layers and reduces their gradients itself, so selzero "
            "would not see them. Use one of them: remove \"expert_parallel\" and select the "
            "experts with selected_zero2, or remove selected_zero2.")
    model = bound.get("model")
    if type(model).__name__ in ("PipelineModule", "DualPipeVModule"):
        raise ConfigError(
            "selected_zero2 with a DeepSpeed PipelineModule: pipeline engines run their own "
            "schedule, which the plugin does not follow yet; build selzero instances per stage "
            "with SelectedZero2(..., group=...) and normalize_over=the stage's data-parallel "
            "ranks instead, or drop the entry.")
    if bound.get("mpu") is not None or (ds_config.get("tensor_parallel") or {}).get("autotp_size"):
        raise ConfigError(
            "selected_zero2 with DeepSpeed model/tensor parallelism (an mpu, or "
            "tensor_parallel.autotp_size): not supported; selzero's norm would be counted once "
            "per tensor-parallel rank. Drop the entry or the model parallelism.")


def _precision(ds_config: dict[str, Any]) -> tuple[bool, bool]:
    """(bf16, fp16) as DeepSpeed resolves them (``"bf16"`` or the legacy ``"bfloat16"`` key;
    DeepSpeed's own config models)."""
    from deepspeed.runtime.precision_config import get_bfloat16_config, get_float16_config

    def enabled(key: str, get: Callable[[dict[str, Any]], Any]) -> bool:
        block = ds_config.get(key)
        if isinstance(block, dict) and block.get("enabled") == "auto":
            return True  # resolved by the HF integration before DeepSpeed sees it
        try:
            return bool(get(ds_config).enabled)
        except Exception:  # noqa: BLE001 - a malformed block: DeepSpeed reports it itself
            return isinstance(block, dict) and block.get("enabled") in (True, "true")

    bf16 = enabled("bf16", get_bfloat16_config) or \
        ("bf16" not in ds_config and enabled("bfloat16", get_bfloat16_config))
    return bf16, enabled("fp16", get_float16_config)


def _entry_config(block: Any) -> tuple[SelZeroConfig, int | None]:
    """(the selzero config, the expert-parallel size or None for "group": "world")."""
    if not isinstance(block, dict):
        raise ConfigError(f"\"selected_zero2\": expected an object of selzero fields, got "
                          f"{block!r}; e.g. {{\"params\": [\"*.experts.*\"]}}.")
    block = dict(block)
    group = block.pop("group", "world")
    ep: int | None = None
    if group != "world":
        size = group.get("expert_parallel_size") if isinstance(group, dict) else None
        if not isinstance(group, dict) or set(group) != {"expert_parallel_size"} or \
                isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ConfigError(f"\"selected_zero2\": group={group!r}: expected \"world\" or "
                              "{\"expert_parallel_size\": E} with E a positive integer.")
        ep = size
        # expert gradients arrive summed over the expert-parallel ranks: the DDP-equivalent
        # mean divides by the data-parallel world
        block.setdefault("normalize_over", "world")
    if "params" not in block and "modules" not in block:
        raise ConfigError("\"selected_zero2\": 'params' is required (e.g. \"params\": "
                          "[\"*.experts.*\"]).")
    block.setdefault("params", [])
    # DeepSpeed decides whether a step with a non-finite norm is skipped (the subset's norm is
    # part of DeepSpeed's): selzero follows it and, where DeepSpeed steps anyway, skips its own
    # update instead of raising (set "nonfinite": "error" to raise on every rank instead)
    block.setdefault("nonfinite", "skip")
    return SelZeroConfig.from_dict(block), ep


def _filter_parameters(model_parameters: Any, model: nn.Module, selected: set[int]) -> Any:
    """``model_parameters`` (or the module's) without the selected parameters."""
    if model_parameters is None:
        return [p for p in model.parameters() if id(p) not in selected]
    items = list(model_parameters)
    out: list[Any] = []
    for item in items:
        if isinstance(item, dict):
            group = dict(item)
            group["params"] = [p for p in _as_list(item["params"]) if id(p) not in selected]
            out.append(group)
        elif id(item) not in selected:
            out.append(item)
    return out


def _as_list(params: Any) -> list[Any]:
    return [params] if isinstance(params, torch.Tensor) else list(params)


def _refuse_misuse(model: nn.Module, entries: list[Any], client: Any) -> None:
    """Setups that would lose state or train the subset twice, refused before DeepSpeed sees
    the model: a client optimizer that already stepped a selected parameter (its state would be
    dropped), and parameters of another live SelectedZero2 (DeepSpeed would take them too)."""
    if isinstance(client, torch.optim.Optimizer):
        held = [e.name for e in entries if stepped_state(client.state.get(e.param))]
        if held:
            raise UsageError(
                f"the client optimizer ({type(client).__name__}) holds state for {len(held)} "
                f"parameter(s) the \"selected_zero2\" entry selects: {held[:5]}. selzero keeps "
                "the subset's optimizer state itself, so that state would be dropped. Create "
                "the optimizer without stepping it before deepspeed.initialize, or resume the "
                "subset from a selzero checkpoint (engine.load_checkpoint).")
    selected = {id(e.param) for e in entries}
    others: dict[str, list[str]] = {}
    for name, p in model.named_parameters():
        live = owning_instance(p) if id(p) not in selected else None
        if live is not None:
            others.setdefault(live.config.name, []).append(name)
    if others:
        instance, names = next(iter(others.items()))
        raise UsageError(
            f"{len(names)} parameter(s) of the model belong to a SelectedZero2 built before "
            f"deepspeed.initialize (name {instance!r}): {names[:5]}. DeepSpeed would take "
            "their gradients too. The entry runs one instance: select these parameters in its "
            "\"params\" as well, or call remove_hooks() on that instance first.")


def _refuse_deepspeed_moe(model: nn.Module, entries: list[Any]) -> None:
    """DeepSpeed's own MoE layer: its experts are reduced by DeepSpeed over its expert groups
    (their parameters carry ``allreduce=False``) and ZeRO-1/2 asserts that some param group is
    marked MoE, which no group is once selzero takes the experts."""
    try:
        from deepspeed.moe.layer import MoE
    except ImportError:  # pragma: no cover - every supported DeepSpeed has it
        return
    layers = [name for name, m in model.named_modules() if isinstance(m, MoE)]
    if not layers:
        return
    selected = {id(e.param) for e in entries}
    taken = [name for name in layers
             if any(id(p) in selected for p in model.get_submodule(name).parameters())]
    if taken:
        raise ConfigError(
            f"selected_zero2 selects parameters of DeepSpeed's own MoE layer "
            f"(deepspeed.moe.layer.MoE at {taken[:3]}): DeepSpeed reduces those experts itself "
            "over its expert-parallel groups and its ZeRO optimizer requires them in its MoE "
            "param groups, so selzero cannot take them. Either build the experts as a plain "
            "nn.ModuleList (or a fused expert tensor) and select them with selected_zero2 "
            "(\"group\": {\"expert_parallel_size\": E} for expert parallelism), or keep "
            "DeepSpeed's MoE layer and leave its parameters out of \"params\".")


def _no_backward_since_step(engine: Any) -> bool:
    """ZeRO-1/2 at a boundary with no gradient reduced since the last step (DeepSpeed itself
    fails there with a KeyError or a TypeError in scaled_global_norm)."""
    opt = engine.optimizer
    if getattr(opt, "cpu_offload", False):  # DeepSpeed keeps no averaged_gradients then
        return False
    averaged = getattr(opt, "averaged_gradients", None)
    groups = getattr(opt, "bit16_groups", None)
    if not isinstance(averaged, dict) or not groups:
        return False
    return all(averaged.get(i) is None for i in range(len(groups)))


def _strip_client_optimizer(optimizer: torch.optim.Optimizer, selected: set[int]
                            ) -> dict[int, dict[str, Any]]:
    """Remove the selected parameters from a client optimizer (groups and state), in place.
    Returns, per selected parameter id, the group dict that held it."""
    held: dict[int, dict[str, Any]] = {}
    for group in optimizer.param_groups:
        kept = []
        for p in group["params"]:
            if id(p) in selected:
                held[id(p)] = group
                optimizer.state.pop(p, None)
            else:
                kept.append(p)
        group["params"] = kept
    return held


def _schedule_peak(scheduler: Any) -> float | None:
    """The lr DeepSpeed's scheduler peaks at for group 0 (WarmupLR, WarmupDecayLR, OneCycle:
    ``max_lrs``; WarmupCosineLR: ``org_lrs``; a torch scheduler: ``base_lrs``), or None."""
    for attr in ("max_lrs", "org_lrs", "base_lrs"):
        values = getattr(scheduler, attr, None)
        if values:
            try:
                return float(values[0])
            except (TypeError, ValueError):
                return None
    return None


def _subset_optimizer(engine: Any, ds_config: dict[str, Any]) -> tuple[Any, dict[str, Any], bool]:
    """(optimizer for SelectedZero2, its kwargs, whether it mirrors a torch host instance).

    A torch.optim basic optimizer (a client instance, or a config type built by torch) is
    mirrored: selzero re-reads its scheduled values at every step. DeepSpeed's own kernels
    (FusedAdam, DeepSpeedCPUAdam, ...) are replaced by the torch optimizer of the same
    algorithm with the config block's hyperparameters; the lr follows DeepSpeed's group 0.
    """
    basic = engine.basic_optimizer
    if type(basic).__module__.startswith("torch.optim"):
        return basic, {}, True
    # DeepSpeed's Adam kernels (FusedAdam, DeepSpeedCPUAdam): the same algorithm in torch, with
    # the hyperparameters DeepSpeed resolved (its defaults, not torch's: FusedAdam's
    # weight_decay is 0, torch AdamW's 0.01), read from its first group
    name = type(basic).__name__
    group = basic.param_groups[0] if basic.param_groups else dict(basic.defaults)
    if "Muon" in name:  # MuonWithAuxAdam is no Adam (its name was taken for one before)
        raise ConfigError(
            f"selected_zero2: DeepSpeed's optimizer {name} (config type \"muon\") runs "
            "DeepSpeed's own Muon (its Newton-Schulz variant and Adam half), which no torch "
            "optimizer reproduces, so selzero cannot run it on the subset. Keep DeepSpeed on an "
            "AdamW optimizer block and give the experts torch.optim.Muon in the entry: "
            "\"selected_zero2\": {\"params\": [...], \"partition\": \"tensors\", "
            "\"param_groups\": [{\"params\": [\"*.experts.*\"], \"optimizer\": "
            "\"torch.optim.Muon\", \"lr\": 0.02}]} (Muon needs matrices: keep vectors out of "
            "that group).")
    if "Adam" in name and "Lamb" not in name:
        if not group.get("bias_correction", True):
            raise ConfigError(
                f"selected_zero2: DeepSpeed's {name} runs with bias_correction=false, which no "
                "torch optimizer does; drop bias_correction from the optimizer block, or use "
                "\"torch_adam\": true.")
        if group.get("amsgrad", False):
            raise ConfigError(f"selected_zero2: DeepSpeed's {name} with amsgrad: use "
                              "\"torch_adam\": true instead.")
        w_mode = getattr(basic, "adam_w_mode", getattr(basic, "adamw_mode", True))
        cls = torch.optim.AdamW if w_mode else torch.optim.Adam
        kwargs = {k: group[k] for k in ("lr", "betas", "eps", "weight_decay") if k in group}
        if isinstance(kwargs.get("betas"), list):
            kwargs["betas"] = tuple(kwargs["betas"])
        return cls, kwargs, False
    raise ConfigError(
        f"selected_zero2: DeepSpeed's optimizer {name} (config type "
        f"{(ds_config.get('optimizer') or {}).get('type')!r}) has no torch.optim equivalent "
        "selzero can run on the subset. Use an elementwise torch optimizer: a config type "
        "torch provides (Adam/AdamW with \"torch_adam\": true, SGD, Adagrad, ...) or a "
        "torch.optim client optimizer.")


class _Plumbing:
    """What the wrappers of one engine share."""

    def __init__(self, engine: Any, sz: SelectedZero2, mirrors_host: bool) -> None:
        self.engine = engine
        self.sz = sz
        self.mirrors_host = mirrors_host
        self.pending_sq: torch.Tensor | None = None  # the subset's squared norm, this step
        self.total_norm: float | None = None  # the global norm DeepSpeed clipped with
        self.norm_in_host = False  # the subset's norm went into DeepSpeed's own computation

    # ---- micro-steps ---------------------------------------------------------------------

    def close_microstep(self) -> None:
        """End the micro-step of a backward that is not at the boundary (once)."""
        # after a backward every rank's window awaits its close (the model's output hook sees
        # the backward whatever the routing); IDLE: the user closed it (sum: active=...)
        if self.sz.state in (WindowState.OPEN, WindowState.AWAITING_CLOSE):
            self.sz.end_microstep()

    def reduce(self) -> None:
        sz = self.sz
        if sz.state is not WindowState.REDUCED:
            if sz.config.reduction != "mean":
                raise UsageError(
                    f"selected_zero2 reduction={sz.config.reduction!r}: call "
                    "engine.selzero.reduce_gradients(weight=..., active=...) before "
                    "engine.step() at the accumulation boundary (mean needs no arguments and is "
                    "what DeepSpeed's averaging matches).")
            sz.reduce_gradients()
        if sz.spans_world:
            self.pending_sq = sz.grad_norm_squared().detach().float()
        else:  # expert groups each hold their own experts: every element once over the world
            sq = sz.local_grad_norm_squared().detach().float().reshape(1).clone()
            sz.world_communicator().all_reduce(sq)
            self.pending_sq = sq[0]
        self.total_norm = None
        self.norm_in_host = False

    # ---- after DeepSpeed's optimizer decided ---------------------------------------------

    def after_optimizer_step(self, optimizer: Any) -> None:
        sz = self.sz
        if sz.state is not WindowState.REDUCED:
            return  # not a boundary step of ours (should not happen)
        if bool(getattr(optimizer, "overflow", False)):
            sz.zero_grad()  # DeepSpeed skipped the step (every rank agrees): so does selzero
            self.engine.selzero_step_result = StepResult(0, 0, 0, len(sz.layout.virtuals))
            return
        total = self.total_norm
        if total is None:
            total = math.sqrt(float(self.pending_sq)) if self.pending_sq is not None else 0.0
        clip = float(self.engine.gradient_clipping())
        if clip > 0 and math.isfinite(total):
            coef = clip / (total + 1e-6)
            if coef < 1.0:
                sz.scale_gradients_(coef)
        elif not math.isfinite(total):
            sz.scale_gradients_(total)  # handled like a non-finite gradient (nonfinite policy)
        lr = None if self.mirrors_host else self.engine.basic_optimizer.param_groups[0]["lr"]
        if sz.state is WindowState.REDUCED:
            self.engine.selzero_step_result = sz.step(lr=lr)


def _install(engine: Any, sz: SelectedZero2, mirrors_host: bool) -> _Plumbing:
    plumbing = _Plumbing(engine, sz, mirrors_host)
    selected = [e.param for e in sz.trainable]

    orig_backward = engine.backward

    @functools.wraps(orig_backward)
    def backward(loss: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        out = orig_backward(loss, *args, **kwargs)
        if not engine.is_gradient_accumulation_boundary():
            plumbing.close_microstep()
        return out

    orig_step = engine.step

    @functools.wraps(orig_step)
    def step(*args: Any, **kwargs: Any) -> Any:
        if not engine.is_gradient_accumulation_boundary():
            plumbing.close_microstep()
            return orig_step(*args, **kwargs)
        if _no_backward_since_step(engine):
            raise UsageError(
                "engine.step() at a gradient accumulation boundary without a backward since the "
                "last step (DeepSpeed ZeRO-1/2 fails there itself, with a KeyError in "
                "scaled_global_norm): call engine.backward(loss) first, or skip step() for this "
                "batch.")
        plumbing.reduce()
        try:
            return orig_step(*args, **kwargs)
        finally:
            plumbing.pending_sq = None
            if sz.state is WindowState.REDUCED:  # DeepSpeed raised before deciding
                sz.zero_grad()

    orig_allreduce = engine.allreduce_gradients

    @functools.wraps(orig_allreduce)
    def allreduce_gradients(*args: Any, **kwargs: Any) -> Any:
        # stage 0 walks every module parameter that requires grad (zero-filling missing grads)
        flags = [p.requires_grad for p in selected]
        for p in selected:
            p.requires_grad_(False)
        try:
            return orig_allreduce(*args, **kwargs)
        finally:
            for p, f in zip(selected, flags):
                p.requires_grad_(f)

    orig_no_sync = engine.no_sync

    @functools.wraps(orig_no_sync)
    def no_sync(*args: Any, **kwargs: Any) -> Any:
        stack = contextlib.ExitStack()
        stack.enter_context(orig_no_sync(*args, **kwargs))
        stack.enter_context(sz.no_sync())
        return stack

    orig_coalesce = getattr(engine, "coalesce_grad_reduction", None)

    def coalesce_grad_reduction(*args: Any, **kwargs: Any) -> Any:
        # DeepSpeed's backwards inside leave their gradients local, reduced once at exit: the
        # subset's are local micro-steps (selzero's no_sync), reduced by the next step()
        stack = contextlib.ExitStack()
        stack.enter_context(orig_coalesce(*args, **kwargs))
        stack.enter_context(sz.no_sync())
        return stack

    engine.backward = backward
    engine.step = step
    if orig_coalesce is not None:
        engine.coalesce_grad_reduction = functools.wraps(orig_coalesce)(coalesce_grad_reduction)
    engine.allreduce_gradients = allreduce_gradients
    engine.no_sync = no_sync
    _install_norm(engine, plumbing)
    _install_checkpoint(engine, plumbing)
    engine.selzero = sz
    engine.selzero_step_result = None  # the StepResult of the last optimizer step
    return plumbing


def _install_norm(engine: Any, plumbing: _Plumbing) -> None:
    """DeepSpeed clips by, and reports, the norm over its parameters and the subset."""
    optimizer = engine.optimizer
    from deepspeed.runtime.bf16_optimizer import BF16_Optimizer
    from deepspeed.runtime.fp16.fused_optimizer import FP16_Optimizer
    from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    def combined(norm: Any, scale: float) -> Any:
        """sqrt(norm^2 + subset^2 * scale^2); DeepSpeed's invalid-norm sentinel (-1) stays."""
        if plumbing.pending_sq is None:
            return norm
        value = norm if isinstance(norm, torch.Tensor) else torch.tensor(float(norm))
        if float(value) < 0:
            return norm
        sq = plumbing.pending_sq.to(value.device)
        total = (value.float().pow(2) + sq * float(scale) ** 2).sqrt()
        plumbing.total_norm = float(total) / float(scale)
        return total.to(value.dtype) if isinstance(norm, torch.Tensor) else float(total)

    if isinstance(optimizer, DeepSpeedZeroOptimizer):
        orig = optimizer.scaled_global_norm

        def scaled_global_norm(norm_type: int = 2) -> Any:
            return combined(orig(norm_type=norm_type), float(optimizer.loss_scale))

        optimizer.scaled_global_norm = scaled_global_norm
    elif isinstance(optimizer, BF16_Optimizer):
        orig_grads = optimizer.get_grads_for_norm

        def get_grads_for_norm(for_clipping: bool = False) -> Any:
            out = orig_grads(for_clipping=for_clipping)
            if for_clipping or plumbing.pending_sq is None:
                return out
            non_expert, expert = out
            extra = plumbing.pending_sq.sqrt().reshape(1).to(
                non_expert[0].device if non_expert else plumbing.pending_sq.device)
            plumbing.norm_in_host = True  # DeepSpeed's own _global_grad_norm includes it
            return list(non_expert) + [extra], expert

        optimizer.get_grads_for_norm = get_grads_for_norm
    elif isinstance(optimizer, (FP16_Optimizer, FP16_UnfusedOptimizer)):
        # stage 0 bf16: (grad_groups_flat, total_norm, ...) or (total_norm, ...)
        orig_clip = optimizer.unscale_and_clip_grads
        at = list(inspect.signature(orig_clip).parameters).index("total_norm")

        def unscale_and_clip_grads(*args: Any, **kwargs: Any) -> Any:
            scale = float(optimizer.loss_scale_config.cur_scale)
            if "total_norm" in kwargs:
                kwargs["total_norm"] = combined(kwargs["total_norm"], scale)
            else:
                args = args[:at] + (combined(args[at], scale),) + args[at + 1:]
            return orig_clip(*args, **kwargs)

        optimizer.unscale_and_clip_grads = unscale_and_clip_grads
    elif isinstance(optimizer, torch.optim.Optimizer):
        def clip_fp32_gradients() -> None:
            grads, norm = _module_grad_norm(engine)
            total = combined(norm, 1.0)
            clip = float(engine.gradient_clipping())
            coef = clip / (float(total) + 1e-6)
            if coef < 1.0 and grads:
                torch._foreach_mul_(grads, coef)

        engine.clip_fp32_gradients = clip_fp32_gradients
    else:
        raise ConfigError(f"selected_zero2: DeepSpeed chose the optimizer wrapper "
                          f"{type(optimizer).__name__}, which the plugin does not know how to "
                          "combine norms with; use ZeRO stage 0/1/2 with fp32 or bf16.")

    orig_opt_step = optimizer.step

    @functools.wraps(orig_opt_step)
    def optimizer_step(*args: Any, **kwargs: Any) -> Any:
        out = orig_opt_step(*args, **kwargs)
        if plumbing.pending_sq is not None:
            if plumbing.total_norm is None and isinstance(optimizer, torch.optim.Optimizer):
                # stage 0 fp32 without clipping: DeepSpeed computes no norm; report the true one
                combined(_module_grad_norm(engine)[1], 1.0)
            elif plumbing.total_norm is None and plumbing.norm_in_host:
                plumbing.total_norm = float(optimizer._global_grad_norm)
            elif plumbing.total_norm is None and getattr(optimizer, "_global_grad_norm", None) \
                    is not None:  # a wrapper that did not clip this step: combine its norm
                combined(torch.as_tensor(float(optimizer._global_grad_norm)), 1.0)
            if plumbing.total_norm is not None and not bool(getattr(optimizer, "overflow", False)):
                optimizer._global_grad_norm = plumbing.total_norm
            plumbing.after_optimizer_step(optimizer)
        return out

    replace_method(optimizer, "step", optimizer_step)


def _module_grad_norm(engine: Any) -> tuple[list[torch.Tensor], torch.Tensor]:
    """(the module's gradients, their L2 norm): stage 0 fp32, where DeepSpeed's gradients are
    replicated after its all-reduce and the selected parameters hold none."""
    grads = [p.grad for p in engine.module.parameters() if p.grad is not None]
    sq = sum((g.float().pow(2).sum() for g in grads), torch.zeros(()))
    return grads, sq.sqrt()


def _install_checkpoint(engine: Any, plumbing: _Plumbing) -> None:
    sz = plumbing.sz
    orig_save = engine.save_checkpoint
    orig_load = engine.load_checkpoint

    @functools.wraps(orig_save)
    def save_checkpoint(save_dir: str, tag: Any = None, *args: Any, **kwargs: Any) -> Any:
        tag = str(tag) if tag is not None else f"global_step{engine.global_steps}"
        root = host_checkpoint.save_into(os.path.join(save_dir, tag), [sz])  # all ranks done
        out = orig_save(save_dir, tag, *args, **kwargs)
        error: SelZeroError | None = None
        try:
            _embed_for_zero_to_fp32(engine, sz, save_dir, tag, root)
        except (OSError, RuntimeError, SelZeroError) as e:
            error = e if isinstance(e, SelZeroError) else CheckpointError(
                f"{save_dir}/{tag}: writing the subset's FP32 values into DeepSpeed's model "
                f"states file failed ({type(e).__name__}: {e}); selzero's folder is complete, "
                "but DeepSpeed's zero_to_fp32 would miss the subset. Free space and save again.")
        agree_on_local_errors(sz.world_communicator(), error, what=f"save into {save_dir}")
        return out

    @functools.wraps(orig_load)
    def load_checkpoint(load_dir: str, tag: Any = None, *args: Any,
                        selzero_fresh_start: bool | None = None, **kwargs: Any) -> Any:
        if selzero_fresh_start is None:  # set by callers that cannot pass it (the HF Trainer)
            selzero_fresh_start = bool(getattr(engine, "selzero_fresh_start", False))
        resolved = tag
        if resolved is None:  # DeepSpeed's rule: the tag in `latest`
            latest = os.path.join(load_dir, "latest_universal" if
                                  engine.load_universal_checkpoint() else "latest")
            if os.path.isfile(latest):
                with open(latest) as f:
                    resolved = f.read().strip()
        folder = os.path.join(load_dir, str(resolved)) if resolved is not None else None
        names = ["load_module_strict", "load_optimizer_states", "load_lr_scheduler_states",
                 "load_module_only"]
        options = dict(zip(names, args))
        options.update(kwargs)
        # module-only loads and loads without optimizer states read the module, as DeepSpeed's
        # do (its FP32 masters are rebuilt from the module's weights): any world size
        module_only = bool(options.get("load_module_only", False)) or \
            not options.get("load_optimizer_states", True)
        if module_only and sz.spans_world:
            load_path, client_state = orig_load(load_dir, tag, **options)
            if load_path is not None:
                sz.sync_from_params()  # the module's weights, fresh subset state
                sz.optimizer.state.clear()
            return load_path, client_state
        # expert parallelism: DeepSpeed's module file holds data-parallel rank 0's experts
        # only, so each rank's experts come from selzero's folder, also for module-only loads
        fresh = False
        # every rank must see the same thing (node-local disks, a stale NFS view): agreed
        present = folder is not None and host_checkpoint.has_folder(folder)
        seen = torch.tensor([int(present), int(not present)], dtype=torch.int64,
                            device=sz.comm.device)
        sz.world_communicator().all_reduce(seen)
        if int(seen[0]) and int(seen[1]):
            raise CheckpointError(
                f"[rank {torch.distributed.get_rank()}] {folder!r}: selzero's folder "
                f"({host_checkpoint.FOLDER}/) is visible on {int(seen[0])} rank(s) and missing on "
                f"{int(seen[1])}; every rank must load the same checkpoint (copy it to every "
                "node, or point every rank at shared storage).")
        if folder is not None and os.path.isdir(folder) and not present:
            if not selzero_fresh_start:
                raise CheckpointError(
                    f"{folder!r} has no selzero folder ({host_checkpoint.FOLDER}/): it was saved "
                    "without the \"selected_zero2\" entry, so neither the subset's optimizer "
                    "state nor a DeepSpeed optimizer state without the subset is there. To load "
                    "the weights and start both optimizers' state fresh, call "
                    "engine.load_checkpoint(..., selzero_fresh_start=True).")
            fresh = True
            options["load_optimizer_states"] = False
        load_path, client_state = orig_load(load_dir, tag, **options)
        if load_path is None:
            return load_path, client_state
        if fresh:
            logger.warning("selzero: %s has no %s/ folder; loaded the weights, the "
                           "optimizers start fresh.", folder, host_checkpoint.FOLDER)
            sz.sync_from_params()  # the module's weights, fresh subset state
            sz.optimizer.state.clear()
        else:
            host_checkpoint.load_from(folder, [sz])  # FP32 values (masters) and state
            if module_only:
                sz.optimizer.state.clear()  # like DeepSpeed's: weights only, fresh state
        return load_path, client_state

    engine.save_checkpoint = save_checkpoint
    engine.load_checkpoint = load_checkpoint


# [Note: zero_to_fp32 sees the subset]
# DeepSpeed's converters (the zero_to_fp32.py it copies into every checkpoint, the Trainer's
# included; get_fp32_state_dict_from_zero_checkpoint; load_state_dict_from_zero_checkpoint)
# rebuild FP32 weights from the ZeRO optimizer's flat partitions, which do not hold the subset,
# plus the model states file's "frozen" parameters (FROZEN_PARAM_SHAPES / FRAGMENTS, read at
# ZeRO-1/2, utils/zero_to_fp32.py _zero2_merge_frozen_params). After every save the rank that
# wrote that file (data-parallel rank 0) reads selzero's just-written folder (no collective)
# and adds the subset's whole FP32 values (masters under bf16) there. DeepSpeed's own load skips
# those entries (they are trainable: runtime/engine.py, is_optimized_parameter), selzero loads
# its folder. Cost: one FP32 copy of the subset in that file and, while it is written, in that
# rank's host memory. Expert-parallel instances hold only their own experts; with them the
# converters are not covered (a warning says so: use `selzero consolidate`).


def _embed_for_zero_to_fp32(engine: Any, sz: SelectedZero2, save_dir: str, tag: str,
                            root: Any) -> None:
    if not engine.zero_optimization() or not engine.save_non_zero_checkpoint:
        return  # stage 0: the module states hold every parameter; other ranks write no file
    if not sz.spans_world:
        logger.warning("selzero: expert-parallel instances: DeepSpeed's zero_to_fp32 does not "
                       "see the experts of %s; for every expert in one file: `selzero reshard "
                       "%s --world-size 1 --ep-size 1 --out ONE` then `selzero consolidate ONE "
                       "--out experts.safetensors --torch-state-dict model.safetensors`.",
                       os.path.join(save_dir, tag), os.path.join(save_dir, tag, "selected_zero2"))
        return
    from deepspeed.checkpoint.constants import FROZEN_PARAM_FRAGMENTS, FROZEN_PARAM_SHAPES

    from .checkpoint.tools import full_values

    path = engine._get_ckpt_name(save_dir, tag)
    if not os.path.isfile(path):  # a non-default checkpoint engine that writes later
        logger.warning("selzero: %s is not written yet (an asynchronous checkpoint engine?); "
                       "DeepSpeed's zero_to_fp32 will not see the subset of this save.", path)
        return
    values = full_values(os.path.join(str(root), sz.config.name))
    for e in sz.entries:
        if e.frozen:  # not in selzero's folder: the module's values
            for name in (e.name, *getattr(e, "aliases", ())):
                values.setdefault(name, e.param.detach().float().cpu().clone())
    state = torch.load(path, map_location="cpu", weights_only=False)
    if state.get(FROZEN_PARAM_FRAGMENTS) is None:
        # ZeRO-1 writes no such table. Once there is one, DeepSpeed's load copies every
        # parameter it does not optimize *at load time* from it (a parameter frozen since the
        # save included: review finding, a KeyError), so it holds every module parameter: the
        # module's values, which zero_to_fp32 then replaces by DeepSpeed's FP32 ones where it
        # has them. Cost: the host's parameters once more in this file.
        state[FROZEN_PARAM_SHAPES] = {name: p.shape for p, name in engine.param_names.items()}
        state[FROZEN_PARAM_FRAGMENTS] = {name: p.detach().cpu()
                                         for p, name in engine.param_names.items()}
    shapes = dict(state.get(FROZEN_PARAM_SHAPES) or {})
    fragments = dict(state.get(FROZEN_PARAM_FRAGMENTS) or {})
    for name, value in values.items():
        shapes[name] = value.shape
        fragments[name] = value
    state[FROZEN_PARAM_SHAPES] = shapes
    state[FROZEN_PARAM_FRAGMENTS] = fragments
    tmp = f"{path}.selzero-tmp"
    torch.save(state, tmp)
    os.replace(tmp, path)


def _world_communicator(timeout_s: float) -> Communicator:
    import torch.distributed as dist

    device = torch.device("cuda", torch.cuda.current_device()) \
        if "nccl" in str(dist.get_backend()) and torch.cuda.is_available() else torch.device("cpu")
    return Communicator.create(list(range(dist.get_world_size())), timeout_s=timeout_s,
                               device=device, shared=True)


def _initialize(original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    bound = inspect.signature(original).bind(*args, **kwargs)
    source, raw = _load_config(bound.arguments)
    config = _read_config(raw)
    if config is not None:
        _refuse_near_miss(config)
    if config is None or ENTRY not in config:
        return original(*args, **kwargs)
    sz_config, ep = _entry_config(config[ENTRY])
    ds_config = {k: v for k, v in config.items() if k != ENTRY}
    _refuse_unsupported(ds_config, bound.arguments)
    model = bound.arguments.get("model")
    if model is None:
        raise UsageError("deepspeed.initialize(model=...) is required with selected_zero2.")

    import deepspeed
    from deepspeed.accelerator import get_accelerator

    deepspeed.init_distributed(dist_backend=get_accelerator().communication_backend_name(),
                               distributed_port=bound.arguments.get("distributed_port", 29500),
                               dist_init_required=bound.arguments.get("dist_init_required"))
    # checks a rank may fail alone (its model, its selection): agreed on every rank before
    # DeepSpeed's initialize, whose collectives would leave the others waiting
    world = _world_communicator(sz_config.timeout_s)
    error: SelZeroError | None = None
    entries: list[Any] = []
    try:
        entries = resolve_selection(model, params=list(sz_config.params),
                                    modules=list(sz_config.modules),
                                    expert_dim=sz_config.expert_dim)
        _refuse_misuse(model, entries, bound.arguments.get("optimizer"))
        _refuse_deepspeed_moe(model, entries)
    except SelZeroError as e:
        error = e
    agree_on_local_errors(world, error, what="selected_zero2 at deepspeed.initialize")
    selected = {id(e.param) for e in entries}
    # expert parallelism: SelectedZero2 shards over this rank's expert-data-parallel group and
    # is named <name>-ep{ep_rank}
    sz_group = expert_data_parallel_groups(ep) if ep is not None else None
    bf16 = _precision(ds_config)[0]
    # FP32 values before DeepSpeed casts the module (masters) and before its broadcast from
    # rank 0 (with "broadcast": false each rank keeps its own values, e.g. expert-parallel
    # shards); cloned: the cast may reuse storage
    snapshot = {e.name: e.param.detach().float().clone() for e in entries if not e.frozen} \
        if bf16 or not sz_config.broadcast or ep is not None else None

    call = dict(bound.arguments)
    call["model_parameters"] = _filter_parameters(call.get("model_parameters"), model, selected)
    client = call.get("optimizer")
    client_groups: dict[int, Any] = {}
    if isinstance(client, torch.optim.Optimizer):
        client_groups = _strip_client_optimizer(client, selected)
    if source in ("config", "config_params"):
        call[source] = ds_config
    else:  # args.deepspeed_config: hand DeepSpeed the config without the entry
        args_copy = copy.copy(call["args"])
        setattr(args_copy, source, None)
        call["args"] = args_copy
        call["config"] = ds_config
    _BUILDING[0] += 1
    try:
        engine, optimizer, dataloader, scheduler = original(**call)
    finally:
        _BUILDING[0] -= 1

    trainable = [e for e in entries if not e.frozen]
    opt, opt_kwargs, mirrors = _subset_optimizer(engine, ds_config)
    # A client optimizer's group that held a selected parameter is mirrored: its scheduled
    # values are re-read at every step. DeepSpeed drops groups that end up empty (they held
    # only selected parameters): those are mirrored with the values they had, unscheduled.
    # the groups' own lists are left untouched (DeepSpeed's FP16_UnfusedOptimizer shares them
    # as its fp32_groups and would save what was appended): appended to copies, put back after
    originals: dict[int, tuple[dict[str, Any], Any]] = {}
    dropped: list[dict[str, Any]] = []
    basic = engine.basic_optimizer
    live = len(basic.param_groups)
    if mirrors and client_groups:
        live_ids = {id(g) for g in basic.param_groups}
        for e in trainable:
            group = client_groups.get(id(e.param))
            if group is None:
                continue
            if id(group) not in live_ids and all(group is not d for d in dropped):
                dropped.append(group)
            if id(group) not in originals:
                originals[id(group)] = (group, group["params"])
                group["params"] = list(group["params"])
            group["params"].append(e.param)
        basic.param_groups.extend(dropped)  # for the mirror plan only, removed below
    if snapshot is not None and (not sz_config.broadcast or ep is not None):
        with torch.no_grad():  # undo DeepSpeed's broadcast of the selected parameters
            for e in trainable:
                e.param.data.copy_(snapshot[e.name].view_as(e.param))
    try:
        sz = SelectedZero2(engine.module, sz_config, opt, opt_kwargs, group=sz_group)
    finally:
        del basic.param_groups[live:]
        for group, params in originals.values():
            group["params"] = params
    for plan in sz.segment_optimizer.plans:
        if plan.host_group is not None and plan.host_group >= live:
            plan.host_group = None  # a dropped group: its values stay as they were
    if dropped:
        logger.warning(
            "selzero: %d group(s) of the client optimizer held only selected parameters; "
            "DeepSpeed drops such groups, so an lr scheduler does not move them: selzero keeps "
            "their hyperparameters as given (lr %s). To schedule them, put the selected "
            "parameters in a group that also holds DeepSpeed's parameters.",
            len(dropped), [g.get("lr") for g in dropped])
    peak = _schedule_peak(getattr(engine, "lr_scheduler", None))
    if peak:  # groups with an optimizer class of their own follow the schedule's factor
        sz.set_schedule_base(peak)
    if snapshot is not None:
        sz.sync_from_params(snapshot, broadcast=sz_config.broadcast)
        del snapshot
    _install(engine, sz, mirrors)
    return engine, optimizer, dataloader, scheduler


register()
