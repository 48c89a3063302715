"""``selzero demo``: a small MoE trained on local gloo processes, with a short report.

``launch()`` starts ``nproc`` workers with torch's own launcher (``torch.distributed.run``, run
in this process); each worker (``worker()``, this module's ``__main__``) trains
``DemoMoE`` with SelectedZero2 on the experts, DDP (``wrap_ddp``) on the rest and AdamW on both.
Rank 0 prints per-rank memory of the experts' gradients and optimizer state next to what DDP +
AdamW would hold for them, the loss, and how many updates were skipped for absent experts; then
the experts' state is saved, reloaded into a fresh instance and compared.

[Note: demo routing]
Routing is top-1 by a token's topic (hash routing, as in "Hash Layers for Large Sparse
Models"), so which experts get tokens is set by the data: reproducible and uneven. Each rank's
data leans on different topics, topics 5-6 are rare, and topic 7 never occurs, so on a given
step some experts get tokens on one rank only, some on none, and expert 7 gets none in the whole
run. That last one shows the presence rule: no gradient anywhere means no update, no weight
decay, no step count (what torch does for a parameter whose .grad stays None; a zero gradient, as
for fused experts or DeepSpeed ZeRO-0's zero fill, would be decayed every step).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .config import SelZeroConfig
from .ddp import wrap_ddp
from .core.zero2 import SelectedZero2
from .ports import free_port as _free_port

__all__ = ["launch", "worker", "DemoMoE", "DemoConfig"]

NUM_EXPERTS = 8
HOSTS = ("ddp", "accelerate", "trainer", "deepspeed")
_HOST_NAMES = {"ddp": "DDP", "accelerate": "DDP (through Accelerate)",
               "trainer": "DDP (through the HF Trainer)", "deepspeed": "DeepSpeed ZeRO-2"}
# Topic frequencies by rank parity: even ranks lean on topics 0-2, odd ones on 2-4; 5-6 are rare;
# 7 never occurs.
_TOPIC_WEIGHTS = {
    0: [8.0, 6.0, 4.0, 1.0, 1.0, 0.15, 0.1, 0.0],
    1: [1.0, 1.0, 4.0, 6.0, 8.0, 0.1, 0.15, 0.0],
}


# ---- launcher ---------------------------------------------------------------------------


def launch(nproc: int, steps: int, out: str | None, host: str = "ddp", ep: int | None = None
           ) -> int:
    """Run the demo on ``nproc`` local gloo processes; return 0 if every worker succeeded.

    torch's launcher runs in this process (one torch import saved); its workers get
    ``OMP_NUM_THREADS=1`` (no oversubscription, and torchrun then does not warn that it sets it).
    """
    if nproc < 1 or steps < 2:
        print(f"selzero demo: need --nproc >= 1 and --steps >= 2 (got {nproc}, {steps}).",
              file=sys.stderr)
        return 2
    if host not in HOSTS:
        print(f"selzero demo: --host {host!r}: expected one of {', '.join(HOSTS)}.",
              file=sys.stderr)
        return 2
    if ep is not None and host != "ddp":
        print(f"selzero demo: --ep {ep} with --host {host}: the expert-parallel demo runs "
              "beside plain DDP only (its MoE layer exchanges tokens itself, "
              "selzero_plugin.moe.ExpertParallelMoE; the demo does not wire it into "
              f"{host}). Run `selzero demo --ep 2 --nproc 4`; for "
              "expert parallelism under DeepSpeed see docs/deepspeed.md (\"group\": "
              "{\"expert_parallel_size\": E}).", file=sys.stderr)
        return 2
    if ep is not None and (ep < 1 or nproc % ep or NUM_EXPERTS % ep):
        print(f"selzero demo: --ep {ep}: expected a divisor of --nproc {nproc} and of the "
              f"{NUM_EXPERTS} experts (e.g. --ep 2 --nproc 4).", file=sys.stderr)
        return 2
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun

    saved_env = dict(os.environ)
    os.environ["OMP_NUM_THREADS"] = "1"
    if host != "ddp":  # DeepSpeed (also imported by Accelerate and transformers) warns without it
        os.environ.setdefault("DS_ACCELERATOR", "cpu" if not torch.cuda.is_available() else "cuda")
    if host in ("accelerate", "trainer") and not torch.cuda.is_available():
        os.environ["ACCELERATE_USE_CPU"] = "1"  # multi-CPU DDP (gloo)
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")  # c10d's C++ info lines
    try:
        with tempfile.TemporaryDirectory(prefix="selzero-demo-") as tmp:
            where = ["--out", out] if out is not None else \
                ["--out", os.path.join(tmp, "checkpoint"), "--temporary"]
            program = ["selzero_plugin.demo_ep", "--ep", str(ep)] if ep is not None else \
                ["selzero_plugin.demo", "--host", host, *where]
            torchrun([f"--nproc-per-node={nproc}", "--nnodes=1", "--master-addr=127.0.0.1",
                      f"--master-port={_free_port()}", "--log-dir", os.path.join(tmp, "logs"),
                      "-m", program[0], "--steps", str(steps), *program[1:]])
        return 0
    except ChildFailedError:
        return 1  # torchrun has printed which rank failed; the worker printed its traceback
    finally:
        os.environ.clear()
        os.environ.update(saved_env)


# ---- the model --------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class DemoConfig:
    dim: int = 30
    """Model width (not a multiple of 4, so chunks do not divide evenly)."""
    hidden: int = 75
    """Expert hidden width."""
    layers: int = 2
    tokens: int = 12
    """Tokens per rank per step."""
    lr: float = 5e-3
    weight_decay: float = 0.1


class DemoExpert(nn.Module):
    """One expert, an explicit module: selzero sees four parameters per expert."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w_in = nn.Linear(dim, hidden)
        self.w_out = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w_out(nn.functional.gelu(self.w_in(x)))


class DemoMoELayer(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.router = nn.Linear(dim, NUM_EXPERTS)
        self.experts = nn.ModuleList(DemoExpert(dim, hidden) for _ in range(NUM_EXPERTS))

    def forward(self, h: torch.Tensor, topics: torch.Tensor) -> torch.Tensor:
        x = self.norm(h)
        gates = torch.softmax(self.router(x), dim=-1)
        y = torch.zeros_like(h)
        for e, expert in enumerate(self.experts):
            idx = (topics == e).nonzero().flatten()
            if idx.numel():  # an expert without tokens gets no gradient at all
                y = y.index_add(0, idx, expert(x[idx]) * gates[idx, e:e + 1])
        return h + y


class DemoMoE(nn.Module):
    """Dense input and output layers (DDP) around ``layers`` MoE layers (experts: selzero)."""

    def __init__(self, cfg: DemoConfig, layer: Any = None) -> None:
        super().__init__()
        self.inp = nn.Linear(cfg.dim, cfg.dim)
        make = layer or (lambda: DemoMoELayer(cfg.dim, cfg.hidden))
        self.layers = nn.ModuleList(make() for _ in range(cfg.layers))
        self.out = nn.Linear(cfg.dim, cfg.dim)

    def forward(self, x: torch.Tensor, topics: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for layer in self.layers:
            h = layer(h, topics)
        return self.out(h)


def _batch(step: int, rank: int, cfg: DemoConfig,
           teacher: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Tokens of one rank at one step: topic-dependent inputs, a per-topic linear target."""
    g = torch.Generator().manual_seed(10_000 * step + rank)
    weights = torch.tensor(_TOPIC_WEIGHTS[rank % 2])
    topics = torch.multinomial(weights, cfg.tokens, replacement=True, generator=g)
    x = teacher["centers"][topics] + 0.5 * torch.randn(cfg.tokens, cfg.dim, generator=g)
    y = torch.einsum("tij,tj->ti", teacher["maps"][topics], x)
    return x, y, topics


def _teacher(cfg: DemoConfig) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1234)
    return {"centers": torch.randn(NUM_EXPERTS, cfg.dim, generator=g),
            "maps": torch.randn(NUM_EXPERTS, cfg.dim, cfg.dim, generator=g) / cfg.dim ** 0.5}


# ---- the worker -------------------------------------------------------------------------


def _deepspeed_engine(model: nn.Module, sz_config: SelZeroConfig, cfg: DemoConfig) -> Any:
    """DeepSpeed ZeRO-2 (fp32, torch AdamW) with the "selected_zero2" entry."""
    import logging

    import selzero_plugin.deepspeed  # noqa: F401 - registers the entry
    import deepspeed

    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)  # its INFO lines at initialize
    config = {
        "train_micro_batch_size_per_gpu": cfg.tokens, "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": 2}, "steps_per_print": 10 ** 9,
        "optimizer": {"type": "AdamW", "params": {"lr": cfg.lr, "weight_decay": cfg.weight_decay,
                                                  "torch_adam": True}},
        "selected_zero2": sz_config.to_dict(),
    }
    engine, _, _, _ = deepspeed.initialize(model=model, config=config)
    return engine


def _optimizer_bytes(engine: Any) -> int:
    """Bytes of DeepSpeed's own optimizer state on this rank (its AdamW moments and steps over
    the partitions it owns), from live storages."""
    seen: set[int] = set()
    total = 0
    for state in engine.basic_optimizer.state.values():
        for t in state.values():
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in seen:
                seen.add(t.untyped_storage().data_ptr())
                total += t.untyped_storage().nbytes()
    return total


def _host_step(host: str, model: nn.Module, sz_config: SelZeroConfig, cfg: DemoConfig) -> Any:
    """(selzero, step(x, y, topics) -> (loss, StepResult)) for a host that the demo drives."""
    if host == "deepspeed":
        engine = _deepspeed_engine(model, sz_config, cfg)

        def step(x: torch.Tensor, y: torch.Tensor, topics: torch.Tensor) -> Any:
            loss = (engine(x, topics) - y).pow(2).mean()
            engine.backward(loss)
            engine.step()
            return loss, engine.selzero_step_result

        step.engine = engine  # type: ignore[attr-defined]
        return engine.selzero, step
    if host == "accelerate":
        from accelerate import Accelerator

        from .accelerate import prepare

        accelerator = Accelerator()
        optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr,
                                      weight_decay=cfg.weight_decay)
        wrapped, optimizer = prepare(accelerator, model, optimizer, config=sz_config)

        def step(x: torch.Tensor, y: torch.Tensor, topics: torch.Tensor) -> Any:
            loss = (wrapped(x, topics) - y).pow(2).mean()
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            return loss, accelerator.selzero_step_result

        step.accelerator = accelerator  # type: ignore[attr-defined]
        return accelerator.selzero, step
    sz = SelectedZero2(model, sz_config, torch.optim.AdamW,
                       {"lr": cfg.lr, "weight_decay": cfg.weight_decay})
    ddp = wrap_ddp(model, sz)
    selected = {id(e.param) for e in sz.entries}
    host_opt = torch.optim.AdamW([p for p in model.parameters() if id(p) not in selected],
                                 lr=cfg.lr, weight_decay=cfg.weight_decay)

    def step(x: torch.Tensor, y: torch.Tensor, topics: torch.Tensor) -> Any:
        loss = (ddp(x, topics) - y).pow(2).mean()
        loss.backward()
        host_opt.step()
        result = sz.step()
        host_opt.zero_grad(set_to_none=True)
        return loss, result

    return sz, step


class _Batches(torch.utils.data.Dataset):
    """Item ``step * world + rank`` is the demo's batch of that rank at that step (read in order,
    one item per rank per step, Accelerate's sharding hands rank r the items r, r + world, ...)."""

    def __init__(self, steps: int, world: int, cfg: DemoConfig,
                 teacher: dict[str, torch.Tensor]) -> None:
        self.items = [_batch(i // world, i % world, cfg, teacher) for i in range(steps * world)]

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        x, y, topics = self.items[i]
        return {"x": x, "y": y, "topics": topics}


class _WithLoss(nn.Module):
    """The demo model as the Trainer wants it: keyword inputs in, ``{"loss": ...}`` out."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor, y: torch.Tensor, topics: torch.Tensor) -> dict:
        return {"loss": (self.model(x, topics) - y).pow(2).mean()}


def _train_with_trainer(model: nn.Module, sz_config: SelZeroConfig, cfg: DemoConfig,
                        teacher: dict[str, torch.Tensor], steps: int, out: str) -> Any:
    """The HF Trainer with SelectedZero2Callback: (trainer, mean losses, skipped, updated)."""
    from transformers import PrinterCallback, Trainer, TrainingArguments
    from transformers.utils import logging as hf_logging

    from .trainer import SelectedZero2Callback

    hf_logging.set_verbosity_error()

    class DemoTrainer(Trainer):
        def _get_train_sampler(self, *args: Any, **kwargs: Any) -> Any:
            return torch.utils.data.SequentialSampler(self.train_dataset)

    args = TrainingArguments(
        output_dir=out, max_steps=steps, per_device_train_batch_size=1, learning_rate=cfg.lr,
        weight_decay=cfg.weight_decay, lr_scheduler_type="constant", max_grad_norm=0.0,
        logging_steps=1, save_strategy="steps", save_steps=steps, report_to="none",
        disable_tqdm=True, use_cpu=not torch.cuda.is_available(), dataloader_num_workers=0,
        log_level="error", remove_unused_columns=False)
    trainer = DemoTrainer(model=_WithLoss(model), args=args,
                          train_dataset=_Batches(steps, dist.get_world_size(), cfg, teacher),
                          data_collator=lambda items: {k: v for k, v in items[0].items()},
                          callbacks=[SelectedZero2Callback(sz_config)])
    trainer.remove_callback(PrinterCallback)  # the demo prints its own report
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    losses = torch.tensor([h["loss"] for h in logs], dtype=torch.float64)
    skipped = sum(h["selzero/skipped_absent"] for h in logs)
    updated = sum(h["selzero/updated"] for h in logs)
    return trainer, losses, skipped, updated


def worker(steps: int, out: str, *, temporary: bool = False, host: str = "ddp") -> None:
    """One rank of the demo (started by torchrun: RANK, WORLD_SIZE, MASTER_* are set)."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        cfg = DemoConfig()
        torch.manual_seed(0)
        model = DemoMoE(cfg)
        initial = {n: p.detach().clone() for n, p in model.named_parameters()}
        sz_config = SelZeroConfig(params=["*layers.*.experts.*"])
        teacher = _teacher(cfg)
        started = time.perf_counter()
        setup_s = 0.0
        if host == "trainer":
            trainer, losses, skipped, updated = _train_with_trainer(model, sz_config, cfg,
                                                                    teacher, steps, out)
            sz = trainer.accelerator.selzero
        else:
            sz, run_step = _host_step(host, model, sz_config, cfg)
            # DeepSpeed's initialize builds a comm op once (~50 s the first time): not training
            setup_s = time.perf_counter() - started
            started = time.perf_counter()
            losses = torch.zeros(steps, dtype=torch.float64)
            skipped = updated = 0
            for step in range(steps):
                loss, result = run_step(*_batch(step, rank, cfg, teacher))
                losses[step] = loss.item()
                skipped += result.skipped_absent
                updated += result.updated
            dist.all_reduce(losses)
            losses /= world
        train_s = time.perf_counter() - started
        host_bytes = None
        if host == "deepspeed":
            mine_ds = torch.tensor([_optimizer_bytes(run_step.engine)], dtype=torch.int64)
            host_bytes = [torch.zeros_like(mine_ds) for _ in range(world)]
            dist.all_gather(host_bytes, mine_ds)

        report = sz.memory_report()
        mine = torch.tensor([report.grad_shard + report.optimizer_state + report.master],
                            dtype=torch.int64)
        per_rank = [torch.zeros_like(mine) for _ in range(world)]
        dist.all_gather(per_rank, mine)
        replicas_agree = _replicas_agree(model)
        dead = [n for n in initial if ".experts.7." in n]
        dead_untouched = all(torch.equal(initial[n], p) for n, p in model.named_parameters()
                             if n in dead)
        if host == "deepspeed":
            run_step.engine.save_checkpoint(out, tag="demo")
            folder = Path(out) / "demo" / "selected_zero2" / sz_config.name
        elif host == "accelerate":
            run_step.accelerator.save_state(os.path.join(out, "demo"))
            folder = Path(out) / "demo" / "selected_zero2" / sz_config.name
        elif host == "trainer":  # the Trainer saved checkpoint-<steps> at its last step
            folder = Path(out) / f"checkpoint-{steps}" / "selected_zero2" / sz_config.name
        else:
            folder = Path(out) / sz_config.name
            sz.save_checkpoint(str(folder))
        checkpoint_lines = _checkpoint_round_trip(sz, sz_config, cfg, model, folder, temporary)

        if rank == 0:
            expert_params = [e.param for e in sz.trainable]
            _print_table(world=world, steps=steps, cfg=cfg, per_rank=per_rank, host=host,
                         host_bytes=host_bytes,
                         expert_params=expert_params, losses=losses, skipped=skipped,
                         updated=updated, dead_untouched=dead_untouched,
                         replicas_agree=replicas_agree, train_s=train_s,
                         checkpoint_lines=checkpoint_lines, setup_s=setup_s)
        failures = []
        if not replicas_agree:
            failures.append("ranks disagree on the parameters after training")
        if not dead_untouched:
            failures.append("an expert that never received a token changed")
        if not losses[-1] < losses[0]:
            failures.append(f"loss did not go down ({losses[0]:.4f} -> {losses[-1]:.4f})")
        failed = torch.tensor([len(failures)])
        dist.all_reduce(failed)  # every rank exits with the same verdict; also a tiny last
        # collective, safer than a gloo barrier before teardown
        if int(failed):
            raise RuntimeError(f"[rank {rank}/{world}] selzero demo failed: "
                               + ("; ".join(failures) or "another rank failed"))
    finally:
        from .process_exit import leave_now

        leave_now()  # instead of destroy_process_group(): see [Note: gloo teardown]


def _replicas_agree(model) -> bool:
    """Every rank holds the same parameters (max and min of a checksum agree)."""
    total = sum(float(p.detach().double().sum()) + float(p.detach().double().abs().sum())
                for p in model.parameters())
    hi = torch.tensor([total], dtype=torch.float64)
    lo = -hi.clone()
    dist.all_reduce(hi, op=dist.ReduceOp.MAX)
    dist.all_reduce(lo, op=dist.ReduceOp.MAX)
    return float(hi) == -float(lo)


def _checkpoint_round_trip(sz: SelectedZero2, sz_config: SelZeroConfig, cfg: DemoConfig,
                           model: nn.Module, folder: Path, temporary: bool) -> list[str]:
    """Reload selzero's saved state (``folder``) into a fresh instance, check weights and state
    match.

    Called last: ``sz`` is detached from the model before the fresh instance is built, so only
    one live instance carries the config's name.
    """
    sz.remove_hooks()
    torch.manual_seed(1)  # different initial weights, so a match proves the load
    fresh_model: nn.Module = DemoMoE(cfg)
    if isinstance(sz.model, _WithLoss):  # the Trainer's view of the model
        fresh_model = _WithLoss(fresh_model)
    model = sz.model
    fresh = SelectedZero2(fresh_model, sz_config, torch.optim.AdamW,
                          {"lr": cfg.lr, "weight_decay": cfg.weight_decay})
    fresh.load_checkpoint(str(folder))
    trained = dict(model.named_parameters())
    loaded = dict(fresh_model.named_parameters())
    same = all(torch.equal(loaded[n], trained[n]) for n in sz.trainable_names)
    same = same and len(fresh.segments) == len(sz.segments) and all(
        _same_state(sz.optimizer.state.get(a, {}), fresh.optimizer.state.get(b, {}))
        for a, b in zip(sz.segments, fresh.segments))
    fresh.remove_hooks()
    flag = torch.tensor([0 if same else 1])
    dist.all_reduce(flag)
    if int(flag):
        raise RuntimeError(f"selzero demo failed: the state reloaded from {folder} differs from "
                           "the trained one")
    files = sorted(p for p in folder.iterdir() if p.is_file())
    size = sum(p.stat().st_size for p in files)
    where = "a temporary folder (--out DIR keeps it)" if temporary else str(folder)
    return [f"checkpoint: {len(files)} files, {_kib(size)}, saved to {where}:",
            "  " + ", ".join(p.name for p in files),
            "  reloaded into a fresh SelectedZero2: expert weights and AdamW state match exactly"]


def _same_state(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k] for k in a)


# ---- the report -------------------------------------------------------------------------


def _kib(n: int) -> str:
    return f"{n / 1024:,.1f} KiB"


def _print_table(*, world: int, steps: int, cfg: DemoConfig, per_rank, expert_params, losses,
                 skipped: int, updated: int, dead_untouched: bool, replicas_agree: bool,
                 train_s: float, checkpoint_lines: list[str], host: str = "ddp",
                 host_bytes: list | None = None, setup_s: float = 0.0) -> None:
    numel = sum(p.numel() for p in expert_params)
    # DDP + AdamW hold, for every expert parameter on every rank: the full FP32 gradient, exp_avg
    # and exp_avg_sq of the same size, and a one-element step tensor.
    ddp_bytes = sum(3 * p.numel() * p.element_size() + 4 for p in expert_params)
    per_expert = len(expert_params) // (cfg.layers * NUM_EXPERTS)
    lines = [
        f"selzero demo: {world} processes (gloo), {cfg.layers} MoE layers x {NUM_EXPERTS} experts, "
        f"top-1 routing, AdamW, {steps} steps",
        f"expert parameters (selzero): {numel:,} in {len(expert_params)} tensors; "
        f"everything else: {_HOST_NAMES[host]}",
        "",
        "per-rank bytes of expert gradients + optimizer state",
        f"  {'rank':<6}{'selzero':>14}{'DDP + AdamW':>16}{'ratio':>8}"
        + (f"{'DeepSpeed optimizer (non-experts)':>36}" if host_bytes is not None else ""),
    ]
    for r, t in enumerate(per_rank):
        held = int(t[0])
        lines.append(f"  {r:<6}{_kib(held):>14}{_kib(ddp_bytes):>16}{held / ddp_bytes:>8.2f}"
                     + (f"{_kib(int(host_bytes[r][0])):>36}" if host_bytes is not None else ""))
    lines.append(f"  (selzero holds 1/{world} of each gradient and moment, and no state for an "
                 "expert not yet updated)")
    skipped_experts = skipped // per_expert
    lines += [
        "",
        f"loss (mean over ranks)   step 1: {float(losses[0]):.4f}   "
        f"step {steps}: {float(losses[-1]):.4f}",
        f"expert updates skipped (expert absent on every rank): {skipped_experts} of "
        f"{(skipped + updated) // per_expert} ({skipped} parameter updates)",
        f"expert 7 (never routed): {'bit-identical to its start' if dead_untouched else 'CHANGED'}"
        " (no update, no weight decay, no AdamW step count)",
        f"replicas identical after training: {'yes' if replicas_agree else 'NO'}",
        *checkpoint_lines,
        f"training time: {train_s:.1f} s" + (
            f" (DeepSpeed's initialize before it, one-off op build included: {setup_s:.1f} s)"
            if host == "deepspeed" else ""),
    ]
    print("\n".join(lines), flush=True)


def _quiet() -> None:
    """Hide other libraries' warnings (torch's deprecation notes etc.); selzero's still show."""
    warnings.filterwarnings("ignore")
    warnings.filterwarnings("default", module=r"selzero_plugin(\..*)?")


def _main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m selzero_plugin.demo",
                                     description="one rank of `selzero demo` (run by torchrun)")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--out", required=True, help="folder for the demo's checkpoint")
    parser.add_argument("--temporary", action="store_true", help="--out is removed afterwards")
    parser.add_argument("--host", default="ddp", choices=HOSTS)
    args = parser.parse_args(argv)
    _quiet()
    worker(args.steps, args.out, temporary=args.temporary, host=args.host)
    return 0


if __name__ == "__main__":
    from selzero_plugin.process_exit import exit_after

    exit_after(_main)  # see [Note: gloo teardown]
