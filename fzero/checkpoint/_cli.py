"""``python -m fzero.checkpoint info|consolidate ...``: print what a checkpoint holds, or consolidate it."""

from __future__ import annotations

import argparse
import json
import sys

import torch

from fzero.checkpoint._consolidate import consolidate
from fzero.checkpoint._dcp import CheckpointError
from fzero.checkpoint._files import open_checkpoint


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fzero.checkpoint", description="Inspect and consolidate fzero checkpoints.")
    sub = parser.add_subparsers(dest="command", required=True)
    c = sub.add_parser("consolidate", help="write one fp32 state dict (torch.save) of a checkpoint's parameters")
    c.add_argument("path", help="a checkpoint directory, or a parent of step_* checkpoints (the newest is used)")
    c.add_argument("out", help="the .pt file to write")
    i = sub.add_parser("info", help="print a checkpoint's fzero.json")
    i.add_argument("path")
    args = parser.parse_args(argv)
    try:
        if args.command == "info":
            found, info = open_checkpoint(args.path, "fzero.checkpoint info")
            print(json.dumps({"path": found, **info}, indent=1))
        else:
            found, info = open_checkpoint(args.path, "fzero.checkpoint consolidate")
            out = consolidate(found, args.out)
            count = sum(int(torch.Size(p["shape"]).numel()) for p in info["params"])
            print(f"{out}: {len(info['params'])} tensors, {count:,} parameters (fp32) from {found} (step {info['step']})")
    except (CheckpointError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0
