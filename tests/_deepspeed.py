"""DeepSpeed runs with the "selected_zero2" entry, and their single-process references.

The model is ``BlockMoE`` (tests/_blocks.py): ranks route to different experts (expert 2 of each
block gets no token anywhere), so stock DeepSpeed would crash or train wrong at ZeRO-1/2.
DeepSpeed scales each micro-batch loss by 1/GAS and averages over ranks; the reference is one
process running plain torch AdamW (+ clip_grad_norm_) on the mean over ranks and micro-batches.
"""

from __future__ import annotations

import os
import warnings
from typing import Any

import torch

from ._blocks import BlockMoE, block_batch, block_loss, block_routes

LAYERS = 2
GAS = 2
CLIP = 0.05
LR = 1e-2
WD = 0.1
SELECT = ["blocks.*.experts.*"]


def build_model(seed: int = 0) -> BlockMoE:
    torch.manual_seed(seed)
    return BlockMoE(layers=LAYERS)


def ds_config(stage: int, bf16: bool, *, clip: float = CLIP, entry: dict[str, Any] | None = None,
              optimizer: bool = True, world: int = 2) -> dict[str, Any]:
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 6,
        "gradient_accumulation_steps": GAS,
        "train_batch_size": 6 * GAS * world,
        "gradient_clipping": clip,
        "zero_optimization": {"stage": stage},
        "bf16": {"enabled": bf16},
        "steps_per_print": 10 ** 9,
        "wall_clock_breakdown": False,
    }
    if optimizer:
        config["optimizer"] = {"type": "AdamW", "params": {"lr": LR, "weight_decay": WD,
                                                           "torch_adam": True}}
    if entry is not False:
        config["selected_zero2"] = entry if entry is not None else {"params": SELECT,
                                                                     "bucket_mb": 1e-4}
    return config


def _quiet() -> None:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    warnings.filterwarnings("ignore")
    import logging

    logging.getLogger("DeepSpeed").setLevel(logging.ERROR)


def train_deepspeed(rank: int, world: int, stage: int, bf16: bool, *, steps: int = 6,
                    client_optimizer: bool = False, clip: float = CLIP,
                    save_at: int | None = None, save_dir: str | None = None,
                    load_dir: str | None = None, style: str = "engine",
                    with_entry: bool = True, fresh_start: bool = False,
                    scheduler: dict[str, Any] | None = None,
                    config_changes: dict[str, Any] | None = None,
                    load_options: dict[str, Any] | None = None,
                    poison_step: int | None = None) -> dict[str, Any]:
    """Train ``steps`` optimizer steps; return parameters (fp32), reported norms, DS state."""
    _quiet()
    os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank), WORLD_SIZE=str(world))
    import selzero_plugin.deepspeed  # noqa: F401 - registers the entry
    import deepspeed

    model = build_model()
    kwargs: dict[str, Any] = {}
    if client_optimizer:
        kwargs["optimizer"] = torch.optim.AdamW(client_groups(model, client_optimizer), lr=LR,
                                                weight_decay=WD)
    config = ds_config(stage, bf16, clip=clip, optimizer=not client_optimizer, world=world,
                       entry=None if with_entry else False)
    if client_optimizer:
        config["zero_allow_untested_optimizer"] = True
    if scheduler is not None:
        config["scheduler"] = scheduler
    config.update(config_changes or {})
    engine, _, _, _ = deepspeed.initialize(model=model, config=config, **kwargs)
    first = 0
    if isinstance(load_dir, list):  # one folder per rank
        load_dir = load_dir[rank]
    if load_dir is not None:
        engine.load_checkpoint(load_dir, **({"selzero_fresh_start": True} if fresh_start else {}),
                               **(load_options or {}))
        first = engine.global_steps
    norms, lrs, applied, moved = [], [], [], []
    for step in range(first, steps):
        lrs.append(engine.get_lr()[0])
        before = [p.detach().clone() for p in engine.module.parameters()]
        if step == poison_step and rank == 1:  # an inf in one expert gradient on one rank
            target = engine.module.blocks[0].experts[0].w1.weight
            handle = target.register_hook(lambda g: torch.full_like(g, float("inf")))
        for micro in range(GAS):
            if style == "boundary":  # DeepSpeed's documented manual pattern: step() once
                engine.set_gradient_accumulation_boundary(micro == GAS - 1)
            loss = ds_loss(engine, step * GAS + micro, rank, torch.bfloat16 if bf16 else None)
            if style == "torch":  # DeepSpeed 0.19 accepts a plain loss.backward()
                loss.backward()
            else:
                engine.backward(loss)
            if style != "boundary" or micro == GAS - 1:
                engine.step()
        if step == poison_step and rank == 1:
            handle.remove()
        applied.append(engine.was_step_applied())
        moved.append(any(not torch.equal(a, b.detach())
                         for a, b in zip(before, engine.module.parameters())))
        norm = engine.get_global_grad_norm()  # stock DeepSpeed at stage 0 fp32: None
        norms.append(None if norm is None else float(norm))
        if save_at is not None and step + 1 == save_at:
            engine.save_checkpoint(save_dir)
    if not with_entry:
        return {"global_steps": engine.global_steps}
    sz = engine.selzero
    params = {n: p.detach().float().clone() for n, p in engine.module.named_parameters()}
    selected_ids = {id(e.param) for e in sz.entries}
    ds_state = set(map(id, engine.basic_optimizer.state))
    ds_groups = {id(p) for g in engine.basic_optimizer.param_groups for p in g["params"]}
    for groups in (getattr(engine.optimizer, "fp32_groups", None) or []):  # wrappers' own lists
        ds_groups |= {id(p) for p in groups if isinstance(p, torch.Tensor)}
    steps_taken = sorted({float(st["step"]) for st in sz.optimizer.state.values()
                          if "step" in st})
    return {"params": params, "norms": norms, "stage": stage, "lrs": lrs,
            "applied": applied, "moved": moved,
            "last_result": None if engine.selzero_step_result is None
            else engine.selzero_step_result.skipped_nonfinite,
            "selzero_steps": steps_taken,
            "subset_hyper": [{k: g[k] for k in ("lr", "weight_decay")}
                             for g in sz.optimizer.param_groups],
            "subset_optimizer": type(sz.optimizer).__name__,
            "ds_state_on_selected": len(ds_state & selected_ids),
            "ds_groups_hold_selected": len(ds_groups & selected_ids),
            "ds_grad_numel": _ds_grad_numel(engine),
            "selected_grads_left": [e.name for e in sz.entries if e.param.grad is not None],
            "wrapper": type(engine.optimizer).__name__,
            "state": sz.state.value, "global_steps": engine.global_steps}


def _ds_grad_numel(engine: Any) -> int:
    """Elements of DeepSpeed's gradient buffers (its flat groups at ZeRO-1/2, else .grad)."""
    opt = engine.optimizer
    groups = getattr(opt, "bit16_groups", None) or getattr(opt, "bf16_groups", None) \
        or getattr(opt, "fp16_groups", None)
    if groups is not None:
        return sum(p.numel() for g in groups for p in g)
    return sum(p.numel() for g in engine.basic_optimizer.param_groups for p in g["params"])


def client_groups(model: torch.nn.Module, kind: Any) -> Any:
    """Parameter groups of a client optimizer. ``True``: one group. "experts_group": the
    experts alone in a group of their own (DeepSpeed drops it once they are taken out);
    "mixed_groups": blocks.0's experts and the input layer in a second group."""
    if kind is True:
        return list(model.parameters())
    named = list(model.named_parameters())
    if kind == "experts_group":
        second = [p for n, p in named if ".experts." in n]
    else:
        second = [p for n, p in named if n.startswith(("blocks.0.experts.", "inp."))]
    ids = {id(p) for p in second}
    return [{"params": [p for _, p in named if id(p) not in ids]},
            {"params": second, "lr": LR / 3, "weight_decay": 0.0}]


def ds_loss(engine: Any, step: int, rank: int, dtype: torch.dtype | None) -> torch.Tensor:
    """``block_loss`` with the inputs cast to the engine's dtype (DeepSpeed does not cast)."""
    if dtype is None:
        return block_loss(engine, step, rank, layers=LAYERS)
    x, y = block_batch(step, rank)
    out = engine(x.to(dtype), block_routes(step, rank, layers=LAYERS))
    return (out.float() - y).pow(2).mean()


def reference(world: int, steps: int, *, clip: float = CLIP, groups: Any = True,
              lrs: list[float] | None = None) -> tuple[dict[str, torch.Tensor], list[float]]:
    """One process: AdamW + clip_grad_norm_ on the mean over ranks and micro-batches (with
    ``lrs``, step k runs at lr ``lrs[k]``)."""
    model = build_model()
    opt = torch.optim.AdamW(client_groups(model, groups), lr=LR, weight_decay=WD)
    norms = []
    for step in range(steps):
        if lrs is not None:
            for group in opt.param_groups:
                group["lr"] = lrs[step]
        loss = sum(block_loss(model, step * GAS + m, r, layers=LAYERS)
                   for m in range(GAS) for r in range(world)) / (GAS * world)
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
                           if clip > 0 else torch.nn.utils.get_total_norm(
                               [p.grad for p in model.parameters() if p.grad is not None])))
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {n: p.detach().clone() for n, p in model.named_parameters()}, norms


MUON_LR = 0.02
TENSORS_ENTRY = {"params": SELECT, "bucket_mb": 1e-4, "partition": "tensors"}
MUON_ENTRY = {**TENSORS_ENTRY, "param_groups": [
    {"params": ["*.weight"], "optimizer": "torch.optim.Muon", "lr": MUON_LR,
     "weight_decay": 0.05}]}


def reference_muon(world: int, steps: int, *, lrs: list[float] | None = None
                   ) -> tuple[dict[str, torch.Tensor], list[float]]:
    """One process: torch Muon on the expert matrices (its lr following DeepSpeed's schedule
    factor), AdamW on the rest, clip_grad_norm_ over everything, on the mean over ranks and
    micro-batches."""
    model = build_model()
    named = list(model.named_parameters())
    mats = [p for n, p in named if ".experts." in n and n.endswith(".weight")]
    ids = {id(p) for p in mats}
    muon = torch.optim.Muon(mats, lr=MUON_LR, weight_decay=0.05)
    adamw = torch.optim.AdamW([p for _, p in named if id(p) not in ids], lr=LR, weight_decay=WD)
    norms = []
    for step in range(steps):
        if lrs is not None:
            adamw.param_groups[0]["lr"] = lrs[step]
            muon.param_groups[0]["lr"] = MUON_LR * lrs[step] / LR
        loss = sum(block_loss(model, step * GAS + m, r, layers=LAYERS)
                   for m in range(GAS) for r in range(world)) / (GAS * world)
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        muon.step()
        adamw.step()
        muon.zero_grad(set_to_none=True)
        adamw.zero_grad(set_to_none=True)
    return {n: p.detach().clone() for n, p in model.named_parameters()}, norms


def _full_routes() -> list[torch.Tensor]:
    """Every expert gets tokens on every rank: stock DeepSpeed ZeRO-2 runs at all."""
    return [torch.arange(6) % 3 for _ in range(LAYERS)]


def ds_optimizer_bytes(engine: Any) -> int:
    """Bytes of DeepSpeed's optimizer-side tensors on this rank, from the live storages its
    ZeRO optimizer holds: FP32 partitions, their gradient partitions, the averaged gradients,
    and the basic optimizer's state (unique storages)."""
    opt = engine.optimizer
    tensors: list[torch.Tensor] = []
    for t in getattr(opt, "single_partition_of_fp32_groups", []):
        tensors.append(t)
        if t.grad is not None:
            tensors.append(t.grad)
    for grads in (getattr(opt, "averaged_gradients", {}) or {}).values():
        tensors.extend(g for g in (grads or []) if isinstance(g, torch.Tensor))
    for state in engine.basic_optimizer.state.values():
        tensors.extend(v for v in state.values() if isinstance(v, torch.Tensor))
    seen: dict[int, int] = {}
    for t in tensors:
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def memory_run(rank: int, world: int, mode: str) -> dict[str, int]:
    """Per-rank bytes after two steps and the third step's backward (gradient partitions and
    optimizer state both alive). ``mode``: "entry" (the experts by selzero), "stock" (DeepSpeed
    ZeRO-2 over the whole model), "dense" (the experts frozen: DeepSpeed without them)."""
    _quiet()
    os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank), WORLD_SIZE=str(world))
    import selzero_plugin.deepspeed  # noqa: F401
    import deepspeed

    model = build_model()
    if mode == "dense":
        for n, p in model.named_parameters():
            if ".experts." in n:
                p.requires_grad_(False)
    config = ds_config(2, False, entry=None if mode == "entry" else False, world=world)
    config["gradient_accumulation_steps"] = 1
    config["train_batch_size"] = 6 * world
    engine, _, _, _ = deepspeed.initialize(model=model, config=config)
    for step in range(3):
        x, y = block_batch(step, rank)
        loss = (engine(x, _full_routes()) - y).pow(2).mean()
        engine.backward(loss)
        if step == 2:
            break
        engine.step()
    out = {"deepspeed": ds_optimizer_bytes(engine)}
    if mode == "entry":
        report = engine.selzero.memory_report()
        out.update(selzero=report.total, selzero_ideal=report.ideal_total)
    engine.step()
    return out


def per_rank_values_run(rank: int, world: int, bf16: bool) -> dict[str, Any]:
    """``"broadcast": false``: each rank's own selected values survive DeepSpeed's broadcast
    (expert-parallel shards); the rest is rank 0's. Returns (kept, dense equal to rank 0's,
    masters equal to the fp32 values)."""
    _quiet()
    os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank), WORLD_SIZE=str(world))
    import selzero_plugin.deepspeed  # noqa: F401
    import deepspeed

    model = build_model(seed=rank)  # every rank starts from other values
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    rank0 = {n: p.detach().clone() for n, p in build_model(seed=0).named_parameters()}
    config = ds_config(2, bf16, entry={"params": SELECT, "broadcast": False}, world=world)
    engine, _, _, _ = deepspeed.initialize(model=model, config=config)
    after = dict(engine.module.named_parameters())
    cast = (lambda t: t.bfloat16().float()) if bf16 else (lambda t: t)
    selected = [n for n in before if ".experts." in n]
    kept = all(torch.equal(after[n].float(), cast(before[n])) for n in selected)
    dense_rank0 = all(torch.equal(after[n].float(), cast(rank0[n])) for n in before
                      if n not in selected)
    sz = engine.selzero
    masters_exact = True
    for i, seg in enumerate(sz.segments):
        slot = sz.slots[i]
        entry = sz.storage.entry_of(slot)
        start = sz.layout.virtuals[slot.virtual].chunk_start(sz.rank)
        want = before[entry.name].reshape(-1)[start:start + slot.numel]
        masters_exact = masters_exact and torch.equal(seg.detach(), want)
    return {"kept": kept, "dense_rank0": dense_rank0, "masters_exact": masters_exact}


def train_many(rank: int, world: int, calls: list[tuple[tuple, dict[str, Any]]]
               ) -> list[dict[str, Any]]:
    """Several ``train_deepspeed`` runs, one after another in the same processes (suite time:
    one spawn and import instead of one per run); each builds its own model and engine."""
    from selzero_plugin.errors import SelZeroError

    out: list[dict[str, Any]] = []
    for args, kwargs in calls:
        try:
            out.append(train_deepspeed(rank, world, *args, **kwargs))
        except SelZeroError as e:  # agreed by every rank: the next run starts in step
            out.append({"error_type": type(e).__name__, "error_message": str(e)})
    return out
