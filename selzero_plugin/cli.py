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
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="train a small MoE on 2 local gloo processes and report")
    demo.add_argument("--nproc", type=int, default=2, help="number of local processes (default 2)")
    demo.add_argument("--steps", type=int, default=40, help="training steps (default 40)")
    demo.add_argument("--out", default=None,
                      help="folder for the demo's checkpoint (default: a temporary folder)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "demo":
        from .demo import launch

        return launch(nproc=args.nproc, steps=args.steps, out=args.out)
    raise AssertionError(f"unhandled command {args.command}")


if __name__ == "__main__":
    sys.exit(main())
