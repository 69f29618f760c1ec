"""What each rank holds of a LoRA fine-tune's frozen base at stage 3, with and without ``frozen=``.

A frozen parameter is the module's and, by default, every rank holds it whole. ``step.init(params,
frozen=fzero.frozen_of(model))`` shards it across the ranks (each unit's gathered with the unit), and
``fzero.free_frozen`` empties the module's copies. This counts, per rank of a ``local_mesh``, in bytes (exact counts,
not timings): the frozen params a rank holds between steps (the module's whole base, or its shard in the state), the
rest of its state, and the peak of the tensors a step allocates on it (``fzero.memory.LiveBytes``: the gathered units,
frozen parts included, activations, gradients). The model is an HF Llama under peft's LoRA (q_proj and v_proj, r=8),
bf16 base, ``precision="fp32"`` as docs/migrating.md advises, batch 2 x 64 tokens per rank:

    .venv/bin/python benchmarks/frozen_shards.py                     # 8 x 512, 1-4 ranks, about 1 min
    .venv/bin/python benchmarks/frozen_shards.py --layers 4 --width 256
    .venv/bin/python benchmarks/frozen_shards.py --freeze-blocks 4      # no LoRA: the first 4 blocks frozen whole,
                                                                        # the rest trained (fp32 model)

In a job of one process per GPU the "frozen" column is what each process holds of the base beside the step's peak.
"""

from __future__ import annotations

import argparse
import warnings


def measure(*, layers: int, width: int, ranks: int, shard: bool, freeze_blocks: int = 0) -> dict[str, float]:
    import dataclasses

    import peft
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    import fzero
    from fzero.memory import LiveBytes, state_bytes

    torch.manual_seed(0)
    base = LlamaForCausalLM(LlamaConfig(vocab_size=1024, hidden_size=width, intermediate_size=4 * width, num_hidden_layers=layers,
                                        num_attention_heads=max(1, width // 64), num_key_value_heads=max(1, width // 64)))
    if freeze_blocks:  # a partial fine-tune: the embeddings and the first blocks frozen whole, the rest trained
        model = base
        for module in (model.model.embed_tokens, *model.model.layers[:freeze_blocks]):
            module.requires_grad_(False)
    else:
        model = peft.get_peft_model(base.to(torch.bfloat16), peft.LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]))
        for p in model.parameters():  # peft keeps the adapter in the base's dtype here: train it in fp32
            if p.requires_grad:
                p.data = p.data.float()
    counters: dict[int, LiveBytes] = {}
    mesh = dataclasses.replace(fzero.local_mesh(ranks), rank_context=lambda r: counters.setdefault(r, LiveBytes()))

    def loss_fn(params, batch):
        return fzero.apply(model, params, input_ids=batch, labels=batch, use_cache=False).loss

    step = fzero.compile(loss_fn, optimizer=fzero.optim.adamw(1e-4), stages=3, mesh=mesh)
    whole = sum(p.numel() * p.element_size() for p in model.parameters() if not p.requires_grad)
    state = step.init(fzero.params_of(model), frozen=fzero.frozen_of(model) if shard else None)
    if shard:
        fzero.free_frozen(model, state)
    gen = torch.Generator().manual_seed(0)
    for _ in range(2):
        state, _ = step(state, torch.randint(0, 1024, (2 * ranks, 64), generator=gen))
    rank0 = state[0]
    held = state_bytes(rank0)
    frozen = held["frozen"] if shard else whole
    return {"frozen": frozen, "state": held["params"] + held["optimizer"], "peak": counters[0].peak, "whole": whole}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--freeze-blocks", type=int, default=0, help="no LoRA: freeze the embeddings and the first K blocks whole")
    args = p.parse_args(argv)
    warnings.filterwarnings("ignore", category=FutureWarning)
    mib = 2**20
    what = (f"Llama {args.layers} x {args.width}, fp32, embeddings and first {args.freeze_blocks} blocks frozen" if args.freeze_blocks
            else f"LoRA Llama {args.layers} x {args.width}, bf16 base, fp32 adapter")
    print(f"{what}, stage 3; MiB per rank (rank 0)")
    print(f"{'ranks':>5} {'frozen=':>8} {'frozen':>9} {'state':>8} {'step peak':>10} {'total':>9}")
    for ranks in args.ranks:
        for shard in (False, True):
            m = measure(layers=args.layers, width=args.width, ranks=ranks, shard=shard, freeze_blocks=args.freeze_blocks)
            total = m["frozen"] + m["state"] + m["peak"]
            print(f"{ranks:>5} {'yes' if shard else 'no':>8} {m['frozen'] / mib:>9.2f} {m['state'] / mib:>8.2f} "
                  f"{m['peak'] / mib:>10.2f} {total / mib:>9.2f}", flush=True)


if __name__ == "__main__":
    main()
