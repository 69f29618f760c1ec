"""Peak live bytes while ``step.init`` streams a Hugging Face checkpoint into a stage-3 state.

A Llama (``--layers`` x ``--width``, fp32, random weights) is written with ``save_pretrained`` (one file, and
shards of ``--shard`` bytes), built again under ``fzero.empty_params()``, and ``step.init`` on
``fzero.local_mesh(2)`` reads it through ``fzero.checkpoint.pretrained``. ``fzero.memory.LiveBytes`` counts every
tensor torch allocates during the init (both ranks' shards, the optimizer state, each unit's values as read and
its packed buffer); safetensors' own read of one tensor, copied at once, is not a torch allocation and is not
seen. Run from the repository root:

    .venv/bin/python benchmarks/pretrained_init.py

Prints, per optimizer and file layout: the model's size, the largest unit (here the root unit: embedding,
head and final norm), the state's bytes after init, the peak, and the peak above the state in largest units.
"""

from __future__ import annotations

import argparse
import tempfile

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import fzero
from fzero.memory import LiveBytes

MIB = 2**20


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--shard", default="50MB")
    args = p.parse_args(argv)
    cfg = LlamaConfig(vocab_size=args.vocab, hidden_size=args.width, intermediate_size=args.width * 8 // 3 // 64 * 64 + 64,
                      num_hidden_layers=args.layers, num_attention_heads=8, max_position_embeddings=128)
    with tempfile.TemporaryDirectory() as whole, tempfile.TemporaryDirectory() as sharded:
        torch.manual_seed(0)
        model = LlamaForCausalLM(cfg)
        model.save_pretrained(whole)
        model.save_pretrained(sharded, max_shard_size=args.shard)
        del model
        with fzero.empty_params():
            meta = LlamaForCausalLM(cfg)
        model_bytes = sum(t.numel() * 4 for t in meta.parameters())
        print(f"Llama {args.layers} x {args.width}, vocab {args.vocab}: {model_bytes / 4e6:.1f}M params, "
              f"{model_bytes / MIB:.1f} MiB fp32")
        print("| optimizer | checkpoint | largest unit MiB | state after init MiB | peak live MiB | peak - state, in units | peak / model |")
        print("|---|---|---|---|---|---|---|")
        for name, optimizer in (("sgd (no state)", fzero.optim.sgd(0.1)), ("adamw", fzero.optim.adamw(1e-4))):
            for label, directory in (("model.safetensors", whole), (f"shards of {args.shard}", sharded)):
                step = fzero.compile(lambda p, b: None, stages=3, mesh=fzero.local_mesh(2), optimizer=optimizer)
                source = fzero.checkpoint.pretrained(directory, model=meta)
                with LiveBytes() as lb:
                    state = step.init(fzero.params_of(meta, copy=False), materialize=source)
                    held = lb.live
                unit = max(u.padded for u in state.states[0].meta.layout.units) * 4  # the root unit: embedding and head
                print(f"| {name} | {label} | {unit / MIB:.2f} | {held / MIB:.1f} | {lb.peak / MIB:.1f} | {(lb.peak - held) / unit:.2f} | "
                      f"{lb.peak / model_bytes:.2f} |")
                del state


if __name__ == "__main__":
    main()
