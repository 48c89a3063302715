"""The cost of scale, simulated: selzero built at world 8..256 in one process with torch's fake
process group (``backend="fake"``: every collective returns at once, nothing is sent).

The model is a Qwen3-30B-A3B-shaped MoE stack (48 layers of 128 fused experts, top-8 routing)
at reduced width (``--width``: hidden 2048/W, moe_intermediate 768/W), built by transformers
from a config; selzero takes the experts (``*.mlp.experts.*``, ``expert_dim: 0``). For each world
size N the process plays one rank (rank 0, the one that writes the manifest; ``--rank``) and
measures:

- construction: seconds of ``SelectedZero2(...)`` and of ``plan_memory`` (``selzero plan``);
- per-rank bytes: ``memory_report()`` after one step beside ``plan_memory``'s figure for this
  rank and the ideal (the subset's sharded bytes / N);
- layout: buckets, rows, padding (buffer elements beyond the subset's, summed over buckets);
- the reduction point's agreement vector (int64 elements: O(N) per-rank codes plus the
  entries, launch units and virtual parameters);
- the step path's host time: the backward of a synthetic loss ``sum(p * g)`` over the experts
  with selzero's hooks (gradient copy into buckets, presence) minus the same backward without
  selzero, and ``step()`` (reduction point, segment optimizer on this rank's 1/N, gather row,
  copy-out), median over ``--steps``;
- the checkpoint: manifest bytes and this rank's shard bytes from ``save_checkpoint``.

With the fake group every peer is absent, so the reduction point would see N-1 ranks that made
no call. The simulation mirrors this rank to its peers: after the agreement's all-reduce, the
per-rank fields take this rank's code at every rank and the summed fields N times its value
(every peer routed the same tokens). Nothing else is changed; the values the fake collectives
leave in the buckets and gather rows are whatever was there (the figures are host time, not
results).

    benchmarks/scale.py [--worlds 8,64,256] [--layers 48] [--width 32] [--steps 5]
        [--partition chunks|tensors|chunks,tensors]
        [--out benchmarks/results/scale.json] [--md benchmarks/results/scale.md]
        [--png benchmarks/results/scale.png]
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

EXPERTS, TOP_K = 128, 8


def build_model(layers: int, width: int) -> Any:
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(
        vocab_size=512, hidden_size=2048 // width, intermediate_size=6144 // width,
        moe_intermediate_size=768 // width, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, head_dim=max(8, 2048 // width // 4), num_experts=EXPERTS,
        num_experts_per_tok=TOP_K, decoder_sparse_step=1, max_position_embeddings=256,
        tie_word_embeddings=False)
    torch.manual_seed(0)
    return Qwen3MoeForCausalLM(config)


class _Done:
    """A finished collective (the fake backend sends nothing either way)."""

    def wait(self, *args: Any) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


def fake_uneven_rows() -> None:
    """The fake backend checks that the pieces of an all_gather / reduce_scatter have equal
    sizes, which whole-tensor ownership's uneven rows do not (at N=256 on this model): such a
    collective returns at once here, as the fake one would."""
    import torch.distributed as dist

    if getattr(dist.all_gather, "_uneven", False):
        return
    gather, scatter = dist.all_gather, dist.reduce_scatter

    def all_gather(tensor_list: Any, tensor: Any, group: Any = None, async_op: bool = False
                   ) -> Any:
        if len({t.numel() for t in tensor_list}) > 1:
            return _Done() if async_op else None
        return gather(tensor_list, tensor, group=group, async_op=async_op)

    def reduce_scatter(output: Any, input_list: Any, op: Any = None, group: Any = None,
                       async_op: bool = False) -> Any:
        if len({t.numel() for t in input_list}) > 1:
            return _Done() if async_op else None
        return scatter(output, input_list, op=op or dist.ReduceOp.SUM, group=group,
                       async_op=async_op)

    all_gather._uneven = True  # type: ignore[attr-defined]
    dist.all_gather, dist.reduce_scatter = all_gather, reduce_scatter


def mirror_peers() -> None:
    """Every peer made this rank's call ([Note: the module docstring])."""
    from selzero_plugin.core.window import ReductionWindow

    original = ReductionWindow._agree
    if getattr(original, "_mirrored", False):
        return

    def agree(self: Any, *args: Any, **kwargs: Any) -> list[int]:
        values = original(self, *args, **kwargs)
        c, rank, n = self.control, self.comm.rank, self.comm.size
        for field in (c.signature, c.second_backward, c.dropped, c.opened):
            values[field] = [values[field.start + rank]] * n
        for field in (c.active, c.weight, c.late, c.passed, c.presence, c.binding, c.unfrozen):
            values[field] = [v * n for v in values[field]]
        return values

    agree._mirrored = True  # type: ignore[attr-defined]
    ReductionWindow._agree = agree


def one_world(world: int, rank: int, layers: int, width: int, steps: int,
              partition: str = "chunks") -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from selzero_plugin import SelectedZero2, SelZeroConfig
    from selzero_plugin.plan import plan_memory

    dist.init_process_group("fake", rank=rank, world_size=world, store=FakeStore())
    try:
        model = build_model(layers, width)
        config = {"params": ["*.mlp.experts.*"], "expert_dim": 0, "partition": partition}
        kwargs = {"lr": 1e-4, "weight_decay": 0.1}
        experts = [p for n, p in model.named_parameters() if ".mlp.experts." in n]
        for p in model.parameters():
            p.requires_grad_(any(p is q for q in experts))
        g = torch.Generator().manual_seed(1)
        grads = [torch.randn(p.shape, generator=g) for p in experts]

        def synthetic() -> Any:
            return sum((p * w).sum() for p, w in zip(experts, grads))

        plain = []  # the same backward without selzero's hooks
        for _ in range(steps):
            started = time.perf_counter()
            synthetic().backward()
            plain.append(time.perf_counter() - started)
            for p in experts:
                p.grad = None

        started = time.perf_counter()
        planned = plan_memory(model, config, world, torch.optim.AdamW, kwargs)
        plan_s = time.perf_counter() - started
        started = time.perf_counter()
        sz = SelectedZero2(model, SelZeroConfig.from_dict(config), torch.optim.AdamW, kwargs)
        build_s = time.perf_counter() - started

        backward, step = [], []
        for _ in range(steps + 1):  # the first step creates the optimizer state: not timed
            started = time.perf_counter()
            synthetic().backward()
            backward.append(time.perf_counter() - started)
            started = time.perf_counter()
            result = sz.step()
            step.append(time.perf_counter() - started)
            assert result.updated > 0, result
        report = sz.memory_report()
        layout = sz.layout
        subset = sum(p.numel() for p in experts)
        buffers = sum(b.buffer_numel(world) for b in layout.buckets)
        with tempfile.TemporaryDirectory() as folder:
            started = time.perf_counter()
            sz.save_checkpoint(folder)
            save_s = time.perf_counter() - started
            files = {f: os.path.getsize(os.path.join(folder, f)) for f in os.listdir(folder)}
        manifest = sum(v for f, v in files.items() if f.endswith(".json"))
        shards = sum(v for f, v in files.items() if f.endswith(".safetensors"))
        mine = planned.ranks[rank]
        copy_in = statistics.median(backward[1:]) - statistics.median(plain)
        return {
            "world": world, "rank": rank, "partition": partition, "tensors": len(experts), "subset_elements": subset,
            "virtual_parameters": len(layout.virtuals),
            "build_s": build_s, "plan_s": plan_s,
            "report_total": report.total, "plan_total": mine.total,
            "ideal_total": planned.ideal_total,
            "report_vs_ideal": report.total / planned.ideal_total,
            "report_equals_plan": (report.grad_shard, report.optimizer_state, report.master)
            == (mine.grad_shard, mine.optimizer_state, mine.master),
            "buckets": len(layout.buckets), "buffer_elements": buffers,
            "padding_elements": buffers - subset, "padding_fraction": (buffers - subset) / subset,
            "agreement_elements": sz.window.control.size,
            "copy_in_ms": 1e3 * copy_in, "step_ms": 1e3 * statistics.median(step[1:]),
            "plain_backward_ms": 1e3 * statistics.median(plain),
            "segments": len(sz.segments), "save_s": save_s, "manifest_bytes": manifest, "shard_bytes": shards,
        }
    finally:
        dist.destroy_process_group()


def _table(rows: list[dict[str, Any]]) -> str:
    head = ("| N | partition | build s | plan s | bytes/rank | vs plan | vs ideal | buckets | "
            "padding | segments/rank | agreement (int64) | copy-in ms | step() ms | manifest | "
            "shard |")
    out = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        out.append(
            f"| {r['world']} | {r['partition']} | {r['build_s']:.2f} | {r['plan_s']:.2f} | {r['report_total']:,} | "
            f"{'equal' if r['report_equals_plan'] else 'DIFFERS'} | {r['report_vs_ideal']:.4f} | "
            f"{r['buckets']} | {r['padding_elements']:,} ({100 * r['padding_fraction']:.3f}%) | "
            f"{r['segments']:,} | "
            f"{r['agreement_elements']:,} | {r['copy_in_ms']:.1f} | {r['step_ms']:.1f} | "
            f"{r['manifest_bytes']:,} B | {r['shard_bytes']:,} B |")
    return "\n".join(out)


def _growth(rows: list[dict[str, Any]]) -> str:
    """How each figure grows from the smallest N to the largest, beside 1/N (the per-rank work)
    and N (bookkeeping per rank): a figure bounded by a*(1/N) + b*N grows by at most
    max(1/N ratio, N ratio)."""
    by_partition: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        by_partition.setdefault(r["partition"], []).append(r)
    out = ["| partition | N from -> to | 1/N ratio | N ratio | bytes/rank | build s | "
           "copy-in ms | step() ms | segments/rank | agreement | manifest | shard |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for partition, rs in by_partition.items():
        rs = sorted(rs, key=lambda r: r["world"])
        a, b = rs[0], rs[-1]
        ratio = lambda k: f"{b[k] / a[k]:.3f}x" if a[k] else "n/a"  # noqa: E731
        out.append(
            f"| {partition} | {a['world']} -> {b['world']} | {a['world'] / b['world']:.4f}x | "
            f"{b['world'] / a['world']:.0f}x | {ratio('report_total')} | {ratio('build_s')} | "
            f"{ratio('copy_in_ms')} | {ratio('step_ms')} | {ratio('segments')} | "
            f"{ratio('agreement_elements')} | {ratio('manifest_bytes')} | "
            f"{ratio('shard_bytes')} |")
    return "\n".join(out)


def plot(path: str, rows: list[dict[str, Any]]) -> None:
    """Log-log panels against N: per-rank bytes (with the ideal 1/N), host times, sizes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for partition in sorted({r["partition"] for r in rows}):
        rs = sorted((r for r in rows if r["partition"] == partition), key=lambda r: r["world"])
        n = [r["world"] for r in rs]
        mark = "o-" if partition == "chunks" else "s--"
        axes[0].plot(n, [r["report_total"] / 2 ** 20 for r in rs], mark,
                     label=f"{partition}: memory_report")
        axes[0].plot(n, [r["ideal_total"] / 2 ** 20 for r in rs], ":",
                     label=f"{partition}: ideal (subset / N)")
        for key, label in (("build_s", "build s"), ("copy_in_ms", "copy-in ms / 1000"),
                           ("step_ms", "step() ms / 1000")):
            scale = 1000.0 if key.endswith("ms") else 1.0
            axes[1].plot(n, [r[key] / scale if r[key] > 0 else float("nan") for r in rs],
                         mark, label=f"{partition}: {label}")  # (a difference: noise <= 0)
        for key, label in (("manifest_bytes", "manifest bytes"), ("shard_bytes", "shard bytes"),
                           ("agreement_elements", "agreement int64"),
                           ("segments", "segments / rank")):
            axes[2].plot(n, [r[key] for r in rs], mark, label=f"{partition}: {label}")
    titles = ("per-rank bytes (MiB)", "host time (s)", "sizes")
    for ax, title in zip(axes, titles):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("group size N (fake process group)")
        ax.set_title(title)
        ax.legend(fontsize=7)
    fig.suptitle("selzero at scale, simulated: Qwen3-30B-A3B-shaped MoE stack, experts selected")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worlds", default="8,64,256")
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--layers", type=int, default=48)
    parser.add_argument("--width", type=int, default=32)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--partition", default="chunks",
                        help="chunks, tensors, or both (comma-separated)")
    parser.add_argument("--out")
    parser.add_argument("--md")
    parser.add_argument("--png")
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    import torch

    torch.set_num_threads(1)
    mirror_peers()
    fake_uneven_rows()
    rows = []
    for partition in args.partition.split(","):
        if partition not in ("chunks", "tensors"):
            parser.error(f"--partition {partition!r}: expected chunks or tensors")
        for world in [int(w) for w in args.worlds.split(",")]:
            rows.append(one_world(world, min(args.rank, world - 1), args.layers, args.width,
                                  args.steps, partition))
            print(json.dumps(rows[-1]), flush=True)
    command = "benchmarks/scale.py " + " ".join(argv if argv is not None else sys.argv[1:])
    if args.out:
        Path(args.out).write_text(json.dumps({"command": command, "rows": rows}, indent=1))
    table = _table(rows) + "\n\nGrowth from the smallest to the largest N:\n\n" + _growth(rows)
    print(table)
    if args.md:
        Path(args.md).write_text(table + f"\n\nCommand: `{command}`\n")
    if args.png:
        plot(args.png, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
