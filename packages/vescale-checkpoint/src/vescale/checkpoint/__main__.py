"""Command line: ``python -m vescale.checkpoint export CKPT OUT [--max-shard-size 5GB]``."""

from __future__ import annotations

import argparse
import sys

import torch

from vescale.checkpoint._export import export


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m vescale.checkpoint")
    sub = parser.add_subparsers(dest="command", required=True)
    ex = sub.add_parser("export", help="write consolidated safetensors from a checkpoint")
    ex.add_argument("checkpoint", help="checkpoint directory written by vescale.checkpoint.save")
    ex.add_argument("out_dir", help="output directory")
    ex.add_argument("--format", default="safetensors", choices=["safetensors"])
    ex.add_argument("--prefix", default="model", help="key prefix to export ('' for all tensors)")
    ex.add_argument("--max-shard-size", default=None, help="e.g. 5GB; default: one file")
    ex.add_argument("--dtype", default=None, help="cast floating tensors, e.g. bfloat16")
    args = parser.parse_args(argv)
    dtype = getattr(torch, args.dtype) if args.dtype else None
    files = export(
        args.checkpoint,
        args.out_dir,
        args.format,
        prefix=args.prefix or None,
        max_shard_size=args.max_shard_size,
        dtype=dtype,
    )
    for f in files:
        print(f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
