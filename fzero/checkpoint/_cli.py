"""``python -m fzero.checkpoint info|verify|consolidate ...``: print what a checkpoint holds, check it, or consolidate it."""

from __future__ import annotations

import argparse
import json
import sys

import torch

from fzero.checkpoint._consolidate import consolidate
from fzero.checkpoint._dcp import CheckpointError
from fzero.checkpoint._files import latest, open_checkpoint
from fzero.checkpoint._verify import verify_all


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fzero.checkpoint", description="Inspect, verify and consolidate fzero checkpoints.")
    sub = parser.add_subparsers(dest="command", required=True)
    c = sub.add_parser("consolidate", help="write a checkpoint's parameters and buffers as one state dict (torch.save) or as safetensors files")
    c.add_argument("path", help="a checkpoint directory, or a parent of step_* checkpoints (the newest is used)")
    c.add_argument("out", help="the .pt file to write, or with --format safetensors the directory")
    c.add_argument("--format", choices=["pt", "safetensors"], default="pt", help="pt: one torch.save file; safetensors: Hugging Face's model.safetensors (sharded past --max-shard-size)")
    c.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default="fp32", help="the dtype of the floating tensors written")
    c.add_argument("--max-shard-size", default="5GB", help="safetensors: the most data bytes per file (e.g. 5GB, 500MB)")
    c.add_argument("--no-verify", action="store_true", help="do not check the files' checksums (sizes only)")
    i = sub.add_parser("info", help="print a checkpoint's fzero.json, after verifying every file's checksum")
    i.add_argument("path")
    i.add_argument("--no-verify", action="store_true", help="do not read the data files to check their checksums")
    v = sub.add_parser("verify", help="check every file of a checkpoint against its recorded size and CRC-32: one line per file; exit 1 if any is wrong")
    v.add_argument("path", help="a checkpoint directory, or a parent of step_* checkpoints (the newest is checked)")
    args = parser.parse_args(argv)
    try:
        if args.command == "verify":
            return _verify(args.path)
        if args.command == "info":
            found, info, manifest = open_checkpoint(args.path, "fzero.checkpoint info", verify=not args.no_verify)
            manifest.check(manifest.files)  # every file: info and the loaded state never disagree
            print(json.dumps({"path": found, **info}, indent=1))
        else:
            found, info, _ = open_checkpoint(args.path, "fzero.checkpoint consolidate", verify=not args.no_verify)
            out = consolidate(found, args.out, verify=not args.no_verify, format=args.format, dtype=args.dtype, max_shard_size=args.max_shard_size)
            count = sum(int(torch.Size(p["shape"]).numel()) for p in info["params"])
            print(f"{out}: {len(info['params'])} tensors, {count:,} parameters ({args.dtype}, {args.format}) from {found} (step {info['step']})")
    except (CheckpointError, FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


def _verify(path: str) -> int:
    """Print one line per file (``ok`` or ``BAD``, the name, what was found) and a summary; 0 if all are right."""
    found = latest(path)
    if found is None:
        open_checkpoint(path, "fzero.checkpoint verify", verify=False)  # raises, saying why there is no checkpoint
    print(f"checkpoint {found}")
    checks = verify_all(found)
    for c in checks:
        print(f"{'ok ' if c.ok else 'BAD'} {c.name}: {c.detail}")
    bad = [c.name for c in checks if not c.ok]
    print(f"{len(checks) - len(bad)} files ok, {len(bad)} bad" + (f": {', '.join(bad)}" if bad else ""))
    return 1 if bad else 0
