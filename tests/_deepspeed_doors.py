"""DeepSpeed programs that reach the experts by other paths than ``engine.backward/step`` with
a dict config: the config as a file (JSON, hjson with a comment, base64), ``initialize`` bound
before selzero registered, a near-miss of the entry's key, the legacy ``"bfloat16"`` key,
``engine.coalesce_grad_reduction()``, DeepSpeed's own MoE layer, and checkpoints read back by
DeepSpeed's converters and by module-only loads on another world size."""

from __future__ import annotations

import base64
import contextlib
import json
import os
from typing import Any

import torch

from ._deepspeed import GAS, LAYERS, _quiet, build_model, ds_config, ds_loss

STEPS = 2


def _setup(rank: int, world: int) -> Any:
    _quiet()
    os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank), WORLD_SIZE=str(world))
    import selzero_plugin.deepspeed  # noqa: F401 - registers the entry
    import deepspeed

    return deepspeed


def _config_as(form: str, config: dict[str, Any], folder: str) -> Any:
    """The config in one of the forms ``deepspeed.initialize(config=...)`` documents."""
    if form == "dict":
        return config
    text = json.dumps(config, indent=1)
    if form == "base64":
        return base64.urlsafe_b64encode(text.encode()).decode()
    path = os.path.join(folder, f"ds_{form}.json")
    if form == "hjson":  # what DeepSpeed reads: one comment line makes it no longer JSON
        text = "// selzero test: experts under selected_zero2\n" + text
    if int(os.environ["RANK"]) == 0 or not os.path.isfile(path):
        with open(f"{path}.{os.environ['RANK']}", "w") as f:
            f.write(text)
        os.replace(f"{path}.{os.environ['RANK']}", path)
    return path


def _loop(engine: Any, rank: int, steps: int, *, coalesce: bool = False, first: int = 0,
          dtype: torch.dtype | None = None) -> None:
    for step in range(first, steps):
        ctx = engine.coalesce_grad_reduction() if coalesce else contextlib.nullcontext()
        with ctx:
            for micro in range(GAS):
                engine.backward(ds_loss(engine, step * GAS + micro, rank, dtype))
                if not coalesce:
                    engine.step()
        if coalesce:
            engine.step()


def _values(engine: Any) -> dict[str, torch.Tensor]:
    return {n: p.detach().float().clone() for n, p in engine.module.named_parameters()}


def config_forms(rank: int, world: int, form: str, folder: str) -> dict[str, Any]:
    deepspeed = _setup(rank, world)
    config = _config_as(form, ds_config(2, False), folder)
    engine, *_ = deepspeed.initialize(model=build_model(), config=config)
    _loop(engine, rank, STEPS)
    return {"params": _values(engine), "selzero": hasattr(engine, "selzero")}


def early_bound(rank: int, world: int) -> dict[str, Any]:
    """``from deepspeed import initialize`` above ``import selzero_plugin.deepspeed``: the name
    holds DeepSpeed's own function (the one ``register`` replaced)."""
    deepspeed = _setup(rank, world)
    initialize = getattr(deepspeed.initialize, "_selzero_original", deepspeed.initialize)
    engine, *_ = initialize(model=build_model(), config=ds_config(2, False))
    _loop(engine, rank, 1)
    return {"selzero": hasattr(engine, "selzero")}


def near_miss(rank: int, world: int, key: str) -> dict[str, Any]:
    deepspeed = _setup(rank, world)
    config = ds_config(2, False, entry=False)
    config[key] = {"params": ["blocks.*.experts.*"]}
    engine, *_ = deepspeed.initialize(model=build_model(), config=config)
    _loop(engine, rank, 1)
    return {"selzero": hasattr(engine, "selzero")}


def precision_key(rank: int, world: int, key: str) -> dict[str, Any]:
    deepspeed = _setup(rank, world)
    config = ds_config(2, True)
    del config["bf16"]
    config[key] = {"enabled": True}
    engine, *_ = deepspeed.initialize(model=build_model(), config=config)
    _loop(engine, rank, STEPS, dtype=torch.bfloat16)
    return {"params": _values(engine), "masters": engine.selzero.master_flat.clone(),
            "bf16_module": next(engine.module.parameters()).dtype == torch.bfloat16}


def coalesced(rank: int, world: int) -> dict[str, Any]:
    """DeepSpeed 0.19.8's documented idiom: GAS backwards in one ``coalesce_grad_reduction``
    block, one ``step()`` (gradient_accumulation_steps=1: one block is one optimizer step)."""
    deepspeed = _setup(rank, world)
    config = ds_config(2, False)
    config.update(gradient_accumulation_steps=1, train_batch_size=6 * world)
    engine, *_ = deepspeed.initialize(model=build_model(), config=config)
    _loop(engine, rank, STEPS, coalesce=True)
    return {"params": _values(engine)}


def coalesced_reference(world: int) -> dict[str, torch.Tensor]:
    """One process: the sum of the block's micro-batch losses (DeepSpeed scales by 1/GAS = 1),
    averaged over ranks; AdamW + clip_grad_norm_ as the config says."""
    from ._blocks import block_loss
    from ._deepspeed import CLIP, LR, WD

    model = build_model()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    for step in range(STEPS):
        loss = sum(block_loss(model, step * GAS + m, r, layers=LAYERS)
                   for m in range(GAS) for r in range(world)) / world
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def deepspeed_moe(rank: int, world: int) -> dict[str, Any]:
    deepspeed = _setup(rank, world)
    from deepspeed.moe.layer import MoE

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inp = torch.nn.Linear(8, 8)
            self.moe = MoE(hidden_size=8, expert=torch.nn.Linear(8, 8), num_experts=2, k=1,
                           ep_size=1)
            self.out = torch.nn.Linear(8, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h, _, _ = self.moe(self.inp(x))
            return self.out(h)

    torch.manual_seed(0)
    config = ds_config(2, False, entry={"params": ["moe.deepspeed_moe.experts.*"]})
    engine, *_ = deepspeed.initialize(model=Net(), config=config)
    return {"selzero": hasattr(engine, "selzero")}


def save_run(rank: int, world: int, stage: int, bf16: bool, save_dir: str) -> dict[str, Any]:
    deepspeed = _setup(rank, world)
    engine, *_ = deepspeed.initialize(model=build_model(), config=ds_config(stage, bf16))
    _loop(engine, rank, STEPS, dtype=torch.bfloat16 if bf16 else None)
    engine.save_checkpoint(save_dir)
    sz = engine.selzero
    from selzero_plugin.checkpoint import host

    folder = os.path.join(save_dir, f"global_step{STEPS}", host.FOLDER, sz.config.name)
    from selzero_plugin.checkpoint.tools import full_values

    return {"module": _values(engine), "masters": full_values(folder) if rank == 0 else None}


def load_module_only(rank: int, world: int, save_dir: str, options: dict[str, Any]
                     ) -> dict[str, Any]:
    """A world-2 checkpoint loaded on ``world`` ranks with a module-only option; then one
    more step trains."""
    deepspeed = _setup(rank, world)
    config = ds_config(2, False, world=world)
    engine, *_ = deepspeed.initialize(model=build_model(seed=1), config=config)
    engine.load_checkpoint(save_dir, **options)
    loaded = _values(engine)
    _loop(engine, rank, STEPS + 1, first=STEPS)
    moved = any(not torch.equal(loaded[n], v) for n, v in _values(engine).items()
                if ".experts." in n)
    return {"loaded": loaded, "moved": moved,
            "state": len(engine.selzero.optimizer.state)}


def ep_module_only(rank: int, world: int, save_dir: str, options: dict[str, Any]
                   ) -> dict[str, float]:
    """Expert parallelism (each rank its own experts): a module-only load must give each rank
    back its own experts (DeepSpeed's module file holds data-parallel rank 0's only)."""
    from . import _deepspeed_ep as ep

    saved = ep.ep_run(rank, world, 2, save_dir=save_dir)
    import deepspeed
    import torch.distributed as dist

    model = ep.EPModel(rank % ep.EP, dist.new_group([0, 1]))
    config = {"train_micro_batch_size_per_gpu": ep.T, "gradient_accumulation_steps": ep.GAS,
              "gradient_clipping": ep.CLIP, "zero_optimization": {"stage": 2},
              "steps_per_print": 10 ** 9,
              "optimizer": {"type": "AdamW", "params": {"lr": ep.LR, "weight_decay": ep.WD,
                                                        "torch_adam": True}},
              "selected_zero2": {"params": ["block.experts.*"], "bucket_mb": 1e-4,
                                 "group": {"expert_parallel_size": ep.EP}}}
    engine, *_ = deepspeed.initialize(model=model, config=config)
    engine.load_checkpoint(save_dir, tag="ep", **options)
    return {n: float((p.detach() - saved["params"][n]).abs().max())
            for n, p in engine.module.named_parameters()}


def zero1_newly_frozen(rank: int, world: int, save_dir: str) -> dict[str, Any]:
    """ZeRO-1: saved with every parameter trainable, loaded module-only into a run that froze
    a dense parameter (a fine-tuning phase), as stock DeepSpeed loads it."""
    deepspeed = _setup(rank, world)
    config = ds_config(1, False)
    engine, *_ = deepspeed.initialize(model=build_model(), config=config)
    _loop(engine, rank, 1)
    engine.save_checkpoint(save_dir, tag="t")
    model = build_model(seed=5)
    model.inp.weight.requires_grad_(False)
    again, *_ = deepspeed.initialize(model=model, config=config)
    again.load_checkpoint(save_dir, tag="t", load_module_only=True)
    return {"diff": max(float((p.detach() - q.detach()).abs().max()) for p, q in
                        zip(again.module.parameters(), engine.module.parameters()))}
