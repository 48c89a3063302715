"""The peers on uneven MoE routing: re-measure the README's claims about FSDP2, DeepSpeed and DDP.

Run: ``.venv/bin/python benchmarks/peers.py`` (about 2 minutes on 2 idle CPU cores, once
DeepSpeed's comm extension is compiled: ~50 s on first use, cached in ~/.cache/torch_extensions
or $TORCH_EXTENSIONS_DIR). Options: ``--cases fsdp2:A,zero1:B,...`` (peer:routing pairs),
``--steps 4``, ``--timeout 120`` (seconds per case), ``--out benchmarks/results``, ``--logs DIR``
(keep each rank's output). A case that hangs costs the whole timeout; FSDP2 with routing B or
A-acc2 (its ranks then issue different numbers of collectives) is such a case, so it is not in
the default cases.

A toy MoE (a dense input layer, 4 equal-shaped experts Linear(8, 16) -> GELU -> Linear(16, 8),
a dense output layer) on 2 gloo ranks; routing is fixed by the data:

  A       rank 0 sends its tokens to experts {0, 1}, rank 1 to {1, 2}; expert 3 gets none.
  B       rank 0 to {0}, rank 1 to {1, 2}: the ranks also differ in how many experts ran.
  same    both ranks to every expert {0, 1, 2, 3}.
  A-acc2  A over 2 micro-batches per step (gradient accumulation): rank 0 to {0} then {1},
          rank 1 to {1, 2} then {2}; per step the same experts as A.

Each case (peer:routing) runs 2 ranks in fresh processes (spawn, a gloo init file) under a hard
timeout, and is compared with ONE process running plain torch AdamW (lr 1e-2, weight decay 0.1)
on the mean of both ranks' losses (and of the micro-batches) for the same steps. Peers:
``fsdp2`` (``fully_shard`` on each expert and on the root, ``reshard_after_forward=False``);
``zero0/1/2`` stock DeepSpeed with every parameter given to it (AdamW, ``torch_adam``); ``ddp``
(``find_unused_parameters=True``, which DDP needs when experts go unused); ``selzero`` (the
experts under selzero, the rest under DDP; ``end_microstep()`` between micro-batches). Per case:

- outcome: ok / silently wrong (no error, but a difference above 1e-5) / error: the first line
  of the error that a rank raised, or printed when it aborted (not the peers' "Connection reset
  by peer" that follows) / hang (neither finished nor failed within the timeout);
- max |param - reference| over the routed parameters (every parameter but the never-routed
  expert's);
- |drift| of the never-routed expert from its initial value (the reference leaves it untouched:
  it never gets a gradient);
- the gradient norm the peer reports vs the reference's (DeepSpeed: ``get_global_grad_norm()``;
  selzero: what ``selzero_plugin.clip_grad_norm_`` returns; DDP and FSDP2 report none, so the
  norm of the gradients they hold before the step is computed here), at step 1 (same parameters
  on both sides) and the worst step.

Output: the table on stdout and in ``<out>/peers.md`` with the command that made it.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import shutil
import sys
import tempfile
import time
import traceback
import warnings
from pathlib import Path
from typing import Any

D, H, EXPERTS, TOKENS, LR, WD = 8, 16, 4, 8, 1e-2, 0.1
TOL = 1e-5
# routing -> per rank, per micro-batch of a step: the experts that rank's tokens go to
ROUTINGS: dict[str, tuple[tuple[tuple[int, ...], ...], ...]] = {
    "A": (((0, 1),), ((1, 2),)),
    "B": (((0,),), ((1, 2),)),
    "same": (((0, 1, 2, 3),), ((0, 1, 2, 3),)),
    "A-acc2": (((0,), (1,)), ((1, 2), (2,))),
}
PEERS = ["fsdp2", "zero0", "zero1", "zero2", "ddp", "selzero"]
DEFAULT_CASES = ["fsdp2:A", "fsdp2:same", "zero1:A", "zero1:B", "zero1:A-acc2", "zero1:same",
                 "zero2:A", "zero2:A-acc2", "zero2:same", "zero0:A", "ddp:A", "selzero:A"]
GRACE_S = 10.0  # after a rank fails, how long its peers get to fail too before they are killed


# ---- model, data, reference ------------------------------------------------------------------


def build_model() -> Any:
    import torch
    from torch import nn

    class Expert(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w1, self.w2 = nn.Linear(D, H), nn.Linear(H, D)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.w2(nn.functional.gelu(self.w1(x)))

    class ToyMoE(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inp = nn.Linear(D, D)
            self.experts = nn.ModuleList(Expert() for _ in range(EXPERTS))
            self.out = nn.Linear(D, D)

        def forward(self, x: torch.Tensor, routes: torch.Tensor) -> torch.Tensor:
            h = torch.tanh(self.inp(x))
            y = torch.zeros_like(h)
            for e, expert in enumerate(self.experts):
                idx = (routes == e).nonzero().flatten()
                if idx.numel():
                    y = y.index_add(0, idx, expert(h[idx]))
            return self.out(h + y)

    torch.manual_seed(0)
    return ToyMoE()


def micro_batches(routing: str) -> int:
    return len(ROUTINGS[routing][0])


def batch(step: int, micro: int, rank: int, routing: str) -> tuple[Any, Any, Any]:
    import torch

    g = torch.Generator().manual_seed(1000 * (step * micro_batches(routing) + micro) + rank)
    x, y = torch.randn(TOKENS, D, generator=g), torch.randn(TOKENS, D, generator=g)
    experts = ROUTINGS[routing][rank][micro]
    routes = torch.tensor([experts[i % len(experts)] for i in range(TOKENS)])
    return x, routes, y


def loss_of(forward: Any, step: int, micro: int, rank: int, routing: str, *,
            divide: bool = True) -> Any:
    """The loss of one micro-batch on one rank, divided by the micro-batches per step."""
    x, routes, y = batch(step, micro, rank, routing)
    loss = (forward(x, routes) - y).pow(2).mean()
    return loss / micro_batches(routing) if divide else loss


def unrouted(routing: str) -> list[int]:
    used = {e for per_rank in ROUTINGS[routing] for experts in per_rank for e in experts}
    return [e for e in range(EXPERTS) if e not in used]


def is_unrouted(name: str, routing: str) -> bool:
    return any(name.startswith(f"experts.{e}.") for e in unrouted(routing))


def grad_norm(grads: list[Any]) -> float:
    import torch

    return math.sqrt(float(torch.stack([g.float().pow(2).sum() for g in grads]).sum()))


def reference(routing: str, steps: int) -> tuple[dict[str, Any], dict[str, Any], list[float]]:
    """One process, plain torch AdamW on the mean of both ranks' losses: (initial, final, norms)."""
    import torch

    model = build_model()
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    norms = []
    for step in range(steps):
        (sum(loss_of(model, step, m, r, routing) for r in range(2)
             for m in range(micro_batches(routing))) / 2).backward()
        norms.append(grad_norm([p.grad for p in model.parameters() if p.grad is not None]))
        opt.step()
        opt.zero_grad(set_to_none=True)
    return initial, {n: p.detach().clone() for n, p in model.named_parameters()}, norms


# ---- the peers, one rank each ----------------------------------------------------------------


def run_fsdp2(rank: int, routing: str, steps: int) -> tuple[dict[str, Any], list[float]]:
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    model = build_model()
    for expert in model.experts:
        fully_shard(expert, reshard_after_forward=False)
    fully_shard(model, reshard_after_forward=False)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    norms = []
    for step in range(steps):
        for micro in range(micro_batches(routing)):
            loss_of(model, step, micro, rank, routing).backward()
        # each local shard once, summed over ranks in ONE all-reduce (a per-tensor DTensor norm
        # would itself issue rank-dependent collectives here)
        local = [p.grad.to_local() for p in model.parameters() if p.grad is not None]
        sq = torch.stack([g.pow(2).sum() for g in local]).sum().reshape(1) if local \
            else torch.zeros(1)
        dist.all_reduce(sq)
        norms.append(math.sqrt(float(sq)))
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}, norms


def run_deepspeed(rank: int, routing: str, steps: int, stage: int
                  ) -> tuple[dict[str, Any], list[float | None]]:
    import logging

    import deepspeed

    logging.getLogger("DeepSpeed").setLevel(logging.ERROR)
    config = {"train_micro_batch_size_per_gpu": TOKENS,
              "gradient_accumulation_steps": micro_batches(routing),
              "zero_optimization": {"stage": stage},
              "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WD,
                                                        "torch_adam": True}},
              "steps_per_print": 10 ** 9, "wall_clock_breakdown": False}
    engine = deepspeed.initialize(model=build_model(), config=config)[0]
    norms: list[float | None] = []
    for step in range(steps):
        for micro in range(micro_batches(routing)):  # DeepSpeed divides by its GAS itself
            engine.backward(loss_of(engine, step, micro, rank, routing, divide=False))
            engine.step()
        norm = engine.get_global_grad_norm()  # stage 0 without clipping: None
        norms.append(None if norm is None else float(norm))
    return {n: p.detach().float().clone() for n, p in engine.module.named_parameters()}, norms


def run_ddp(rank: int, routing: str, steps: int) -> tuple[dict[str, Any], list[float]]:
    import torch
    from torch import nn

    model = build_model()
    ddp = nn.parallel.DistributedDataParallel(model, find_unused_parameters=True)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    norms = []
    for step in range(steps):
        for micro in range(micro_batches(routing)):
            loss_of(ddp, step, micro, rank, routing).backward()
        norms.append(grad_norm([p.grad for p in model.parameters() if p.grad is not None]))
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {n: p.detach().clone() for n, p in model.named_parameters()}, norms


def run_selzero(rank: int, routing: str, steps: int) -> tuple[dict[str, Any], list[float]]:
    import torch

    from selzero_plugin import SelectedZero2, clip_grad_norm_, wrap_ddp

    model = build_model()
    sz = SelectedZero2(model, {"params": ["experts.*"]}, torch.optim.AdamW,
                       {"lr": LR, "weight_decay": WD})
    ddp = wrap_ddp(model, sz)
    selected = {id(e.param) for e in sz.entries}
    host_params = [p for p in model.parameters() if id(p) not in selected]
    host = torch.optim.AdamW(host_params, lr=LR, weight_decay=WD)
    norms = []
    for step in range(steps):
        for micro in range(micro_batches(routing)):
            if micro:
                sz.end_microstep()  # between backward passes of one step
            loss_of(ddp, step, micro, rank, routing).backward()
        norms.append(float(clip_grad_norm_(host_params, math.inf, subsets=[sz])))
        host.step()
        sz.step()
        host.zero_grad(set_to_none=True)
    return {n: p.detach().clone() for n, p in model.named_parameters()}, norms


def _rank_main(rank: int, peer: str, routing: str, steps: int, tmp: str) -> None:
    """One rank of one case: its output goes to a log file, its result to ``rank<r>.pt``."""
    log = os.open(os.path.join(tmp, f"rank{rank}.log"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(log, 1)
    os.dup2(log, 2)
    warnings.filterwarnings("ignore")
    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2",
                       "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"})
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{os.path.join(tmp, 'init')}",
                            rank=rank, world_size=2)
    out = os.path.join(tmp, f"rank{rank}.pt")
    try:
        if peer.startswith("zero"):
            params, norms = run_deepspeed(rank, routing, steps, int(peer[-1]))
        else:
            params, norms = {"fsdp2": run_fsdp2, "ddp": run_ddp,
                             "selzero": run_selzero}[peer](rank, routing, steps)
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        lines = str(e).strip().splitlines() or [""]
        _save({"error": f"{type(e).__name__}: {lines[0]}", "at": time.time()}, out)
        traceback.print_exc()
        sys.stdout.flush()
        os._exit(1)  # no teardown: a peer may be stuck in a collective
    _save({"params": params, "norms": norms, "at": time.time()}, out)
    t = torch.zeros(1)
    dist.all_reduce(t)  # a tiny all-reduce before teardown is safer than a gloo barrier
    dist.destroy_process_group()


def _save(value: dict[str, Any], path: str) -> None:
    import torch

    torch.save(value, path + ".part")
    os.replace(path + ".part", path)  # the parent never reads a half-written file


# ---- running a case --------------------------------------------------------------------------


def run_case(peer: str, routing: str, steps: int, timeout: float, logs: str | None = None
             ) -> dict[str, Any]:
    """Both ranks in fresh processes; {"params", "norms"} from rank 0, or {"error"} / {"hang"}."""
    import torch
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as tmp:
        procs = [ctx.Process(target=_rank_main, args=(r, peer, routing, steps, tmp), daemon=True)
                 for r in range(2)]
        for p in procs:
            p.start()
        deadline, failed = time.monotonic() + timeout, False
        results: dict[int, dict[str, Any]] = {}
        while time.monotonic() < deadline and len(results) < 2:
            time.sleep(0.1)
            for r, p in enumerate(procs):
                path = os.path.join(tmp, f"rank{r}.pt")
                if r in results:
                    continue
                if os.path.exists(path):  # written (atomically); it may still be tearing down
                    results[r] = torch.load(path, weights_only=False)
                elif p.exitcode is not None:  # died without a word (an abort in C++)
                    why = _abort_reason(os.path.join(tmp, f"rank{r}.log"))
                    results[r] = {"error": f"rank {r} aborted (exit code {p.exitcode}): {why}",
                                  "at": time.time()}
            if not failed and any("error" in v for v in results.values()):
                failed = True  # the others get a moment to fail too, then they are killed
                deadline = min(deadline, time.monotonic() + GRACE_S)
        for p in procs:
            p.join(timeout=10 if len(results) == 2 and not failed else 0)
            if p.is_alive():
                p.kill()
                p.join()
        if logs:
            os.makedirs(logs, exist_ok=True)
            for r in range(2):
                if os.path.exists(os.path.join(tmp, f"rank{r}.log")):
                    shutil.copy(os.path.join(tmp, f"rank{r}.log"),
                                os.path.join(logs, f"{peer}-{routing}-rank{r}.log"))
    # the cause, not its echo: a peer of a rank that aborted sees "Connection reset by peer"
    errors = sorted((_is_echo(v["error"]), v["at"], v["error"]) for v in results.values()
                    if "error" in v)
    if errors:
        return {"error": _clean(errors[0][2])}
    if len(results) < 2:
        return {"hang": True}
    return results[0]


def _abort_reason(log: str) -> str:
    """What a C++ abort printed (``terminate called ... what(): ...``), else the log's last line."""
    try:
        lines = [ln.strip() for ln in Path(log).read_text(errors="replace").splitlines()
                 if ln.strip()]
    except OSError:
        return "no output"
    for i, line in enumerate(lines):
        if line.startswith("terminate called after throwing an instance of"):
            kind = line.rsplit(" ", 1)[-1].strip("'")
            what = next((ln.split("what():", 1)[1].strip() for ln in lines[i + 1:i + 3]
                         if "what():" in ln), "")
            return f"{kind}: {what}"
    return lines[-1] if lines else "no output"


def _is_echo(message: str) -> bool:
    return any(s in message for s in ("Connection reset by peer", "Connection closed by peer",
                                      "Broken pipe"))


def _clean(message: str) -> str:
    """Drop source locations (``[enforce fail at .../pair.cc:456]``), keep 200 characters."""
    message = re.sub(r"\[(enforce fail at )?[^\]\s]*\.(cc|cpp|h):\d+\] ", "", message)
    return message[:240]


# ---- the report ------------------------------------------------------------------------------


def measure(peer: str, routing: str, result: dict[str, Any], ref: tuple[Any, Any, Any]
            ) -> dict[str, Any]:
    initial, final, ref_norms = ref
    row: dict[str, Any] = {"case": f"{peer}:{routing}", "peer": peer, "routing": routing}
    if "hang" in result:
        return {**row, "outcome": "hang"}
    if "error" in result:
        return {**row, "outcome": "error: " + result["error"]}
    params = result["params"]
    routed = max(float((params[n] - final[n]).abs().max()) for n in final
                 if not is_unrouted(n, routing))
    drift = [(params[n] - initial[n]).abs().max() for n in initial if is_unrouted(n, routing)]
    row.update(routed=routed, drift=float(max(drift)) if drift else None,
               identical=all(float(d) == 0.0 for d in drift))
    norms = result["norms"]
    if all(v is not None for v in norms):
        ratios = [v / r for v, r in zip(norms, ref_norms)]
        row.update(norm_step1=ratios[0], norm_worst=max(ratios, key=lambda q: abs(q - 1)))
    wrong = routed > TOL or (row["drift"] or 0.0) > TOL
    row["outcome"] = "silently wrong" if wrong else "ok"
    return row


def _pct(ratio: float) -> str:
    percent = 100 * (ratio - 1)
    return "0.00%" if abs(percent) < 0.005 else f"{percent:+.2f}%"


def table(rows: list[dict[str, Any]], args: argparse.Namespace, wall: float, load: float
          ) -> str:
    import torch

    try:
        import deepspeed
        ds = deepspeed.__version__
    except Exception:  # noqa: BLE001 - optional
        ds = "not installed"
    decay = 1 - (1 - LR * WD) ** args.steps
    decay_drift = max(float(p.detach().abs().max()) * decay
                      for n, p in build_model().named_parameters()
                      if n.startswith(f"experts.{EXPERTS - 1}."))
    lines = [
        "### The peers on uneven MoE routing",
        "",
        "Command: `" + " ".join(["benchmarks/peers.py", *sys.argv[1:]]) + "`",
        "",
        f"torch {torch.__version__}, DeepSpeed {ds}, 2 ranks on gloo (CPU), {args.steps} steps, "
        f"AdamW lr {LR}, weight decay {WD}; toy MoE: dense Linear({D}, {D}), {EXPERTS} experts "
        f"Linear({D}, {H}) -> GELU -> Linear({H}, {D}), dense Linear({D}, {D}); {TOKENS} tokens "
        "per rank. Reference: one process, plain torch AdamW on the mean of both ranks' losses "
        "(and micro-batches). Routing A: rank 0 -> experts {0, 1}, rank 1 -> {1, 2}, expert 3 "
        "-> none; B: rank 0 -> {0}, rank 1 -> {1, 2}, expert 3 -> none; same: both ranks -> "
        "{0, 1, 2, 3}; A-acc2: 2 micro-batches per step (DeepSpeed gradient_accumulation_steps "
        "2), rank 0 -> {0} then {1}, rank 1 -> {1, 2} then {2}, expert 3 -> none. Every case "
        "runs 2 fresh processes under a hard timeout. "
        f"Outcome \"silently wrong\": no error, but a difference above {TOL:g}. Grad norm: the "
        "peer's reported norm / the reference's at step 1 (same parameters on both sides) and "
        "at the worst step (DeepSpeed: get_global_grad_norm(), None at ZeRO-0 without "
        "clipping; selzero: clip_grad_norm_'s return; DDP, FSDP2: the norm of the gradients "
        "they hold, computed here). Weight decay alone would move expert 3 by at most "
        f"{decay_drift:.2e} in {args.steps} steps.",
        "",
        "| case | outcome | max abs diff, routed params | drift of never-routed expert | "
        "grad norm vs ref, step 1 | worst step |",
        "|---|---|---|---|---|---|",
    ]
    for row in rows:
        if "routed" not in row:
            lines.append(f"| {row['case']} | {row['outcome']} | n/a | n/a | n/a | n/a |")
            continue
        drift = "n/a (every expert routed)" if row["drift"] is None else (
            "0 (bit-identical)" if row["identical"] else f"{row['drift']:.2e}")
        norm1 = _pct(row["norm_step1"]) if "norm_step1" in row else "not reported"
        worst = _pct(row["norm_worst"]) if "norm_worst" in row else "not reported"
        lines.append(f"| {row['case']} | {row['outcome']} | {row['routed']:.2e} | {drift} | "
                     f"{norm1} | {worst} |")
    lines += ["", f"Wall time: {wall:.0f} s on {os.cpu_count()} CPU cores (load average "
              f"{load:.1f} at the start).", ""]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default=",".join(DEFAULT_CASES),
                        help=f"peer:routing pairs; peers {PEERS}, routings {list(ROUTINGS)}")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds per case")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    parser.add_argument("--logs", default=None, help="keep each rank's output in this folder")
    args = parser.parse_args()
    if args.steps < 1:
        parser.error(f"--steps must be at least 1, got {args.steps}")
    cases = [c.split(":") for c in args.cases.split(",")]
    for case in cases:
        if len(case) != 2 or case[0] not in PEERS or case[1] not in ROUTINGS:
            parser.error(f"--cases: {':'.join(case)!r} is not peer:routing with a peer in "
                         f"{PEERS} and a routing in {list(ROUTINGS)}")
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    started, load = time.monotonic(), os.getloadavg()[0]
    refs = {routing: reference(routing, args.steps) for routing in {r for _, r in cases}}
    rows = []
    for peer, routing in cases:
        t0 = time.monotonic()
        result = run_case(peer, routing, args.steps, args.timeout, args.logs)
        rows.append(measure(peer, routing, result, refs[routing]))
        print(f"{peer}:{routing}: {rows[-1]['outcome']} ({time.monotonic() - t0:.1f} s)",
              file=sys.stderr, flush=True)
    text = table(rows, args, time.monotonic() - started, load)
    print(text)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "peers.md").write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
