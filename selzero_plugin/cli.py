"""The ``selzero`` command (``python -m selzero_plugin.cli`` works too).

Each subcommand's work lives in its own module; this file only parses arguments.
"""

from __future__ import annotations

import argparse
import sys

__all__ = ["main", "build_parser"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="selzero", description="ZeRO-2 for a chosen subset of a model's parameters.")
    from . import __version__

    parser.add_argument("--version", action="version", version=f"selzero {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="train a small MoE on 2 local gloo processes and report")
    demo.add_argument("--nproc", type=int, default=2, help="number of local processes (default 2)")
    demo.add_argument("--steps", type=int, default=40, help="training steps (default 40)")
    demo.add_argument("--out", default=None,
                      help="folder for the demo's checkpoint (default: a temporary folder)")
    demo.add_argument("--host", default="ddp", choices=["ddp", "accelerate", "trainer", "deepspeed"],
                      help="the entry point: plain DDP (default), Accelerate, the HF Trainer "
                           "callback, or DeepSpeed ZeRO-2 with the \"selected_zero2\" entry")
    demo.add_argument("--ep", type=int, default=None,
                      help="expert parallelism: experts sharded over E ranks with token exchange "
                           "(e.g. --ep 2 --nproc 4), beside a one-process reference")

    inspect = sub.add_parser("inspect", help="describe a checkpoint folder; --verify checks it")
    inspect.add_argument("folder", help="an instance folder (manifest.json), the selzero "
                                        "folder (index.json), the checkpoint holding it, or a "
                                        "folder holding one of these below it")
    inspect.add_argument("--verify", action="store_true",
                         help="check every shard's presence, size, sha256 and tensors "
                              "(exit code 1 on any problem)")

    reshard = sub.add_parser("reshard", help="rewrite a checkpoint for another world size / "
                                             "expert-parallel size")
    reshard.add_argument("folder", help="an instance folder (manifest.json), or the selzero "
                                        "folder (index.json) or the checkpoint holding it")
    reshard.add_argument("--world-size", type=int, required=True,
                         help="number of ranks: of the instance's new group, or of the new job")
    reshard.add_argument("--ep-size", type=int, default=None,
                         help="expert-parallel size of the new job (default: as saved); needs "
                              "the selzero folder")
    reshard.add_argument("--out", required=True, help="the folder to write (a new one)")
    reshard.add_argument("--force", action="store_true",
                         help="replace --out if it holds a selzero checkpoint already")

    plan = sub.add_parser("plan", help="predicted per-rank bytes for a selection, before a run")
    plan.add_argument("model", help="`package.module:factory` (built on the meta device) or a "
                                    "transformers config .json (\"model_type\" set)")
    plan.add_argument("--params", action="append", default=[], metavar="GLOB",
                      help="parameter-name glob to select (repeat for several; --params, "
                           "--modules or both)")
    plan.add_argument("--modules", action="append", default=[], metavar="CLASS",
                      help="module class whose parameters to select (repeat for several)")
    plan.add_argument("--world-size", type=int, required=True, help="ranks of selzero's group")
    plan.add_argument("--dtype", default=None, choices=["fp32", "bf16", "fp16"],
                      help="cast the model's parameters to this dtype (bf16/fp16: FP32 masters; "
                           "default: as the model is built, e.g. a config's torch_dtype)")
    plan.add_argument("--optimizer", default="adamw",
                      choices=["adamw", "adam", "sgd", "muon", "adafactor"],
                      help="muon: Muon on the matrices, AdamW on the rest (needs --partition "
                      "tensors, as does adafactor)")
    plan.add_argument("--partition", default="chunks", choices=["chunks", "tensors"])
    plan.add_argument("--expert-dim", type=int, default=None, choices=[0],
                      help="0: fused expert tensors as one virtual parameter per expert")
    plan.add_argument("--bucket-mb", type=float, default=25.0)

    consolidate = sub.add_parser(
        "consolidate", help="full per-parameter FP32 values and optimizer state in one file")
    consolidate.add_argument("folder", help="the checkpoint folder to read")
    consolidate.add_argument("--out", required=True, help="the .safetensors file to write")
    consolidate.add_argument("--torch-state-dict", default=None, metavar="OUT",
                             help="also write the selected parameters in the model's own names "
                                  "and shapes (fused experts stacked), for "
                                  "model.load_state_dict(sd, strict=False): OUT.safetensors, or "
                                  "a torch.save file (pickle) for any other suffix")
    consolidate.add_argument("--torch-optim-state", default=None, metavar="OUT.pt",
                             help="also write a torch.optim state dict (pickle; parameter indices "
                                  "follow selected_names)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "demo":
        from .demo import launch

        return launch(nproc=args.nproc, steps=args.steps, out=args.out, host=args.host,
                      ep=args.ep)
    if args.command == "plan":
        from .errors import SelZeroError
        from .plan import run_plan

        if not args.params and not args.modules:
            print("selzero plan: error: name what to select: --params GLOB (e.g. "
                  "'*.experts.*') and/or --modules CLASS (e.g. Qwen3MoeExperts).",
                  file=sys.stderr)
            return 2
        try:
            return run_plan(args.model, params=args.params, world_size=args.world_size,
                            dtype=args.dtype, optimizer=args.optimizer,
                            expert_dim=args.expert_dim, modules=args.modules,
                            bucket_mb=args.bucket_mb, partition=args.partition)
        except SelZeroError as e:
            print(f"selzero plan: error: {e}", file=sys.stderr)
            return 1
    if args.command in ("inspect", "reshard", "consolidate"):
        from .checkpoint import tools

        if args.command == "inspect":
            return tools.run_inspect(args.folder, verify_shards=args.verify)
        if args.command == "reshard":
            return tools.run_reshard(args.folder, world_size=args.world_size, out=args.out,
                                     ep_size=args.ep_size, force=args.force)
        return tools.run_consolidate(args.folder, out=args.out,
                                     torch_state_dict=args.torch_state_dict,
                                     torch_optim_state=args.torch_optim_state)
    raise AssertionError(f"unhandled command {args.command}")


if __name__ == "__main__":
    sys.exit(main())
