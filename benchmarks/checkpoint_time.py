"""Checkpoint save and load time and bytes: selzero beside DDP, stock DeepSpeed ZeRO-2, and
DeepSpeed with the ``"selected_zero2"`` entry, on the same model (workload a of bench.py).

Run: ``.venv/bin/python benchmarks/checkpoint_time.py [--rounds 3] [--workload a]``

Per mode, in fresh processes, interleaved by round: one training step (so optimizer state
exists), then the save timed on every rank (the slowest rank counts), the bytes written (the
whole checkpoint folder), then a load into the same engine timed the same way. selzero + DDP
saves only selzero's part (``checkpoint.host.save_into``: shards + manifests + index); the
dense parameters and their optimizer are the host's (torch.save of their state dicts here, as
a plain DDP script would). ``dcp`` saves the same state with
``torch.distributed.checkpoint.save`` / ``load``: selzero's shards as they are (each virtual
parameter's value and moments a ``DTensor`` sharded on dim 0 over the ranks, whose chunks are
selzero's; the step counts replicated), beside the same host file; its load ends with the
all-gather that rebuilds the replicated parameters from the shards, as selzero's does. Medians
over rounds. Peak RSS growth: the peak RSS (VmHWM, reset to the current RSS just before) minus
the RSS before the operation. Each load is checked: the state, the shards and the whole
expert parameters are zeroed first and must equal what was saved afterwards.

``--reshard-to M`` adds the change of world size, N -> M: the same trained state saved at N
ranks, then, as a fresh process resuming, for ``selzero`` the offline ``selzero reshard`` (one
process, as the CLI runs it: ``relayout.reshard_root``) and a load at M ranks into an instance
without state (the load makes it), for ``dcp`` DCP's own load at M ranks (it reshards at load
time: each rank reads the pieces of the saved shards its new DTensor shards cover) into state
of the right shapes made first, within the timed window. Each loaded rank checks every segment, moment and step count against the full state
of the saved checkpoint (read with selzero's offline reader, sliced at this rank's chunks).
Reported: reshard seconds and peak RSS growth (its process), load seconds at M (slowest
rank) and peak RSS growth, and the ratio of selzero's reshard + load to DCP's load.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
from bench import (WORKLOADS, _batch, _loss, build_model, deepspeed_engine,  # noqa: E402
                   is_expert)

MODES = ["selzero", "dcp", "deepspeed", "deepspeed-sz"]


def _folder_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def _reset_peak_rss() -> int:
    """Reset the peak RSS (VmHWM) to the current RSS; returns it in bytes. Without the reset
    the process's earlier peak (training, the save) would hide what an operation adds."""
    Path("/proc/self/clear_refs").write_text("5")
    return _status_kib("VmRSS") * 1024


def _peak_rss() -> int:
    return _status_kib("VmHWM") * 1024


def _dcp_state(sz: Any, world: int) -> dict[str, Any]:
    """selzero's state as DCP holds sharded state: per virtual parameter, its value and
    moments as DTensors sharded on dim 0 (DTensor's uneven chunks are selzero's:
    ceil(numel / N) per rank, the last ones shorter or empty), the step count replicated.
    The local tensors are the live segments and state, so a load writes into them."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = init_device_mesh("cpu", (world,))
    slot_of = {slot.virtual: i for i, slot in enumerate(sz.slots)}
    state: dict[str, Any] = {}
    for v in sz.layout.virtuals:
        name = sz.virtual_name(v.index)
        i = slot_of.get(v.index)
        seg = sz.segments[i] if i is not None else None
        held = sz.optimizer.state.get(seg, {}) if seg is not None else {}
        for key in ("value", "exp_avg", "exp_avg_sq"):
            if seg is None:
                local = torch.empty(0)
            else:
                local = (seg.data if key == "value" else held[key]).view(-1)
            state[f"{name}/{key}"] = DTensor.from_local(local, mesh, [Shard(0)], run_check=False,
                                                       shape=(v.numel,), stride=(1,))
        if "step" in held:
            state[f"{name}/step"] = held["step"]
    return state


def _live_tensors(sz: Any) -> list[Any]:
    """selzero's segments (values) and their optimizer state tensors, moments and steps."""
    out = []
    for seg in sz.segments:
        out.append(seg.data)
        held = sz.optimizer.state.get(seg, {})
        out += [held[k] for k in sorted(held) if hasattr(held[k], "zero_")]
    return out


def _worker(rank: int, world: int, mode: str, spec: dict[str, Any], work: str, out: str) -> None:
    import torch
    import torch.distributed as dist

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    os.environ.update({"LOCAL_RANK": str(rank), "RANK": str(rank), "WORLD_SIZE": str(world),
                       "MASTER_ADDR": "127.0.0.1", "DS_ACCELERATOR": "cpu",
                       "MASTER_PORT": str(29500 + os.getpid() % 400)})
    dist.init_process_group("gloo", init_method=f"file://{work}/init", rank=rank,
                            world_size=world)
    model = build_model(spec)
    batch = _batch(spec, rank, mode, "cpu")
    kwargs = {"lr": 1e-4, "weight_decay": 0.1}
    folder = Path(work) / "ckpt"
    if mode in ("selzero", "dcp"):
        from selzero_plugin import SelectedZero2, wrap_ddp
        from selzero_plugin.checkpoint.host import load_from, save_into

        sz = SelectedZero2(model, {"params": ["*.experts.*"]}, torch.optim.AdamW, kwargs)
        ddp = wrap_ddp(model, sz)
        dense = [p for n, p in model.named_parameters() if not is_expert(spec, n)]
        host = torch.optim.AdamW(dense, **kwargs)
        _loss(model, spec, batch, ddp).backward()
        host.step()
        sz.step()

        def save_host() -> None:
            if rank == 0:
                torch.save({"model": {n: p for n, p in model.named_parameters()
                                      if not is_expert(spec, n)},
                            "optimizer": host.state_dict()}, folder / "host.pt")

        def load_host() -> None:
            state = torch.load(folder / "host.pt", weights_only=True)
            host.load_state_dict(state["optimizer"])

        if mode == "selzero":
            def save() -> None:
                save_into(folder, [sz])
                save_host()

            def load() -> None:
                load_host()
                load_from(folder, [sz])
        else:
            import torch.distributed.checkpoint as dcp

            state = _dcp_state(sz, world)

            def save() -> None:
                folder.mkdir(parents=True, exist_ok=True)
                dcp.save(state, checkpoint_id=str(folder / "dcp"))
                save_host()

            def load() -> None:
                load_host()
                dcp.load(state, checkpoint_id=str(folder / "dcp"))
                # DCP fills this rank's shards; the replicated parameters are rebuilt from
                # them as selzero's load does (its one all-gather)
                sz.collectives.all_gather_updated([True] * len(sz.layout.virtuals))
    else:
        engine = deepspeed_engine(model, kwargs, {"params": ["*.experts.*"]}
                                  if mode == "deepspeed-sz" else None)
        engine.backward(_loss(engine.module, spec, batch, engine))
        engine.step()

        def save() -> None:
            engine.save_checkpoint(str(folder), tag="t")

        def load() -> None:
            engine.load_checkpoint(str(folder), tag="t")

    experts = [p.data for n, p in model.named_parameters() if is_expert(spec, n)]
    live = _live_tensors(sz) + experts if mode in ("selzero", "dcp") else []
    saved = [t.clone() for t in live]
    times = {}
    for name, fn in (("save", save), ("load", load)):
        if name == "load":  # the load must bring back what was saved: wiped first (state,
            for t in live:  # shards and the whole replicated parameters), not timed
                t.zero_()
        dist.all_reduce(torch.zeros(1))
        before = _reset_peak_rss()
        t0 = time.perf_counter()
        fn()
        elapsed = torch.tensor([time.perf_counter() - t0, _peak_rss() - before],
                               dtype=torch.float64)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        times[name] = float(elapsed[0])
        times[f"{name}_rss"] = float(elapsed[1])
    if live:  # (the load may put new tensors in place: read them again)
        loaded = _live_tensors(sz) + experts  # the full parameters too: every rank's chunks
        assert len(loaded) == len(saved) and all(
            torch.equal(a, b) for a, b in zip(loaded, saved)), f"{mode}: the load differs"
    if rank == 0:
        Path(out).write_text(json.dumps({"mode": mode, **times,
                                         "bytes": _folder_bytes(folder)}))
    dist.destroy_process_group()


def _trained(spec: dict[str, Any], rank: int, world: int) -> tuple[Any, Any, Any]:
    """The workload's model, selzero on its experts beside DDP, after one training step."""
    import torch

    from selzero_plugin import SelectedZero2, wrap_ddp

    model = build_model(spec)
    kwargs = {"lr": 1e-4, "weight_decay": 0.1}
    sz = SelectedZero2(model, {"params": ["*.experts.*"]}, torch.optim.AdamW, kwargs)
    ddp = wrap_ddp(model, sz)
    host = torch.optim.AdamW([p for n, p in model.named_parameters() if not is_expert(spec, n)],
                             **kwargs)
    _loss(model, spec, _batch(spec, rank, "selzero", "cpu"), ddp).backward()
    host.step()
    sz.step()
    return model, sz, host


def _reshard_worker(rank: int, world: int, mode: str, phase: str, spec: dict[str, Any],
                    work: str, out: str) -> None:
    """``save`` at N ranks (the trained state; selzero also writes the truth the loads are
    checked against), or ``load`` at M ranks into a fresh instance."""
    import torch
    import torch.distributed as dist

    from selzero_plugin.checkpoint.host import load_from, save_into

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{work}/init-{phase}-{mode}", rank=rank,
                            world_size=world)
    folder = Path(work)
    result: dict[str, float] = {}
    if phase == "save":
        _model, sz, _host = _trained(spec, rank, world)
        if mode == "selzero":
            save_into(folder / "selzero", [sz])
            save_into(folder / "truth", [sz])
        else:
            import torch.distributed.checkpoint as dcp

            dcp.save(_dcp_state(sz, world), checkpoint_id=str(folder / "dcp"))
    else:
        from selzero_plugin import SelectedZero2

        model = build_model(spec)
        sz = SelectedZero2(model, {"params": ["*.experts.*"]}, torch.optim.AdamW,
                           {"lr": 1e-4, "weight_decay": 0.1})
        dist.all_reduce(torch.zeros(1))
        before = _reset_peak_rss()
        t0 = time.perf_counter()
        if mode == "selzero":  # a fresh process resuming: the load makes the state
            load_from(folder / "selzero-resharded", [sz])
        else:
            import torch.distributed.checkpoint as dcp

            # DCP loads into existing tensors: the state of the right shapes is made first,
            # inside the timed window (what resuming a fresh process takes with DCP)
            for seg in sz.segments:
                sz.optimizer.state[seg] = {"step": torch.tensor(0.0),
                                           "exp_avg": torch.zeros_like(seg),
                                           "exp_avg_sq": torch.zeros_like(seg)}
            dcp.load(_dcp_state(sz, world), checkpoint_id=str(folder / "dcp"))
            sz.collectives.all_gather_updated([True] * len(sz.layout.virtuals))
        elapsed = torch.tensor([time.perf_counter() - t0, _peak_rss() - before],
                               dtype=torch.float64)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        result = {"load": float(elapsed[0]), "load_rss": float(elapsed[1])}
        _check_against_truth(sz, folder / "truth" / "selected_zero2" / "selected_zero2", mode)
    if rank == 0:
        Path(out).write_text(json.dumps(result))
    dist.destroy_process_group()


def _check_against_truth(sz: Any, truth: Path, mode: str) -> None:
    """Every segment, moment and step count equals the saved full state at this rank's chunk."""
    import torch

    from selzero_plugin.checkpoint.tools import iter_full_state, open_checkpoint

    folder, manifest = open_checkpoint(truth)
    full = {(v.key, what): t for v, what, t in iter_full_state(folder, manifest)}
    for slot, seg in zip(sz.slots, sz.segments):
        v = sz.layout.virtuals[slot.virtual]
        name = sz.virtual_name(slot.virtual)
        start = v.chunk_start(sz.rank) - v.flat_offset
        piece = slice(start, start + slot.numel)
        state = sz.optimizer.state[seg]
        for what, mine in (("value", seg.detach()), ("exp_avg", state["exp_avg"]),
                           ("exp_avg_sq", state["exp_avg_sq"])):
            expected = full[name, what].reshape(-1)[piece]
            assert torch.equal(mine.reshape(-1), expected), f"{mode}: {name} {what} differs"
        assert float(state["step"]) == float(full[name, "step"]), f"{mode}: {name} step"


def _timed_reshard(_index: int, work: str, world: int, out: str) -> None:
    """The offline ``selzero reshard`` in a process of its own: seconds, peak RSS growth."""
    from selzero_plugin.checkpoint.relayout import find_root, reshard_root

    found = find_root(Path(work) / "selzero")
    assert found is not None
    before = _reset_peak_rss()
    t0 = time.perf_counter()
    reshard_root(found[0], world, None, Path(work) / "selzero-resharded" / "selected_zero2")
    Path(out).write_text(json.dumps({"reshard": time.perf_counter() - t0,
                                     "reshard_rss": _peak_rss() - before}))


def reshard_rounds(args: argparse.Namespace, spec: dict[str, Any]) -> str:
    """N -> M for selzero (offline reshard + load) and DCP (load-time resharding), interleaved
    by round in fresh processes."""
    import torch.multiprocessing as mp

    n, m = args.world, args.reshard_to
    rounds = []
    for r in range(args.rounds):
        row: dict[str, dict[str, float]] = {}
        for mode in ("selzero", "dcp"):
            with tempfile.TemporaryDirectory() as work:
                out = os.path.join(work, "result.json")
                mp.start_processes(_reshard_worker, nprocs=n, start_method="spawn",
                                   args=(n, "selzero" if mode == "selzero" else "dcp", "save",
                                         spec, work, out))
                if mode == "dcp":  # the truth the loads are checked against
                    mp.start_processes(_reshard_worker, nprocs=n, start_method="spawn",
                                       args=(n, "selzero", "save", spec, work, out))
                row[mode] = {}
                if mode == "selzero":
                    mp.start_processes(_timed_reshard, nprocs=1, start_method="spawn",
                                       args=(work, m, out))
                    row[mode].update(json.loads(Path(out).read_text()))
                mp.start_processes(_reshard_worker, nprocs=m, start_method="spawn",
                                   args=(m, mode, "load", spec, work, out))
                row[mode].update(json.loads(Path(out).read_text()))
        rounds.append(row)
        print(f"round {r + 1}/{args.rounds}: selzero reshard {row['selzero']['reshard']:.2f} s "
              f"+ load {row['selzero']['load']:.2f} s, dcp load {row['dcp']['load']:.2f} s",
              file=sys.stderr)
    med = lambda mode, key: statistics.median(rd[mode][key] for rd in rounds)  # noqa: E731
    ratio = statistics.median((rd["selzero"]["reshard"] + rd["selzero"]["load"])
                              / rd["dcp"]["load"] for rd in rounds)
    mib = 2 ** 20
    return "\n".join([
        f"### Change of world size {n} -> {m}, workload {args.workload}, median over "
        f"{args.rounds} rounds", "",
        "| mode | reshard s (offline, 1 process) | reshard peak RSS growth (MiB) | load at "
        f"{m} s (slowest rank) | load peak RSS growth (MiB) | total s | total vs dcp |",
        "|---|---|---|---|---|---|---|",
        f"| selzero | {med('selzero', 'reshard'):.2f} | {med('selzero', 'reshard_rss') / mib:.1f}"
        f" | {med('selzero', 'load'):.2f} | {med('selzero', 'load_rss') / mib:.1f} | "
        f"{med('selzero', 'reshard') + med('selzero', 'load'):.2f} | {ratio:.2f} |",
        f"| dcp | n/a (at load) | n/a | {med('dcp', 'load'):.2f} | "
        f"{med('dcp', 'load_rss') / mib:.1f} | {med('dcp', 'load'):.2f} | 1.00 |", "",
        "Every load checked against the saved full state (values, moments, steps).", ""])


def main() -> int:
    import torch.multiprocessing as mp

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--workload", default="a")
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--reshard-to", type=int, default=0,
                        help="also measure the change of world size N -> M (0: skip)")
    args = parser.parse_args()
    modes = args.modes.split(",")
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    spec = WORKLOADS[args.workload]
    rounds = []
    for r in range(args.rounds):
        row = {}
        for mode in modes:
            with tempfile.TemporaryDirectory() as work:
                out = os.path.join(work, "result.json")
                mp.start_processes(_worker, nprocs=args.world, start_method="spawn",
                                   args=(args.world, mode, spec, work, out))
                row[mode] = json.loads(Path(out).read_text())
        rounds.append(row)
        print(f"round {r + 1}/{args.rounds}: " + ", ".join(
            f"{m} save {row[m]['save']:.2f} s load {row[m]['load']:.2f} s" for m in modes),
            file=sys.stderr)
    lines = [f"### Checkpoint save / load, workload {args.workload}, {args.world} gloo ranks, "
             f"median over {args.rounds} rounds (slowest rank)", "",
             "| mode | save s | load s | bytes on disk | save vs dcp | load vs dcp | "
             "save vs deepspeed | peak RSS growth save / load (MiB) |",
             "|---|---|---|---|---|---|---|---|"]
    for mode in modes:
        save = statistics.median(rd[mode]["save"] for rd in rounds)
        load = statistics.median(rd[mode]["load"] for rd in rounds)
        ratio = {(op, peer): f"{statistics.median(rd[mode][op] / rd[peer][op] for rd in rounds):.2f}"
                 if peer in modes else "n/a" for op in ("save", "load") for peer in ("dcp", "deepspeed")}
        rss = [statistics.median(rd[mode][f"{op}_rss"] for rd in rounds) / 2 ** 20
               for op in ("save", "load")]
        lines.append(f"| {mode} | {save:.2f} | {load:.2f} | "
                     f"{rounds[0][mode]['bytes'] / 1e6:.1f} MB | {ratio['save', 'dcp']} | "
                     f"{ratio['load', 'dcp']} | {ratio['save', 'deepspeed']} | "
                     f"{rss[0]:.1f} / {rss[1]:.1f} |")
    lines += ["", "Command: `" + " ".join(["benchmarks/checkpoint_time.py", *sys.argv[1:]]) + "`",
              ""]
    text = "\n".join(lines)
    print(text)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    if args.reshard_to:
        text += "\n" + reshard_rounds(args, spec)
        print(text)
    (Path(args.out) / f"checkpoint-{args.workload}.md").write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
