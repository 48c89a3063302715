"""selzero side by side with DDP, FSDP2 and DeepSpeed ZeRO-2: step time, memory, bytes moved.

Run: ``make bench`` (or ``.venv/bin/python benchmarks/bench.py``). Options:
``--workloads a,c,d --modes ddp,selzero,fsdp2,deepspeed,deepspeed-sz,selzero-uneven
--rounds 3 --steps 6 --warmup 2 --world 2 --backend gloo|nccl --out benchmarks/results``.

Workloads (sizes are arguments of ``WORKLOADS``):
  a  the 17M-parameter MoE of research/prior-art.md: 4 layers, each a dense Linear(256, 256)
     and 8 experts Linear(256, 1024) -> GELU -> Linear(1024, 256); 64 tokens per rank.
  b  the same shape at ~50M parameters (hidden 2048, 8 layers... see WORKLOADS), for 4 ranks.
  c  many small experts: 8 layers x 64 experts Linear(64, 128) -> Linear(128, 64); 512 tokens,
     so that the per-(virtual-)parameter cost of the step path shows.
  d  a transformers Qwen3-MoE built from a config (fused experts, ``expert_dim: 0``).
  e  finer still: 4 layers x 256 experts (DeepSeek-V3's count per layer) Linear(64, 128) ->
     Linear(128, 64) in a ModuleList: 4,096 expert tensors; 512 tokens.
  f  the same experts as one fused tensor per weight and layer (``w1`` [256, 64, 128], ``w2``
     [256, 128, 64], ``expert_dim: 0``): 8 tensors of 256 virtual parameters each.
The timing rows route every token so that every expert gets tokens on every rank in every
step (token i -> expert i mod E; Qwen3's router on random tokens): stock DeepSpeed ZeRO-1/2 and
FSDP2 hang or train wrong otherwise (research/prior-art.md). ``selzero-uneven`` is selzero with
routing that differs by rank and leaves experts without tokens (the peers cannot run it).

Rows: ``ddp`` DDP + AdamW on everything; ``selzero`` selzero on the experts + DDP on the rest;
``fsdp2`` fully_shard(reshard_after_forward=False) per expert block + root; ``deepspeed`` stock
DeepSpeed ZeRO-2 over the whole model; ``deepspeed-sz`` DeepSpeed ZeRO-2 with the
``"selected_zero2"`` entry; ``selzero-tensors`` selzero with ``partition="tensors"`` (each
rank owns whole expert tensors; the same AdamW), whose step time the table also gives as a
ratio to ``selzero``'s within each round; ``selzero-before`` the ``selzero`` row run with the
package of another tree (``--before DIR``: a worktree of an earlier commit, first on the rank
processes' ``sys.path``), for a before/after in the same rounds.

Method. Modes are interleaved round-robin in fresh processes (ddp, selzero, ..., ddp, selzero,
...), so a busy machine slows a whole round alike; each figure is the median over rounds and
each ratio is taken within a round (median and min-max over rounds). Per mode and round:

- ms/step: median after warm-up (the JSON's ``cpu_ms``: each rank's median CPU time of a step,
  every thread of its process);
- subset bytes per rank: gradients + optimizer state + masters of the expert parameters, from
  the live tensors' storages after a step (for selzero ``memory_report()``, whose
  ``ideal_total`` is the real-chunk ideal; FSDP2: the local shards; DDP: full tensors);
- peak RSS per rank (``ru_maxrss``);
- bytes passed to collectives per step, counted by wrapping ``torch.distributed``'s collectives
  in every worker before anything else is imported (DDP's C++ reducer through a counting comm
  hook), split into the expert subset's and the rest, and converted to bytes on the wire per
  rank under the ring model (all-reduce 2(N-1)/N, reduce-scatter and all-gather (N-1)/N of the
  full size, broadcast (N-1)/N: what a rank receives, on average over ranks); the lower bound
  for the subset is (N-1)/N * P * (4 + b): an FP32 reduce-scatter plus an all-gather in the parameter dtype. DeepSpeed on CPU may move some
  bytes through its own shared-memory op, which the wrapper does not see: its rows say so.

Output: ``<out>/bench-<workload>.md`` (the table and the command line) and ``.png`` (a plot of
the step-time ratios and subset bytes), ``<out>/bench.json`` (every round's figures).
"""

from __future__ import annotations

import argparse
import functools
import inspect
import json
import os
import resource
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any, Callable

WORKLOADS: dict[str, dict[str, Any]] = {
    "a": {"kind": "moe", "d": 256, "h": 1024, "experts": 8, "layers": 4, "tokens": 64},
    "b": {"kind": "moe", "d": 512, "h": 1024, "experts": 8, "layers": 6, "tokens": 64},
    "c": {"kind": "moe", "d": 64, "h": 128, "experts": 64, "layers": 8, "tokens": 512},
    "d": {"kind": "qwen3", "hidden": 256, "moe_intermediate": 256, "experts": 16,
          "layers": 4, "tokens": 64},
    "e": {"kind": "moe", "d": 64, "h": 128, "experts": 256, "layers": 4, "tokens": 512,
          "grouped": True},
    "f": {"kind": "fused", "d": 64, "h": 128, "experts": 256, "layers": 4, "tokens": 512},
}
MODES = ["ddp", "selzero", "fsdp2", "deepspeed", "deepspeed-sz", "selzero-uneven",
         "selzero-tensors"]
# extra row: selzero-allreduce (SELZERO_GLOO_REDUCE=all_reduce: each bucket reduced by one
# in-place all-reduce on gloo, the way before the point-to-point reduce-scatter)
ACCUMULATION = 4  # micro-batches per step of the *-acc4 rows (not in the default modes)
# extra rows: ddp-acc4 (no_sync on the first 3), selzero-acc4 (reduced micro-steps:
# end_microstep), selzero-acc4-nosync (local micro-steps under ddp.no_sync())


# ---- counting collectives ------------------------------------------------------------------


class Counter:
    """Bytes passed to collectives since the last ``take()``, by (op, subset?)."""

    def __init__(self) -> None:
        self.rows: list[tuple[str, int, int, bool]] = []  # op, bytes, group size, subset
        self.active = False

    def add(self, op: str, nbytes: int, size: int, subset: bool) -> None:
        if self.active:
            self.rows.append((op, nbytes, size, subset))

    def take(self) -> list[tuple[str, int, int, bool]]:
        rows, self.rows = self.rows, []
        return rows


COUNTER = Counter()
PLAN_CHECK: dict[str, Any] = {}
KEPT: dict[str, int] = {}  # selzero rows: bytes of the bucket blocks its pool keeps (CPU)
_RING = {"all_reduce": lambda n: 2 * (n - 1) / n, "reduce_scatter": lambda n: (n - 1) / n,
         "all_gather": lambda n: (n - 1) / n, "broadcast": lambda n: (n - 1) / n,
         "all_to_all": lambda n: (n - 1) / n, "send": lambda n: 1.0}


def _nbytes(t: Any) -> int:
    if isinstance(t, (list, tuple)):
        return sum(_nbytes(x) for x in t)
    return t.numel() * t.element_size() if hasattr(t, "numel") else 0


def install_counters() -> None:
    """Wrap torch.distributed's collectives (before selzero, FSDP2 or DeepSpeed bind them)."""
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    def wrap(name: str, op: str, argument: str) -> None:
        original = getattr(c10d, name, None)
        if original is None:
            return
        signature = inspect.signature(original)

        @functools.wraps(original)
        def counted(*args: Any, **kwargs: Any) -> Any:
            bound = signature.bind_partial(*args, **kwargs).arguments
            group = bound.get("group")
            n = dist.get_world_size(group) if dist.is_initialized() else 1
            # selzero's own groups are named selzero-...: their traffic is the subset's
            label = getattr(group, "group_name", "") if group is not None else ""
            COUNTER.add(op, _nbytes(bound.get(argument)), n, label.startswith("selzero-"))
            return original(*args, **kwargs)

        setattr(c10d, name, counted)
        if getattr(dist, name, None) is original:
            setattr(dist, name, counted)

    wrap("all_reduce", "all_reduce", "tensor")
    wrap("reduce_scatter_tensor", "reduce_scatter", "input")
    wrap("all_gather_into_tensor", "all_gather", "output_tensor")
    wrap("all_gather", "all_gather", "tensor_list")
    wrap("reduce_scatter", "reduce_scatter", "input_list")
    wrap("broadcast", "broadcast", "tensor")
    wrap("all_to_all_single", "all_to_all", "input")
    wrap("all_gather_single", "all_gather", "output_tensor")  # torch 2.13: FSDP2, selzero
    wrap("reduce_scatter_single", "reduce_scatter", "input")
    # point-to-point sends (selzero's reduce-scatter on gloo calls the process group's own
    # send: [Note: p2p reduce-scatter]): every byte is on the wire once
    process_group = dist.ProcessGroup
    send = process_group.send

    def counted_send(self: Any, tensors: Any, *args: Any, **kwargs: Any) -> Any:
        label = getattr(self, "group_name", "")
        COUNTER.add("send", _nbytes(tensors), self.size(), label.startswith("selzero-"))
        return send(self, tensors, *args, **kwargs)

    process_group.send = counted_send


def ddp_counting_hook(subset_ids: set[int]) -> Callable[..., Any]:
    """A DDP comm hook: count each bucket (its expert part as subset), then all-reduce."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    def hook(state, bucket):  # noqa: ANN001, ANN202 - DDP checks the annotations
        import torch.distributed as dist

        n = dist.get_world_size()
        params = bucket.parameters()
        subset = sum(p.numel() * p.element_size() for p in params if id(p) in subset_ids)
        COUNTER.add("all_reduce", subset, n, True)
        COUNTER.add("all_reduce", _nbytes(bucket.buffer()) - subset, n, False)
        return allreduce_hook(state, bucket)

    return hook


def wire_bytes(rows: list[tuple[str, int, int, bool]], subset: bool) -> tuple[int, int]:
    """(bytes passed to collectives, bytes on the wire per rank under the ring model)."""
    chosen = [r for r in rows if r[3] == subset]
    return (sum(r[1] for r in chosen),
            int(sum(r[1] * _RING[r[0]](r[2]) for r in chosen if r[2] > 1)))


# ---- models ----------------------------------------------------------------------------------


def build_model(spec: dict[str, Any]) -> Any:
    import torch
    from torch import nn

    if spec["kind"] == "qwen3":
        from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

        config = Qwen3MoeConfig(
            vocab_size=512, hidden_size=spec["hidden"], intermediate_size=spec["hidden"] * 2,
            moe_intermediate_size=spec["moe_intermediate"], num_hidden_layers=spec["layers"],
            num_attention_heads=4, num_key_value_heads=2, head_dim=spec["hidden"] // 4,
            num_experts=spec["experts"], num_experts_per_tok=2, decoder_sparse_step=1,
            max_position_embeddings=256, tie_word_embeddings=False)
        torch.manual_seed(0)
        return Qwen3MoeForCausalLM(config)

    d, h, experts = spec["d"], spec["h"], spec["experts"]

    class Expert(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w1, self.w2 = nn.Linear(d, h), nn.Linear(h, d)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.w2(nn.functional.gelu(self.w1(x)))

    class FusedExperts(nn.Module):
        """Every expert's weights in one tensor per weight (expert dimension 0), no biases."""

        def __init__(self) -> None:
            super().__init__()
            self.num_experts = experts  # a fused module opts in to expert_dim by declaring it
            self.w1 = nn.Parameter(torch.randn(experts, d, h) / d ** 0.5)
            self.w2 = nn.Parameter(torch.randn(experts, h, d) / h ** 0.5)

        def forward(self, hidden: torch.Tensor, routes: torch.Tensor) -> torch.Tensor:
            # each token through its expert's weights, gathered per token (one batched matmul;
            # indexing w[e] per expert instead makes each expert's backward a full-size
            # gradient of the fused tensor: 256 of them per weight ran out of memory)
            h = nn.functional.gelu(torch.bmm(hidden[:, None, :], self.w1[routes]))
            return torch.bmm(h, self.w2[routes])[:, 0, :]

    def _grouped(hidden: torch.Tensor, routes: torch.Tensor, apply: Any) -> torch.Tensor:
        """Tokens sorted by expert once, each expert applied to its slice (the usual MoE
        dispatch); the result scattered back in token order."""
        order = torch.argsort(routes, stable=True)
        counts = torch.bincount(routes, minlength=experts).tolist()
        parts, start = [], 0
        for e, count in enumerate(counts):
            if count:
                parts.append(apply(e, hidden[order[start:start + count]]))
            start += count
        return torch.zeros_like(hidden).index_copy(0, order, torch.cat(parts))

    class Layer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.dense = nn.Linear(d, d)
            self.experts: nn.Module = (
                FusedExperts() if spec["kind"] == "fused"
                else nn.ModuleList(Expert() for _ in range(experts)))
            self.routes: torch.Tensor | None = None

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            hidden = torch.relu(self.dense(x))
            if spec["kind"] == "fused":
                return x + self.experts(hidden, self.routes)
            if spec.get("grouped"):
                return x + _grouped(hidden, self.routes, lambda e, t: self.experts[e](t))
            y = torch.zeros_like(hidden)
            for e, expert in enumerate(self.experts):
                idx = (self.routes == e).nonzero().flatten()
                if idx.numel():
                    y = y.index_add(0, idx, expert(hidden[idx]))
            return x + y

    class MoE(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Linear(d, d)
            self.layers = nn.ModuleList(Layer() for _ in range(spec["layers"]))

        def route(self, routes: torch.Tensor) -> None:
            for layer in self.layers:
                layer.routes = routes

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = self.embed(x)
            for layer in self.layers:
                x = layer(x)
            return x

    torch.manual_seed(0)
    return MoE()


def expert_names(spec: dict[str, Any]) -> list[str]:
    return ["*.mlp.experts.*"] if spec["kind"] == "qwen3" else ["*.experts.*"]


def is_expert(spec: dict[str, Any], name: str) -> bool:
    return ".mlp.experts." in name if spec["kind"] == "qwen3" else ".experts." in name


def selection(spec: dict[str, Any], bucket_mb: float = 25.0) -> dict[str, Any]:
    """The selzero config of every selzero row: the experts (fused ones along dimension 0)."""
    return {"params": expert_names(spec), "bucket_mb": bucket_mb,
            **({"expert_dim": 0} if spec["kind"] in ("qwen3", "fused") else {})}


# ---- one mode in one set of processes --------------------------------------------------------


def _worker(rank: int, world: int, mode: str, spec: dict[str, Any], args: argparse.Namespace,
            init: str, out: str) -> None:
    before = mode == "selzero-before"
    if before:  # the earlier tree's package, before anything imports one
        if not args.before:
            raise SystemExit("mode selzero-before needs --before DIR (a worktree)")
        sys.path.insert(0, str(Path(args.before).resolve()))
        mode = "selzero"
    install_counters()  # before selzero / FSDP2 / DeepSpeed bind the collectives
    if before:
        import selzero_plugin
        where = Path(selzero_plugin.__file__).resolve()
        if not where.is_relative_to(Path(args.before).resolve()):
            raise SystemExit(f"selzero-before imported {where}, not the package of {args.before}")
    import torch
    import torch.distributed as dist

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    os.environ.update({"LOCAL_RANK": str(rank), "RANK": str(rank), "WORLD_SIZE": str(world),
                       "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": str(29500 + os.getpid() % 400)})
    device = torch.device("cpu")
    if args.backend == "nccl":
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
    dist.init_process_group(args.backend, init_method=f"file://{init}", rank=rank,
                            world_size=world)
    model = build_model(spec).to(device)
    subset = [p for n, p in model.named_parameters() if is_expert(spec, n)]
    subset_ids = {id(p) for p in subset}
    step, memory = _setup(mode, model, spec, subset, subset_ids, args)
    batch = _batch(spec, rank, mode, device)
    times, cpu, counted = [], [], []
    for i in range(args.warmup + args.steps):
        if device.type == "cuda":
            torch.cuda.synchronize()
        COUNTER.active = i == args.warmup  # one step's collectives, after warm-up
        t0, c0 = time.perf_counter(), time.process_time()
        step(batch)
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)  # every thread of the process (gloo's included)
        COUNTER.active = False
        if i == args.warmup:
            counted = COUNTER.take()
    backward_peak = _traced_backward_peak(step, batch)  # one more step, not timed
    peak = torch.tensor([resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0],
                        dtype=torch.float64, device=device)
    peaks = torch.zeros(world, dtype=torch.float64, device=device)
    dist.all_gather_into_tensor(peaks, peak)
    cpu_ms = torch.zeros(world, dtype=torch.float64, device=device)  # per rank, median
    dist.all_gather_into_tensor(cpu_ms, torch.tensor(
        [1000 * statistics.median(cpu[args.warmup:])], dtype=torch.float64, device=device))
    bytes_subset, ideal = memory()
    passed, wire = wire_bytes(counted, True)
    if mode == "fsdp2":  # one group for the expert blocks and the root: the experts' share is
        # all of FSDP2's traffic minus the root's (its dense parameters: an FP32
        # reduce-scatter and an all-gather, ring model)
        dense = sum(p.numel() * p.element_size() for n, p in model.named_parameters()
                    if not is_expert(spec, n))
        total = wire_bytes(counted, False)[1]
        wire = int(total - (world - 1) / world * dense * 2)
        passed = -1  # derived, not passed
    result = {"mode": mode, "ms": 1000 * statistics.median(times[args.warmup:]),
              "subset_bytes": bytes_subset, "subset_ideal": ideal,
              "peak_rss_mib": peaks.tolist(), "cpu_ms": cpu_ms.tolist(),
              "subset_passed": passed, "subset_wire": wire,
              "other_wire": wire_bytes(counted, False)[1] if mode != "fsdp2" else
              int((world - 1) / world * sum(p.numel() * p.element_size() * 2 for n, p in
                                          model.named_parameters() if not is_expert(spec, n))),
              "subset_elements": sum(p.numel() for p in subset),
              "subset_dtype_bytes": subset[0].element_size(),
              "ops": sorted({f"{op}{'*' if s else ''}" for op, _, _, s in counted}),
              "backward_peak": backward_peak, "kept_gradient_buffers": KEPT.get("bytes", -1),
              "bucket_bytes": KEPT.get("bucket", -1),
              "plan": dict(PLAN_CHECK)}
    if rank == 0:
        Path(out).write_text(json.dumps(result))
    dist.destroy_process_group()


def _traced_backward_peak(step: Callable[[Any], None], batch: Any) -> int:
    """Allocation-level peak (bytes) of the backward of one more step, on the training thread
    (``selzero_plugin.memtrace``): every row alike, whoever calls ``torch.autograd.backward``."""
    import torch

    from selzero_plugin.memtrace import track_allocations

    original = torch.autograd.backward
    peaks: list[int] = []

    def traced(*args: Any, **kwargs: Any) -> Any:
        with track_allocations() as trace:
            result = original(*args, **kwargs)
        peaks.append(trace.peak)
        return result

    torch.autograd.backward = traced
    try:
        step(batch)
    finally:
        torch.autograd.backward = original
    return max(peaks, default=-1)


def _batch(spec: dict[str, Any], rank: int, mode: str, device: Any) -> Any:
    import torch

    g = torch.Generator().manual_seed(rank)
    if spec["kind"] == "qwen3":
        return torch.randint(0, 512, (2, spec["tokens"] // 2), generator=g).to(device)
    tokens, experts = spec["tokens"], spec["experts"]
    x = torch.randn(tokens, spec["d"], generator=g).to(device)
    routes = torch.arange(tokens) % experts  # every expert gets tokens on every rank
    if mode == "selzero-uneven":  # rank r skips experts r, r + 2, ...; differs by rank
        routes = torch.where(routes % 2 == rank % 2, (routes + 1) % experts, routes)
    return x, routes.to(device)


def _loss(model: Any, spec: dict[str, Any], batch: Any, forward: Any = None) -> Any:
    forward = forward or model
    if spec["kind"] == "qwen3":
        return forward(input_ids=batch, labels=batch).loss
    x, routes = batch
    (model.module if hasattr(model, "module") else model).route(routes)
    return forward(x).pow(2).mean()


def _bytes(tensors: list[Any]) -> int:
    seen = {}
    for t in tensors:
        if hasattr(t, "untyped_storage"):
            if hasattr(t, "to_local"):
                t = t.to_local()
            s = t.untyped_storage()
            seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


def _setup(mode: str, model: Any, spec: dict[str, Any], subset: list[Any], subset_ids: set[int],
           args: argparse.Namespace) -> tuple[Callable[[Any], None], Callable[[], tuple[int, int]]]:
    import torch
    from torch import nn

    kwargs = {"lr": 1e-4, "weight_decay": 0.1}
    sz_config = selection(spec, args.bucket_mb)

    def full_state(opt: Any) -> Callable[[], tuple[int, int]]:
        def memory() -> tuple[int, int]:
            tensors = [p.grad for p in subset] + [v for p in subset
                                                  for v in opt.state[p].values()]
            return _bytes(tensors), -1
        return memory

    if mode in ("ddp-acc4", "selzero-acc4", "selzero-acc4-nosync"):
        return _setup_accumulation(mode, model, spec, subset_ids, kwargs, sz_config)
    if mode == "ddp":
        ddp = nn.parallel.DistributedDataParallel(model)
        ddp.register_comm_hook(None, ddp_counting_hook(subset_ids))
        opt = torch.optim.AdamW(model.parameters(), **kwargs)

        def step(batch: Any) -> None:
            _loss(model, spec, batch, ddp).backward()
            opt.step()
            opt.zero_grad(set_to_none=False)  # DDP keeps its gradient buckets alive anyway
        return step, full_state(opt)
    if mode in ("selzero", "selzero-uneven", "selzero-tensors", "selzero-allreduce"):
        from selzero_plugin import SelectedZero2, wrap_ddp

        if mode == "selzero-allreduce":
            os.environ["SELZERO_GLOO_REDUCE"] = "all_reduce"

        if mode == "selzero-tensors":
            sz_config = {**sz_config, "partition": "tensors"}
        sz = SelectedZero2(model, sz_config, torch.optim.AdamW, kwargs)
        _note_kept(sz)
        ddp = wrap_ddp(model, sz)
        ddp.register_comm_hook(None, ddp_counting_hook(subset_ids))
        host = torch.optim.AdamW([p for p in model.parameters() if id(p) not in subset_ids],
                                 **kwargs)

        def step(batch: Any) -> None:
            _loss(model, spec, batch, ddp).backward()
            host.step()
            sz.step()
            host.zero_grad()

        def memory() -> tuple[int, int]:
            report = sz.memory_report()
            if mode == "selzero":  # every expert stepped: `selzero plan` must predict it exactly
                import torch.distributed as dist

                from selzero_plugin.plan import plan_memory

                with torch.device("meta"):
                    shape_only = build_model(spec)
                predicted = plan_memory(shape_only, sz_config, dist.get_world_size(),
                                        torch.optim.AdamW, kwargs).ranks[dist.get_rank()]
                # optimizer state exists only for slots stepped at least once (a router may
                # leave an expert without tokens): the plan is exact once all were
                stepped = sum(1 for seg in sz.segments if sz.optimizer.state.get(seg))
                PLAN_CHECK.update(predicted=predicted.total, measured=report.total,
                                  stepped=stepped, slots=len(sz.segments),
                                  equal=(predicted.grad_shard, predicted.optimizer_state,
                                         predicted.master) == (report.grad_shard,
                                                               report.optimizer_state,
                                                               report.master),
                                  equal_without_state=(predicted.grad_shard, predicted.master)
                                  == (report.grad_shard, report.master))
            return report.total, report.ideal_total
        return step, memory
    if mode == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        blocks = []  # each expert (a ModuleList has no forward), or a fused experts module
        for n, m in model.named_modules():
            if n.endswith(".experts"):
                blocks += list(m) if isinstance(m, nn.ModuleList) else [m]
        for block in blocks:
            fully_shard(block, reshard_after_forward=False)
        fully_shard(model, reshard_after_forward=False)
        opt = torch.optim.AdamW(model.parameters(), **kwargs)

        def step(batch: Any) -> None:
            _loss(model, spec, batch).backward()
            opt.step()
            opt.zero_grad(set_to_none=False)

        def memory() -> tuple[int, int]:
            live = [p for n, p in model.named_parameters() if is_expert(spec, n)]
            tensors = [p.grad for p in live] + [v for p in live for v in opt.state[p].values()]
            return _bytes(tensors), -1
        return step, memory
    if mode in ("deepspeed", "deepspeed-sz"):
        os.environ.setdefault("DS_ACCELERATOR", "cpu" if args.backend == "gloo" else "cuda")
        engine = deepspeed_engine(model, kwargs, sz_config if mode == "deepspeed-sz" else None)
        sz = getattr(engine, "selzero", None)
        if sz is not None:
            _note_kept(sz)

        def step(batch: Any) -> None:
            engine.backward(_loss(engine.module, spec, batch, engine))
            engine.step()

        def memory() -> tuple[int, int]:
            if sz is not None:
                report = sz.memory_report()
                return report.total, report.ideal_total
            return -1, -1  # DeepSpeed's flat partitions mix experts and dense parameters
        return step, memory
    raise SystemExit(f"unknown mode {mode!r}")


def _note_kept(sz: Any) -> None:
    """The bucket blocks selzero's CPU pool allocates once and reuses ([Note: buffer pool]):
    allocated before the backward, so the traced peak does not see them; they count as
    transient gradient memory all the same."""
    pool = sz.collectives.pool
    KEPT["bytes"] = pool.kept_bytes  # and the p2p receive temporary on gloo
    KEPT["bucket"] = pool.block_bytes


def deepspeed_engine(model: Any, kwargs: dict[str, Any], entry: dict[str, Any] | None) -> Any:
    """Stock DeepSpeed ZeRO-2 with torch AdamW, or with the ``"selected_zero2"`` ``entry``."""
    if entry is not None:
        import selzero_plugin.deepspeed  # noqa: F401 - registers the entry
    import deepspeed

    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 2},
        "optimizer": {"type": "AdamW", "params": {**kwargs, "torch_adam": True}},
        "steps_per_print": 10 ** 9}
    if entry is not None:
        config["selected_zero2"] = entry
    return deepspeed.initialize(model=model, config=config)[0]


def _setup_accumulation(mode: str, model: Any, spec: dict[str, Any], subset_ids: set[int],
                        kwargs: dict[str, Any], sz_config: dict[str, Any]
                        ) -> tuple[Callable[[Any], None], Callable[[], tuple[int, int]]]:
    """ACCUMULATION micro-batches per step (the same batch, divided): DDP with no_sync on all
    but the last; selzero with reduced micro-steps (end_microstep) or under ddp.no_sync()."""
    import contextlib

    import torch
    from torch import nn

    if mode == "ddp-acc4":
        ddp = nn.parallel.DistributedDataParallel(model)
        ddp.register_comm_hook(None, ddp_counting_hook(subset_ids))
        opt = torch.optim.AdamW(model.parameters(), **kwargs)

        def step(batch: Any) -> None:
            for micro in range(ACCUMULATION):
                sync = micro == ACCUMULATION - 1
                with contextlib.nullcontext() if sync else ddp.no_sync():
                    (_loss(model, spec, batch, ddp) / ACCUMULATION).backward()
            opt.step()
            opt.zero_grad(set_to_none=False)

        def memory() -> tuple[int, int]:
            ps = [p for p in model.parameters() if id(p) in subset_ids]
            return _bytes([p.grad for p in ps] + [v for p in ps for v in opt.state[p].values()]), -1
        return step, memory
    from selzero_plugin import SelectedZero2, wrap_ddp

    sz = SelectedZero2(model, sz_config, torch.optim.AdamW, kwargs)
    ddp = wrap_ddp(model, sz)
    ddp.register_comm_hook(None, ddp_counting_hook(subset_ids))
    host = torch.optim.AdamW([p for p in model.parameters() if id(p) not in subset_ids], **kwargs)
    local = mode == "selzero-acc4-nosync"

    def step(batch: Any) -> None:
        for micro in range(ACCUMULATION):
            last = micro == ACCUMULATION - 1
            with contextlib.nullcontext() if last or not local else ddp.no_sync():
                (_loss(model, spec, batch, ddp) / ACCUMULATION).backward()
            if not last and not local:
                sz.end_microstep()
        host.step()
        sz.step()
        host.zero_grad()

    def memory() -> tuple[int, int]:
        report = sz.memory_report()
        return report.total, report.ideal_total
    return step, memory


def run_mode(mode: str, spec: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    return run_workers(_worker, args.world, mode, mode, spec, args)


def run_workers(worker: Callable[..., None], world: int, label: str, *args: Any
                ) -> dict[str, Any]:
    """``worker(rank, world, *args, init_file, out_file)`` on ``world`` fresh processes; the JSON
    the workers wrote to ``out_file``."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        try:
            mp.start_processes(worker, nprocs=world, start_method="spawn",
                               args=(world, *args, os.path.join(tmp, "init"), out))
        except mp.ProcessExitedException as e:
            if not os.path.exists(out):  # gloo can abort a process at exit after its work
                raise
            print(f"note: {label}: a process ended abnormally after reporting ({e})",
                  file=sys.stderr)
        return json.loads(Path(out).read_text())


# ---- the report ------------------------------------------------------------------------------


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"


def _mb(n: float) -> str:
    return "n/a" if n < 0 else f"{n / 1e6:.2f} MB"


def _transient(row: dict[str, Any]) -> str:
    """Rank 0's allocation-level peak during one backward, plus selzero's kept bucket blocks
    (in largest-bucket units)."""
    peak = row.get("backward_peak", -1)
    if peak < 0:
        return "n/a"
    kept, bucket = row.get("kept_gradient_buffers", -1), row.get("bucket_bytes", -1)
    if kept < 0:
        return _mb(peak)
    return f"{_mb(peak + kept)} = {(peak + kept) / bucket:.2f} buckets (kept blocks {kept / bucket:.0f})"


def table(workload: str, rounds: list[dict[str, dict[str, Any]]], modes: list[str],
          args: argparse.Namespace) -> str:
    base = "ddp" if "ddp" in modes else modes[0]
    first = rounds[0][modes[0]]
    n, p, b = args.world, first["subset_elements"], first["subset_dtype_bytes"]
    bound = (n - 1) / n * p * (4 + b)
    lines = [
        f"### Workload {workload}: {json.dumps(WORKLOADS[workload])}",
        "",
        f"{args.world} ranks ({args.backend}), {len(rounds)} rounds, modes interleaved in "
        "fresh processes; median (min-max) over rounds, ratios taken within a round. Routing "
        "reaches every expert on every rank in every step (the peers need it), except "
        "`selzero-uneven`. Subset: the expert parameters, "
        f"P = {p:,} elements; wire lower bound (N-1)/N * P * (4 + {b}) = {_mb(bound)} per rank "
        "(on gloo selzero reduces with a point-to-point reduce-scatter, (N-1)/N, and gathers "
        "with one broadcast per rank's row, (N-1)/N; `selzero-allreduce` reduces with one "
        "in-place all-reduce per bucket instead, 2(N-1)/N: 1.5x the bound at N=2 in fp32; on "
        "NCCL the real reduce-scatter and all-gather run). Wire bytes: ring model of the bytes "
        "passed to torch.distributed's collectives in one step, point-to-point sends counted "
        "as sent. Backward transient: rank 0's allocation-level peak during "
        "one backward (`selzero_plugin.memtrace`), plus, for selzero, the bucket blocks its "
        "CPU pool allocates once and reuses; DDP's gradients live in its buckets for the "
        "whole run (not transient), so its figure is what the backward allocates besides; "
        "the DeepSpeed rows' figure is dominated by DeepSpeed's own reduction bucket for its "
        "parameters (default reduce_bucket_size, 5e8 elements, allocated in each backward; "
        "its pages are touched only as far as used, see peak RSS).",
        "",
        f"| mode | ms/step | vs {base} | subset grad+state+master per rank | vs ideal | "
        "peak RSS per rank (MiB) | backward transient | subset wire bytes per rank | "
        "vs lower bound | other wire |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for mode in modes:
        rows = [rd[mode] for rd in rounds]
        ms = statistics.median(r["ms"] for r in rows)
        ratio = spread([rd[mode]["ms"] / rd[base]["ms"] for rd in rounds])
        mem, ideal = rows[0]["subset_bytes"], rows[0]["subset_ideal"]
        vs_ideal = f"{mem / ideal:.4f}" if ideal > 0 and mem >= 0 else "n/a"
        rss = " / ".join(f"{statistics.median(r['peak_rss_mib'][k] for r in rows):.0f}"
                         for k in range(args.world))
        wire = rows[0]["subset_wire"]
        note = {"deepspeed-sz": " (selzero's groups)",
                "fsdp2": " (all FSDP2 minus the root's)"}.get(mode, "")
        wire_txt, vs_bound = f"{_mb(wire)}{note}", f"{wire / bound:.2f}"
        if mode == "deepspeed":  # one flat partitioned buffer for the whole model
            wire_txt, vs_bound = "n/a (whole model in one buffer: see other)", "n/a"
        lines.append(f"| {mode} | {ms:.1f} | {ratio} | {_mb(mem)} | {vs_ideal} | {rss} | "
                     f"{_transient(rows[0])} | {wire_txt} | {vs_bound} | "
                     f"{_mb(rows[0]['other_wire'])} |")
    if "selzero" in modes and "selzero-tensors" in modes:
        lines += ["", "partition `tensors` / `chunks` (selzero-tensors / selzero), step time "
                  "within a round: " + spread([rd["selzero-tensors"]["ms"] / rd["selzero"]["ms"]
                                                for rd in rounds])]
    plan = rounds[0].get("selzero", {}).get("plan")
    if plan:
        verdict = "equal in every field" if plan["equal"] else "DIFFERENT"
        if not plan["equal"] and plan["stepped"] < plan["slots"] and plan["equal_without_state"]:
            verdict = (f"gradient shard and masters equal; {plan['slots'] - plan['stepped']} of "
                       f"{plan['slots']} (virtual) parameters were never stepped (the router "
                       "gave those experts no token), so they hold no optimizer state yet, "
                       "which the plan counts")
        lines += ["", f"`selzero plan` on the same model and selection predicted "
                  f"{plan['predicted']:,} bytes for rank 0; memory_report() measured "
                  f"{plan['measured']:,}: {verdict}."]
    lines += ["", "Command: `" + " ".join(["benchmarks/bench.py", *sys.argv[1:]]) + "`", ""]
    return "\n".join(lines)


def plot(path: Path, workload: str, rounds: list[dict[str, dict[str, Any]]],
         modes: list[str]) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("note: matplotlib is not installed (the bench extra): no plot", file=sys.stderr)
        return
    base = "ddp" if "ddp" in modes else modes[0]
    ratios = [[rd[m]["ms"] / rd[base]["ms"] for rd in rounds] for m in modes]
    mem = [max(rounds[0][m]["subset_bytes"], 0) / 1e6 for m in modes]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    left.bar(modes, [statistics.median(r) for r in ratios],
             yerr=[[statistics.median(r) - min(r) for r in ratios],
                   [max(r) - statistics.median(r) for r in ratios]], capsize=4)
    left.axhline(1.0, color="grey", lw=0.8)
    left.set_ylabel(f"step time / {base} (same round)")
    right.bar(modes, mem)
    for i, m in enumerate(modes):
        if rounds[0][m]["subset_bytes"] < 0:  # not separable (DeepSpeed's flat buffer)
            right.text(i, 0, "n/a", ha="center", va="bottom")
    right.set_ylabel("subset grad + state + master per rank (MB)")
    for ax in (left, right):
        ax.tick_params(axis="x", rotation=30)
    fig.suptitle(f"selzero benchmark, workload {workload}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", default="a,c,d")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--bucket-mb", type=float, default=25.0)
    parser.add_argument("--before", default="",
                        help="a worktree of an earlier commit: its package runs mode selzero-before")
    parser.add_argument("--backend", default="gloo", choices=["gloo", "nccl"])
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    parser.add_argument("--replot", action="store_true",
                        help="only redraw the tables and plots from <out>/bench.json")
    args = parser.parse_args()
    if args.replot:
        saved = json.loads((Path(args.out) / "bench.json").read_text())
        for workload, rounds in saved["workloads"].items():
            modes = list(rounds[0])
            plot(Path(args.out) / f"bench-{workload}.png", workload, rounds, modes)
        return 0
    os.environ.setdefault("DS_ACCELERATOR", "cpu" if args.backend == "gloo" else "cuda")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    modes = args.modes.split(",")
    saved = out / "bench.json"  # other workloads' earlier results are kept
    everything: dict[str, Any] = json.loads(saved.read_text()) if saved.exists() else {}
    everything.setdefault("workloads", {})
    everything.setdefault("args_by_workload", {})
    everything.pop("args", None)
    for workload in args.workloads.split(","):
        spec = WORKLOADS[workload]
        rounds = []
        here = [m for m in modes if not (m == "selzero-uneven" and spec["kind"] == "qwen3")]
        for r in range(args.rounds):  # (Qwen3's own router decides its routing)
            rounds.append({mode: run_mode(mode, spec, args) for mode in here})
            print(f"workload {workload} round {r + 1}/{args.rounds}: " + ", ".join(
                f"{m} {rounds[-1][m]['ms']:.0f} ms" for m in here), file=sys.stderr)
        text = table(workload, rounds, here, args)
        print(text)
        (out / f"bench-{workload}.md").write_text(text)
        plot(out / f"bench-{workload}.png", workload, rounds, here)
        everything["workloads"][workload] = rounds
        everything["args_by_workload"][workload] = {**vars(args), "command": sys.argv[1:]}
        saved.write_text(json.dumps(everything, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
