"""Train the repo's small GPT on a byte-level corpus with fzero, at ZeRO stage 0, 1, 2 or 3.

Two processes under torchrun (gloo on CPU), ZeRO-2, stopping after 90 s of training:

    torchrun --standalone --nproc_per_node 2 examples/train_gpt.py --stages 2 --max-seconds 90

The same program with 2 ranks simulated as threads in one process (no torchrun):

    python examples/train_gpt.py --mesh local --ranks 2 --stages 2 --max-seconds 60

ZeRO-3 in bf16 (fp32 master weights), two micro-batches per step, gradient clipping at 1.0:

    torchrun --standalone --nproc_per_node 2 examples/train_gpt.py --stages 3 --precision bf16 --grad-accum 2 --clip 1.0

Any text file instead of the default corpus (the Python standard library's own sources):

    python examples/train_gpt.py --data input.txt --steps 500

What it shows, printed by rank 0: the training loss falling (a progress bar and a line every
``--log-every`` steps), tokens per second, the validation loss at the end, and a per-rank table of
model-state memory (params, grads, optimizer state) measured from the training state next to what the
ZeRO paper's formula predicts for that stage. ``--json-out FILE`` writes the same numbers as JSON (a NaN or
infinity as null), and ``--plot FILE`` (default ``train_gpt_loss.png``; ``--plot ''`` for none) draws the training
loss per step and the validation losses as a PNG (matplotlib, from the ``examples`` extra).

Batches: step k uses global batch number k (``fzero.data.batch_at``), ``--batch-size`` sequences per
rank. Under a local mesh the step is given the whole global batch and splits it across ranks; under
torchrun every process draws the same global batch and passes only its own slice, so both ways train
on exactly the same data.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import resource
import time

import torch
import torch.distributed as dist
from tqdm import tqdm

import fzero
from fzero.data import Curriculum, batch_at, load_corpus, train_val_split
from fzero.memory import state_bytes, zero_model_state_bytes
from fzero.models import GPT, GPTConfig, ProgressiveLayerDrop, gpt_loss, num_params

MiB = 2**20


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--stages", type=int, choices=(0, 1, 2, 3), default=2, help="ZeRO stage")
    p.add_argument("--mesh", choices=("dist", "local"), default=None,
                   help="dist: one rank per torchrun process; local: --ranks ranks as threads in this process "
                        "(default: dist when launched by torchrun, else local)")
    p.add_argument("--ranks", type=int, default=2, help="simulated ranks under --mesh local")
    p.add_argument("--data", default=None, help="a text file to train on (default: the Python stdlib's sources)")
    # The default model is GPTConfig.small(): about 0.84M params, a step well under a second on 2 CPU cores.
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq", type=int, default=128, help="sequence length in bytes")
    p.add_argument("--batch-size", type=int, default=8, help="sequences per rank per step")
    p.add_argument("--steps", type=int, default=1000, help="optimizer steps (the cosine schedule spans them)")
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate of AdamW")
    p.add_argument("--warmup", type=int, default=50, help="linear warm-up steps")
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--precision", choices=("fp32", "bf16", "fp16"), default="fp32",
                   help="bf16/fp16 keep fp32 master weights; fp16 adds a dynamic loss scale")
    p.add_argument("--grad-accum", type=int, default=1, help="micro-batches per optimizer step")
    p.add_argument("--bucket-elements", type=int, default=2**20,
                   help="stages 2-3: reduce the blocks' gradients together until a bucket holds this many elements "
                        "(this model's blocks are small, and each collective has a fixed cost); 0: each block alone")
    p.add_argument("--clip", type=float, default=None, help="clip the global gradient norm to this")
    p.add_argument("--offload", choices=("cpu", "disk"), default=None,
                   help="optimizer state and fp32 masters on the host, or in files under --offload-dir (stages 1-3)")
    p.add_argument("--offload-dir", default=None, help="directory for --offload disk (e.g. an NVMe mount)")
    p.add_argument("--offload-params", action="store_true",
                   help="stage 3: the param shards too (on the host, or in files under --offload-dir)")
    p.add_argument("--ckpt-dir", default=None, help="save checkpoints here (keeping the last 2)")
    p.add_argument("--save-every", type=int, default=0, help="save a checkpoint every this many steps (needs --ckpt-dir)")
    p.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in --ckpt-dir")
    p.add_argument("--remat", action="store_true",
                   help="recompute each block in backward instead of storing its activations (compile(remat=True), "
                        "at every stage; stage 3 gathers each unit again for its recompute)")
    p.add_argument("--schedule", choices=("cosine", "warmup-decay", "constant"), default="cosine",
                   help="cosine: warm-up then cosine to lr/10; warmup-decay: DeepSpeed's WarmupDecayLR")
    p.add_argument("--curriculum", default=None, metavar="MIN:STEPS",
                   help="curriculum learning by sequence length: start at MIN tokens, grow linearly to --seq over "
                        "STEPS steps (DeepSpeed's fixed_linear seqlen schedule, lengths in multiples of 8)")
    p.add_argument("--layer-drop", default=None, metavar="THETA:GAMMA",
                   help="progressive layer drop (DeepSpeed's progressive_layer_drop theta and gamma, e.g. 0.5:0.001): "
                        "blocks are skipped with a probability that grows over depth and steps")
    p.add_argument("--seed", type=int, default=0, help="model init and batch order")
    p.add_argument("--log-every", type=int, default=50, help="print a loss line every this many steps")
    p.add_argument("--eval-every", type=int, default=0, help="validation loss every this many steps (0: only at the end)")
    p.add_argument("--eval-batches", type=int, default=8,
                   help="batches of validation data per evaluation; 0 skips validation")
    p.add_argument("--max-seconds", type=float, default=None, help="stop early after this much training wall time")
    p.add_argument("--json-out", default=None, help="write the final metrics (loss curve, tok/s, memory table) here")
    p.add_argument("--plot", default="train_gpt_loss.png", help="the loss-curve PNG ('' for none)")
    args = p.parse_args(argv)
    for name in ("ranks", "layers", "width", "heads", "seq", "batch_size", "steps", "log_every"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.eval_every < 0 or args.warmup < 0 or args.eval_batches < 0:
        p.error("--eval-every, --eval-batches and --warmup must be >= 0")
    if args.batch_size % args.grad_accum:  # each rank's step splits its sequences into equal micro-batches
        p.error(f"--batch-size {args.batch_size} (sequences per rank per step) does not split into --grad-accum "
                f"{args.grad_accum} equal micro-batches; pass a --batch-size that is a multiple of {args.grad_accum}")
    if args.schedule == "warmup-decay" and min(args.warmup, args.steps - 1) < 1:
        p.error(f"--schedule warmup-decay needs at least one warm-up step (DeepSpeed's WarmupDecayLR), but --warmup "
                f"{args.warmup} with --steps {args.steps} leaves none; pass --warmup >= 1 and --steps >= 2, or "
                f"--schedule cosine")
    for flag, path in (("--json-out", args.json_out), ("--plot", args.plot)):
        check_parent_dir(p, flag, path)
    if args.curriculum is not None:
        try:
            low, span = (int(x) for x in args.curriculum.split(":"))
            args.curriculum = Curriculum(min_difficulty=low, max_difficulty=args.seq, schedule_type="fixed_linear",
                                         total_curriculum_step=span, difficulty_step=8 if low >= 8 else 1)
        except ValueError as e:
            p.error(f"--curriculum {args.curriculum!r}: expected MIN:STEPS with 1 <= MIN <= --seq ({e})")
    if args.layer_drop is not None:
        try:
            theta, gamma = (float(x) for x in args.layer_drop.split(":"))
            args.layer_drop = ProgressiveLayerDrop(theta=theta, gamma=gamma, seed=args.seed)
        except ValueError as e:
            p.error(f"--layer-drop {args.layer_drop!r}: expected THETA:GAMMA with 0 < THETA <= 1 and GAMMA >= 0 ({e})")
    launched_by_torchrun = "RANK" in os.environ
    args.mesh = args.mesh or ("dist" if launched_by_torchrun else "local")
    if args.mesh == "local" and launched_by_torchrun:
        p.error("--mesh local under torchrun would simulate ranks inside each process; use --mesh dist (the default there)")
    return args


def check_parent_dir(p: argparse.ArgumentParser, flag: str, path: str | None) -> None:
    """Refuse, before training, an output file whose directory does not exist: it is written only after the
    last step, so a typo there would otherwise throw the whole run's numbers away at the end."""
    folder = os.path.dirname(os.path.abspath(path)) if path else None
    if folder is not None and not os.path.isdir(folder):
        p.error(f"{flag} {path}: the directory {folder} does not exist; create it first, or pick another path")


# -- the mesh: who am I, and how many of us ---------------------------------------------------------
def make_mesh(args: argparse.Namespace):
    """Returns (mesh, rank, world_size). Under torchrun the launcher's OMP_NUM_THREADS=1 is left as it is."""
    if args.mesh == "dist":
        mesh = fzero.dist_mesh()  # initialises the gloo process group from torchrun's environment
        return mesh, mesh.rank, mesh.size
    return fzero.local_mesh(args.ranks), 0, args.ranks


# -- evaluation: the loss without an update, from the sharded state -----------------------------------
def evaluate(step, state, val: torch.Tensor, args: argparse.Namespace, rank: int, world: int) -> float:
    # step.evaluate runs loss_fn as a step would (at stage 3 one unit gathered at a time), without a
    # gradient or an update, and averages the loss over ranks. Under torchrun it is a collective: every
    # rank takes its slice of the same global validation batch, as in training.
    losses = []
    for k in range(args.eval_batches):
        b = batch_at(val, k, batch_size=args.batch_size * world, seq_len=args.seq, seed=args.seed)
        if args.mesh == "dist":
            b = {name: t[rank * args.batch_size:(rank + 1) * args.batch_size] for name, t in b.items()}
        losses.append(step.evaluate(state, b)["loss"])
    return sum(losses) / len(losses)


# -- memory: what each rank's state holds, next to the ZeRO formula ----------------------------------
def memory_row(rank_state, stage: int, world: int) -> dict[str, int]:
    held = state_bytes(rank_state)  # distinct storages of the state's params and optimizer state
    layout = rank_state.meta.layout
    elem = next(iter(rank_state.params.values())).element_size()
    # Gradients are not part of the state: they live only inside a step. By construction the step holds
    # the whole padded flat gradient at stages 0-1 and only this rank's shard of it at stages 2-3
    # (plus, for a moment, one unit's whole gradient while it is reduce-scattered).
    grads = layout.padded_numel * elem // (world if stage >= 2 else 1)
    row = {"params": held["params"], "grads": grads, "optimizer": held["optimizer"]}
    row["total"] = sum(row.values())
    return row


def memory_table(state, mesh, stage: int, world: int) -> list[dict[str, int]]:
    if isinstance(mesh, fzero.LocalMesh):
        return [memory_row(state[r], stage, world) for r in range(world)]
    rows: list = [None] * world
    dist.all_gather_object(rows, memory_row(state, stage, world))  # every rank's own row, to every rank
    return rows


def print_memory(rows: list[dict[str, int]], formula: dict[str, float], psi: int, stage: int, world: int) -> None:
    keys = ("params", "grads", "optimizer", "total")
    print(f"\nmodel-state memory per rank, MiB (stage {stage} on {world} ranks, {psi:,} params, AdamW; "
          f"grads from the flat layout)")
    print(f"{'':14s}" + "".join(f"{k:>11s}" for k in keys) + f"{'vs formula':>12s}")
    for r, row in enumerate(rows):
        print(f"{'rank ' + str(r):14s}" + "".join(f"{row[k] / MiB:11.3f}" for k in keys)
              + f"{row['total'] / formula['total']:11.3f}x")
    print(f"{'ZeRO formula':14s}" + "".join(f"{formula[k] / MiB:11.3f}" for k in keys))


def peak_rss_table(mesh, world: int) -> list[int]:
    """Each process's peak resident memory so far, in bytes (one process holds every rank of a local mesh)."""
    own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    if isinstance(mesh, fzero.LocalMesh):
        return [own]
    rows: list = [None] * world
    dist.all_gather_object(rows, own)
    return rows


# -- the run ------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if (args.save_every or args.resume) and not args.ckpt_dir:
        raise SystemExit("train_gpt.py: --save-every and --resume need --ckpt-dir.")
    mesh, rank, world = make_mesh(args)
    try:
        return train(args, mesh, rank, world)
    finally:
        if args.mesh == "dist" and dist.is_initialized():
            dist.destroy_process_group()


def train(args: argparse.Namespace, mesh, rank: int, world: int) -> dict:
    is_main = rank == 0
    if args.plot and is_main:
        check_matplotlib()  # before training, not after it
    # tqdm.write prints above the progress bar without breaking it; only rank 0 prints at all.
    log = tqdm.write if is_main else (lambda *a, **k: None)

    data = load_corpus(args.data)
    train_data, val_data = train_val_split(data)
    torch.manual_seed(args.seed)
    cfg = GPTConfig(n_layer=args.layers, d_model=args.width, n_head=args.heads, seq_len=args.seq)
    # The model is built on the meta device (shapes only) and step.init makes its params one unit at a
    # time with model.init_value, keeping each rank's share: the whole model never exists in memory.
    # (Under torchrun rank 0 makes them and broadcasts; the other ranks only receive.)
    with torch.device("meta"):
        model = GPT(cfg)
    psi = num_params(model)

    drop_at = {"step": 0}  # with --layer-drop: the step the blocks are drawn for (set by the loop)

    def loss_fn(params, batch):
        if args.layer_drop is not None and torch.is_grad_enabled():  # evaluation runs every block
            logits = fzero.apply(model, params, batch["x"], args.layer_drop.layers(drop_at["step"], args.layers))
        else:
            logits = fzero.apply(model, params, batch["x"])
        return gpt_loss(logits, batch["y"])

    warmup = min(args.warmup, args.steps - 1)
    schedule = {
        "cosine": lambda: fzero.optim.warmup_cosine_decay_schedule(
            init_value=0.0, peak_value=args.lr, warmup_steps=warmup, decay_steps=args.steps, end_value=args.lr / 10),
        "warmup-decay": lambda: fzero.optim.warmup_decay_lr(
            total_num_steps=args.steps, warmup_max_lr=args.lr, warmup_num_steps=warmup, warmup_type="linear"),
        "constant": lambda: args.lr,
    }[args.schedule]()
    optimizer = fzero.optim.adamw(schedule, weight_decay=args.weight_decay)
    step = fzero.compile(loss_fn, optimizer=optimizer, stages=args.stages, mesh=mesh, precision=args.precision,
                         grad_accum=args.grad_accum, clip_grad_norm=args.clip, offload=args.offload,
                         offload_params=args.offload_params, offload_dir=args.offload_dir,
                         remat=args.remat,
                         **({"bucket_elements": args.bucket_elements} if args.stages >= 2 else {}))
    state = step.init(fzero.params_of(model, copy=False), materialize=model.init_value)
    first = 0
    if args.resume:  # the newest complete checkpoint, resharded for this step's stage and world size
        state = fzero.checkpoint.load(args.ckpt_dir, like=step)
        first = fzero.checkpoint.read_extra(args.ckpt_dir)["next_batch"]
        if first >= args.steps:  # nothing left to train: say so, rather than fail on an empty loss list at the end
            raise SystemExit(f"train_gpt.py: --resume: the newest checkpoint in {args.ckpt_dir} was saved after step "
                             f"{first}, and --steps {args.steps} ends there; nothing is left to train. Pass --steps "
                             f"above {first} to train on (the lr schedule spans --steps, so a larger --steps also "
                             f"stretches it from here on), or drop --resume to start over.")

    tokens_per_step = args.batch_size * world * args.seq
    log(f"fzero stage {args.stages} on {world} ranks ({args.mesh} mesh) | GPT {args.layers}x{args.width}, "
        f"{args.heads} heads, seq {args.seq}, {psi:,} params | {len(train_data):,} training bytes "
        f"({args.data or 'Python stdlib sources'}) | {tokens_per_step:,} tokens per step")
    # Before training: what fzero.estimate_memory predicts per rank; the measured table is printed at the end.
    estimate = fzero.estimate_memory(model, stages=args.stages, world_size=world, precision=args.precision,
                                     optimizer=optimizer, offload=args.offload,
                                     offload_params=args.offload_params)
    log(f"{estimate}\n(activations not included; measured model states at the end)")

    losses: list[float] = []
    lengths: list[int] = []  # with --curriculum: each step's sequence length
    blocks_run = 0  # with --layer-drop: blocks run over the steps (of steps x layers)
    evals: list[dict] = []
    timed_s, timed_tokens = 0.0, 0  # step time after the first (warm-up) step, evaluation excluded
    window_s, window_tokens = 0.0, 0  # since the last log line, for the progress bar's tok/s
    start = time.perf_counter()
    bar = tqdm(total=args.steps, initial=first, disable=not is_main, mininterval=1.0, unit="step", dynamic_ncols=True)
    for k in range(first, args.steps):
        batch = batch_at(train_data, k, batch_size=args.batch_size * world, seq_len=args.seq, seed=args.seed)
        if args.mesh == "dist":  # every process drew the same global batch; each keeps its own slice
            batch = {name: t[rank * args.batch_size:(rank + 1) * args.batch_size] for name, t in batch.items()}
        step_tokens = tokens_per_step
        if args.curriculum is not None:  # the sequences cut to this step's length: k steps taken so far
            batch = args.curriculum.apply(batch, k)
            lengths.append(batch["x"].shape[1])
            step_tokens = tokens_per_step * lengths[-1] // args.seq

        drop_at["step"] = k
        if args.layer_drop is not None:
            blocks_run += sum(keep for keep, _ in args.layer_drop.layers(k, args.layers))
        t0 = time.perf_counter()
        state, metrics = step(state, batch)  # the old state is donated: only the returned one is valid
        dt = time.perf_counter() - t0
        losses.append(metrics["loss"])
        if k > 0:
            timed_s, timed_tokens = timed_s + dt, timed_tokens + step_tokens
        window_s, window_tokens = window_s + dt, window_tokens + step_tokens

        bar.update(1)
        bar.set_postfix(loss=f"{metrics['loss']:.3f}", tok_s=f"{window_tokens / window_s:,.0f}", refresh=False)
        if (k + 1) % args.log_every == 0 or k == 0:
            extra = f"  loss scale {metrics['loss_scale']:g}" if args.precision == "fp16" else ""
            extra += "  (skipped: inf/NaN gradients)" if metrics["skipped"] else ""
            log(f"step {k + 1:5d}  loss {metrics['loss']:.4f}  lr {metrics['lr']:.2e}  "
                f"grad norm {metrics['grad_norm']:.3f}  {window_tokens / window_s:,.0f} tok/s{extra}")
            window_s, window_tokens = 0.0, 0
        if args.eval_every and (k + 1) % args.eval_every == 0 and k + 1 < args.steps:
            evals.append({"step": k + 1, "val_loss": evaluate(step, state, val_data, args, rank, world)})
            log(f"step {k + 1:5d}  val loss {evals[-1]['val_loss']:.4f}")
        if args.save_every and (k + 1) % args.save_every == 0:  # collective under torchrun: every rank saves
            fzero.checkpoint.save(args.ckpt_dir, state, extra={"next_batch": k + 1}, keep=2)
            log(f"step {k + 1:5d}  checkpoint saved in {args.ckpt_dir}")
        if args.max_seconds is not None and out_of_time(start, args.max_seconds, args.mesh):
            break
    bar.close()
    elapsed = time.perf_counter() - start
    steps_done = len(losses)

    peak_rss = peak_rss_table(mesh, world)  # init and training
    val_loss = evaluate(step, state, val_data, args, rank, world) if args.eval_batches else float("nan")
    evals.append({"step": first + steps_done, "val_loss": val_loss})  # absolute step numbers, as above
    tok_s = timed_tokens / timed_s if timed_s else tokens_per_step * steps_done / elapsed
    head, tail = losses[0], sum(losses[-10:]) / len(losses[-10:])
    log(f"\n{steps_done} steps in {elapsed:.1f} s | train loss {head:.3f} -> {tail:.3f} (mean of last "
        f"{min(10, steps_done)}) | val loss {val_loss:.4f} | {tok_s:,.0f} tokens/s ({tok_s / world:,.0f} per rank)")

    rows = memory_table(state, mesh, args.stages, world)
    rank_state = state[0] if isinstance(mesh, fzero.LocalMesh) else state
    low = args.precision != "fp32"  # the paper's mixed precision: 2-byte params and grads, K = 12 (master, m, v)
    formula = zero_model_state_bytes(rank_state.meta.layout.numel, stage=args.stages, world_size=world,
                                     param_bytes=2 if low else 4, grad_bytes=2 if low else 4, optimizer_bytes=12 if low else 8)
    if args.offload == "disk":  # the optimizer state and masters are in files, not in RAM (and the params, if asked)
        params_held = 0.0 if args.offload_params else formula["params"]
        formula = {**formula, "params": params_held, "optimizer": 0.0, "total": params_held + formula["grads"]}
    if is_main:
        print_memory(rows, formula, psi, args.stages, world)
        print("peak RSS per process, MiB (init and training): " + ", ".join(f"{b / MiB:,.0f}" for b in peak_rss))

    result = {
        "stages": args.stages, "mesh": args.mesh, "world_size": world, "num_params": psi,
        "config": {k: getattr(args, k) for k in ("layers", "width", "heads", "seq", "batch_size", "lr", "seed",
                                                 "precision", "grad_accum", "clip", "schedule", "offload",
                                                 "offload_params")},
        "steps": steps_done, "elapsed_s": elapsed, "tokens_per_step": tokens_per_step, "tokens_per_s": tok_s,
        "losses": losses, "evals": evals, "val_loss": val_loss, "plot": args.plot or None, "seq_lengths": lengths,
        "blocks_run": blocks_run if args.layer_drop is not None else None,
        "memory": {"ranks": rows, "formula": formula, "estimate": estimate.as_dict(), "peak_rss": peak_rss},
    }
    if args.plot and is_main:
        plot_losses(losses, evals, args.plot, first=first,
                    title=f"GPT {args.layers}x{args.width}, ZeRO-{args.stages} on {world} ranks ({args.mesh} mesh)")
        print(f"loss curve: {args.plot}")
    if args.json_out and is_main:
        with open(args.json_out, "w") as f:
            json.dump(strict_json(result), f, indent=1)
    return result


def strict_json(value):
    """``value`` with each NaN or infinity as None (JSON's null): Python writes them as NaN/Infinity, which JSON
    does not have, so jq, JavaScript and most JSON readers refuse the whole file (val_loss is NaN under
    --eval-batches 0, a loss may be inf in a diverged fp16 run)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: strict_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [strict_json(v) for v in value]
    return value


def check_matplotlib() -> None:
    if importlib.util.find_spec("matplotlib") is None:
        raise SystemExit("train_gpt.py: the loss curve needs matplotlib (pip install -e '.[examples]'); "
                         "or pass --plot '' to skip it.")


def plot_losses(losses: list[float], evals: list[dict], path: str, *, first: int, title: str) -> None:
    """Training loss per step, its running mean and the validation losses, drawn with the Agg canvas (no display)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    steps = list(range(first + 1, first + len(losses) + 1))
    window = max(1, len(losses) // 20)
    smooth = [sum(losses[max(0, i - window + 1):i + 1]) / len(losses[max(0, i - window + 1):i + 1]) for i in range(len(losses))]
    ax.plot(steps, losses, lw=0.8, alpha=0.4, label="train loss per step")
    ax.plot(steps, smooth, lw=1.8, label=f"train, mean of {window}")
    shown = [e for e in evals if e["val_loss"] == e["val_loss"]]  # NaN when --eval-batches 0
    if shown:
        ax.plot([e["step"] for e in shown], [e["val_loss"] for e in shown], "o", label="validation")
    ax.set(xlabel="optimizer step", ylabel="cross-entropy (nats per byte)", title=title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)


def out_of_time(start: float, max_seconds: float, mesh_kind: str) -> bool:
    over = time.perf_counter() - start > max_seconds
    if mesh_kind != "dist":
        return over
    # Ranks must stop at the same step or the ones still stepping wait forever in a collective:
    # agree by a max over ranks (one tiny all-reduce per step, only when --max-seconds is set).
    flag = torch.tensor([float(over)])
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


if __name__ == "__main__":
    main()
