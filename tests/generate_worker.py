"""One rank of a torchrun job for tests/test_ranks.py: Hugging Face ``generate`` inside a stage-3 step, with ranks
whose generations end at different lengths, under ``synced_gpus=True`` (as DeepSpeed ZeRO-3 runs it). Rank 0 saves the
step's loss, each rank's generated ids and the plain model's own generations and losses.

    python -m torch.distributed.run --standalone --nproc_per_node 2 tests/generate_worker.py --out /tmp/g.pt
"""

import argparse
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))

import fzero  # noqa: E402
from problems import save_and_finish  # noqa: E402

PROMPTS = torch.tensor([[4, 5, 6], [7, 8, 9]])  # one row per rank


def build():
    import transformers

    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=16, n_positions=32, n_embd=16, n_layer=2,
                                                                n_head=2, pad_token_id=0)).eval()


def end_token(model) -> int:
    """Rank 0's first greedy token: its generation ends at once, rank 1's does not."""
    with torch.no_grad():
        first = model(PROMPTS).logits[:, -1].argmax(-1)
    assert first[0] != first[1]
    return int(first[0])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    mesh = fzero.dist_mesh()
    model = build()
    eos = end_token(model)
    generated = []

    def loss_fn(params, ids):
        with torch.no_grad():
            out = fzero.apply(model.generate, params, ids, max_new_tokens=6, do_sample=False, eos_token_id=eos,
                              attention_mask=torch.ones_like(ids), synced_gpus=True)
        generated.append(out)
        return fzero.apply(model, params, input_ids=out, labels=out).loss

    step = fzero.compile(loss_fn, stages=3, mesh=mesh)
    state = step.init(fzero.params_of(model))
    state, metrics = step(state, PROMPTS[mesh.rank:mesh.rank + 1])
    plain = build()
    with torch.no_grad():
        own = plain.generate(PROMPTS[mesh.rank:mesh.rank + 1], max_new_tokens=6, do_sample=False, eos_token_id=eos,
                             attention_mask=torch.ones_like(PROMPTS[:1]))
        own_loss = plain(input_ids=own, labels=own).loss.reshape(1)
    every = [None] * mesh.size
    dist.all_gather_object(every, {"fzero": generated[0], "plain": own, "plain_loss": float(own_loss)})
    save_and_finish(mesh, {"loss": float(metrics["loss"]), "ranks": every}, args.out)


if __name__ == "__main__":
    main()
