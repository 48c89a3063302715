"""Peak memory of `selzero reshard` and `selzero consolidate` on a synthetic checkpoint.

Run:  .venv/bin/python benchmarks/checkpoint_memory.py            (>= 1 GiB of state)
Options: --params 12 --numel 8000000 --world 4 --reshard-to 3 --dir DIR --keep --json

The checkpoint: ``--params`` fp32 parameters of ``--numel`` elements each, AdamW state (value,
exp_avg, exp_avg_sq per element, plus a step), sharded over ``--world`` ranks; written by
selzero's own streaming writer, so generating it holds one tensor at a time. Each command then
runs in a fresh process under ``/usr/bin/time -v``; the figure is its "Maximum resident set
size". The baseline is the same interpreter importing torch, safetensors and selzero's
checkpoint tools and doing nothing. A tool that loads the checkpoint whole would need at least
the total state on top of the baseline; a streaming one needs about one tensor (plus the chunk
being copied and constant overhead) — see [Note: streaming tools] in
selzero_plugin/checkpoint_tools.py.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Iterator

import torch

from selzero_plugin.checkpoint.format import (CHUNKING, FORMAT, FORMAT_VERSION, Manifest,
                                              VirtualRecord, whats)
from selzero_plugin.checkpoint.tools import write_sharded
from selzero_plugin.core.optim import jsonable

_RSS = re.compile(r"Maximum resident set size \(kbytes\):\s*(\d+)")


def synthetic_manifest(params: int, numel: int, world: int) -> Manifest:
    cols = 1000 if numel % 1000 == 0 else 1
    shape = [numel // cols, cols]
    hyper = {k: v for k, v in torch.optim.AdamW([torch.zeros(1)]).param_groups[0].items()
             if k != "params"}
    state = {"exp_avg": {"kind": "elementwise", "dtype": "float32"},
             "exp_avg_sq": {"kind": "elementwise", "dtype": "float32"},
             "step": {"kind": "scalar", "dtype": "float32"}}
    names = [f"layers.{i}.experts.w" for i in range(params)]
    raw = {
        "format": FORMAT, "format_version": FORMAT_VERSION, "package_version": "benchmark",
        "name": "synthetic", "group_size": world,
        "contract": {"entries": [{"name": n, "aliases": [], "shape": shape, "dtype": "float32",
                                  "frozen": False, "experts": None} for n in names],
                     "chunking": CHUNKING},
        "virtuals": [{"key": n, "entry": n, "expert": None, "numel": numel, "group": 0,
                      "stateful": True} for n in names],
        "optimizer": {"class": "torch.optim.adamw.AdamW",
                      "param_groups": [{"hyperparameters": jsonable(hyper), "state": state}]},
        "normalization": {"reduction": "mean", "normalize_over": "group", "missing_grad": "zero",
                          "nonfinite": "error"},
        "config": {}, "shards": [],
    }
    return Manifest.from_json(raw, where="synthetic")


def synthetic_stream(manifest: Manifest) -> Iterator[tuple[VirtualRecord, str, torch.Tensor]]:
    """Random full tensors in file order, one alive at a time."""
    g = torch.Generator().manual_seed(0)
    for v in manifest.virtuals:
        for what in whats(manifest, v):
            if what == "step":
                yield v, what, torch.tensor(100.0)
            else:
                yield v, what, torch.randn(v.numel, generator=g)


def timed(cmd: list[str]) -> tuple[int, float]:
    """(peak RSS in KiB, wall seconds) of ``cmd`` run under /usr/bin/time -v."""
    start = time.perf_counter()
    proc = subprocess.run(["/usr/bin/time", "-v", *cmd], capture_output=True, text=True)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout}{proc.stderr}")
    match = _RSS.search(proc.stderr)
    assert match, proc.stderr
    return int(match.group(1)), wall


def measure(params: int, numel: int, world: int, reshard_to: int, root: Path) -> dict[str, Any]:
    src, resharded, full = root / "src", root / "resharded", root / "full.safetensors"
    manifest = synthetic_manifest(params, numel, world)
    start = time.perf_counter()
    write_sharded(src, manifest, synthetic_stream(manifest))
    generate_s = time.perf_counter() - start
    py = sys.executable
    baseline_kb, _ = timed([py, "-c", "import torch, safetensors, selzero_plugin.checkpoint.tools"])
    reshard_kb, reshard_s = timed([py, "-m", "selzero_plugin.cli", "reshard", str(src),
                                   "--world-size", str(reshard_to), "--out", str(resharded)])
    consolidate_kb, consolidate_s = timed([py, "-m", "selzero_plugin.cli", "consolidate",
                                           str(src), "--out", str(full)])
    tensor_bytes = numel * 4
    return {
        "params": params, "numel": numel, "world": world, "reshard_to": reshard_to,
        "state_bytes": sum(p.stat().st_size for p in src.glob("*.safetensors")),
        "largest_tensor_bytes": tensor_bytes, "largest_param_state_bytes": 3 * tensor_bytes,
        "generate_s": round(generate_s, 1),
        "baseline_rss_kb": baseline_kb,
        "reshard_rss_kb": reshard_kb, "reshard_s": round(reshard_s, 1),
        "consolidate_rss_kb": consolidate_kb, "consolidate_s": round(consolidate_s, 1),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=int, default=12)
    parser.add_argument("--numel", type=int, default=8_000_000)
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--reshard-to", type=int, default=3)
    parser.add_argument("--dir", default=None, help="where to write (default: a temporary folder)")
    parser.add_argument("--keep", action="store_true", help="keep the files written")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    root = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="selzero-ckpt-mem-"))
    root.mkdir(parents=True, exist_ok=True)
    try:
        result = measure(args.params, args.numel, args.world, args.reshard_to, root)
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    if args.json:
        print(json.dumps(result))
        return 0
    mib = 1 << 20
    base = result["baseline_rss_kb"] / 1024
    print(f"synthetic checkpoint: {result['params']} parameters x {result['numel']:,} elements, "
          f"AdamW, {result['world']} shards: {result['state_bytes'] / mib:,.0f} MiB of state "
          f"(one tensor {result['largest_tensor_bytes'] / mib:.1f} MiB, one parameter's state "
          f"{result['largest_param_state_bytes'] / mib:.1f} MiB)")
    print(f"baseline (python + torch + safetensors + selzero imported): {base:,.0f} MiB peak RSS")
    for op, target in (("reshard", f"-> {result['reshard_to']} ranks"), ("consolidate", "")):
        peak = result[f"{op}_rss_kb"] / 1024
        print(f"selzero {op} {target}: {peak:,.0f} MiB peak RSS (+{peak - base:,.0f} MiB over the "
              f"baseline), {result[f'{op}_s']} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
