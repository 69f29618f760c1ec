"""Train a Hugging Face causal LM (GPT-2 or Llama, built from a config: nothing is downloaded) with fzero, set up
by a DeepSpeed config file as the Hugging Face Trainer would use it, and hand back weights that ``from_pretrained``
loads.

Two ranks simulated as threads in this process, ZeRO-2 from the Hugging Face config with ``"auto"`` values, a
checkpoint every 100 steps (200 steps of the 3M-param model: a few minutes on 2 CPU cores; ``--size tiny``: seconds):

    python examples/hf_causal_lm.py --model gpt2 --size small --deepspeed tests/configs/hf_zero2_fp16_auto.json \
        --ranks 2 --save-every 100

Two processes under torchrun (gloo on CPU), Llama with ZeRO-3 and the optimizer state and params offloaded to the host:

    torchrun --standalone --nproc_per_node 2 examples/hf_causal_lm.py --model llama --size small \\
        --deepspeed tests/configs/hf_zero3_offload_auto.json

A config without "auto" (DeepSpeed's own ZeRO-3 offload example: bf16, 4 micro-batches of 4 per rank, its own
lr and a 20-step schedule, which sets the run's length) runs as it is; a flag that contradicts the file is refused,
as the HF Trainer refuses it:

    python examples/hf_causal_lm.py --model llama --size tiny --deepspeed tests/configs/ds_zero3_offload.json

What it does, in order: builds the model from ``GPT2Config``/``LlamaConfig`` at the ``--size`` given, over a
byte vocabulary (256 tokens: the corpus is raw bytes, ``fzero.data``; by default the Python standard library's
sources); reads the DeepSpeed config with ``fzero.config.from_deepspeed``, filling each ``"auto"`` from this
script's flags (``--lr``, ``--betas``, ``--batch-size``, ``--grad-accum``, ``--steps``, ``--warmup``, ``--clip``,
``--precision``, ``--weight-decay``; bucket sizes from the model's hidden size) and printing what it resolved and
what has no effect in fzero; trains with a tqdm progress bar, weight decay off for biases, norms and positional
tables (``--no-decay``, the HF scripts' name list); saves a resharding checkpoint every ``--save-every`` steps
(keeping ``--keep``); writes the loss curve as a PNG; exports the trained weights as safetensors with the model's
``config.json`` into ``--out-dir``; and loads them back into a fresh model with ``from_pretrained`` and generates
``--generate`` bytes greedily after ``--prompt``.

Batches: step k uses global batch number k (``fzero.data.batch_at``) of ``micro batch x accumulation`` sequences
per rank. Under a local mesh the step is given the whole global batch and splits it; under torchrun every process
draws the same global batch and passes its own slice, so both train on the same data. Needs the ``examples``
extra (transformers, safetensors, tqdm, matplotlib).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from tqdm import tqdm

import fzero
from fzero.data import batch_at, load_corpus, train_val_split

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_CONFIG = os.path.join(ROOT, "tests", "configs", "hf_zero2_fp16_auto.json")
VOCAB = 256  # byte-level: every file is text the model can read, and no tokenizer is downloaded

# Only the sizes change; everything else is the library's default config (dropout, activation, init, rope, ...).
SIZES = {
    "gpt2": {
        "tiny": dict(n_embd=64, n_layer=2, n_head=4),
        "small": dict(n_embd=256, n_layer=4, n_head=4),
        "medium": dict(n_embd=512, n_layer=8, n_head=8),
    },
    "llama": {
        "tiny": dict(hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2),
        "small": dict(hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2),
        "medium": dict(hidden_size=512, intermediate_size=1376, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4),
    },
}

# The flags that fill a DeepSpeed config's "auto" values: flag -> (from_deepspeed argument, default).
# Their argparse default is None, so that a flag the user typed can be told from a default (see check_flags).
AUTO_FLAGS = {
    "lr": ("learning_rate", 1e-3),
    "betas": ("betas", (0.9, 0.999)),
    "eps": ("eps", 1e-8),
    "weight_decay": ("weight_decay", 0.01),
    "batch_size": ("batch_size", 8),
    "grad_accum": ("grad_accum", 1),
    "steps": ("total_steps", 200),
    "warmup": ("warmup_steps", 20),
    "clip": ("clip_grad_norm", 1.0),
    "precision": ("precision", "fp32"),
}
# DeepSpeed's batch keys, which fzero.config resolves itself: key -> from_deepspeed argument
BATCH_KEYS = {"train_micro_batch_size_per_gpu": "batch_size", "gradient_accumulation_steps": "grad_accum"}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", choices=tuple(SIZES), default="gpt2", help="GPT2LMHeadModel or LlamaForCausalLM")
    p.add_argument("--size", choices=("tiny", "small", "medium"), default="small",
                   help="tiny ~0.1M params (tests), small ~3M, medium ~25M; see SIZES")
    p.add_argument("--deepspeed", default=DEFAULT_CONFIG, help="a DeepSpeed config JSON file; \"auto\" values come from the flags")
    p.add_argument("--mesh", choices=("dist", "local"), default=None,
                   help="dist: one rank per torchrun process; local: --ranks threads in this process "
                        "(default: dist when launched by torchrun, else local)")
    p.add_argument("--ranks", type=int, default=2, help="simulated ranks under --mesh local")
    p.add_argument("--data", default=None, help="a text file to train on (default: the Python stdlib's sources)")
    p.add_argument("--max-bytes", type=int, default=8 * 2**20, help="read at most this much of the corpus")
    p.add_argument("--seq", type=int, default=128, help="sequence length in bytes (also the model's max positions)")
    p.add_argument("--lr", type=float, default=None, help="peak learning rate (config \"auto\": optimizer lr, warmup_max_lr) [1e-3]")
    p.add_argument("--betas", type=float, nargs=2, default=None, help="Adam betas [0.9 0.999]")
    p.add_argument("--eps", type=float, default=None, help="Adam epsilon [1e-8]")
    p.add_argument("--weight-decay", type=float, default=None, help="AdamW weight decay [0.01]")
    p.add_argument("--batch-size", type=int, default=None, help="sequences per rank per micro-batch (train_micro_batch_size_per_gpu) [8]")
    p.add_argument("--grad-accum", type=int, default=None, help="micro-batches per optimizer step [1]")
    p.add_argument("--steps", type=int, default=None, help="optimizer steps; also the schedule's total_num_steps [200]")
    p.add_argument("--warmup", type=int, default=None, help="warm-up steps of the schedule [20, at most a tenth of --steps]")
    p.add_argument("--clip", type=float, default=None, help="gradient clipping (gradient_clipping; 0: none) [1.0]")
    p.add_argument("--precision", choices=("fp32", "bf16", "fp16"), default=None,
                   help="fills fp16.enabled / bf16.enabled when they are \"auto\" [fp32]")
    p.add_argument("--no-decay", default="bias,ln_,norm,wpe",
                   help="comma-separated name substrings of the params without weight decay, as the HF scripts' "
                        "no_decay list (these cover GPT-2's and Llama's biases, norms and positional table); '' decays all")
    p.add_argument("--out-dir", default="hf_causal_lm_out", help="weights (safetensors + config.json), loss curve, checkpoints")
    p.add_argument("--plot", default=None, help="the loss-curve PNG (default: OUT_DIR/loss.png; '' for none)")
    p.add_argument("--save-every", type=int, default=0, help="save a checkpoint in OUT_DIR/checkpoints every this many steps")
    p.add_argument("--keep", type=int, default=2, help="checkpoints kept (older ones are deleted)")
    p.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in OUT_DIR/checkpoints")
    p.add_argument("--generate", type=int, default=32, help="bytes generated greedily by the reloaded model (0: none)")
    p.add_argument("--prompt", default="def ", help="what the generation starts from")
    p.add_argument("--seed", type=int, default=0, help="model init and batch order")
    p.add_argument("--log-every", type=int, default=25, help="print a loss line every this many steps")
    p.add_argument("--json-out", default=None, help="write the run's numbers (losses, paths, generated text) here")
    args = p.parse_args(argv)
    args.given = {name for name in AUTO_FLAGS if getattr(args, name) is not None}
    for name, (_, default) in AUTO_FLAGS.items():
        if getattr(args, name) is None:
            setattr(args, name, default)
    if "warmup" not in args.given:  # the default warm-up fits a short run: at most a tenth of it
        args.warmup = max(1, min(args.warmup, args.steps // 10))
    for name in ("ranks", "seq", "batch_size", "grad_accum", "steps", "log_every", "keep", "max_bytes"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.warmup < 0 or args.save_every < 0 or args.generate < 0:
        p.error("--warmup, --save-every and --generate must be >= 0")
    if args.generate and len(args.prompt.encode()) + args.generate > args.seq:
        p.error(f"--prompt ({len(args.prompt.encode())} bytes) + --generate {args.generate} exceed --seq {args.seq}, "
                f"the model's max positions; generate fewer bytes or raise --seq")
    args.plot = os.path.join(args.out_dir, "loss.png") if args.plot is None else args.plot
    for flag, path in (("--json-out", args.json_out), ("--plot", args.plot)):
        folder = os.path.dirname(os.path.abspath(path)) if path else None
        # written after the last step: a missing directory would throw the run's numbers away at the end
        # (OUT_DIR itself is created before training)
        if folder is not None and folder != os.path.abspath(args.out_dir) and not os.path.isdir(folder):
            p.error(f"{flag} {path}: the directory {folder} does not exist; create it first, or pick another path")
    args.no_decay = [n for n in args.no_decay.split(",") if n]
    in_torchrun = "RANK" in os.environ
    args.mesh = args.mesh or ("dist" if in_torchrun else "local")
    if args.mesh == "local" and in_torchrun:
        p.error("--mesh local under torchrun would simulate ranks inside each process; use --mesh dist (the default there)")
    return args


# -- the model: a Hugging Face config with only the sizes changed ---------------------------------------
def build_model(kind: str, size: str, seq: int) -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    # Byte 0 (NUL) never occurs in text: it serves as bos/eos/pad, which generate() needs and the defaults
    # (50256 for GPT-2) would put outside a 256-token vocabulary.
    special = dict(vocab_size=VOCAB, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    if kind == "gpt2":
        return GPT2LMHeadModel(GPT2Config(n_positions=seq, **special, **SIZES["gpt2"][size]))
    return LlamaForCausalLM(LlamaConfig(max_position_embeddings=seq, **special, **SIZES["llama"][size]))


# -- the DeepSpeed config: "auto" filled from the flags, contradictions refused --------------------------
def auto_paths(cfg: dict, prefix: str = "") -> list[str]:
    """Dotted paths of the config's "auto" values."""
    out = []
    for key, value in cfg.items():
        if isinstance(value, dict):
            out += auto_paths(value, f"{prefix}{key}.")
        elif value == "auto":
            out.append(prefix + key)
    return out


def rule_of(path: str) -> str | None:
    """The from_deepspeed argument that fills ``path`` when it is "auto" (None: nothing, or derived)."""
    return BATCH_KEYS[path] if path in BATCH_KEYS else fzero.config.AUTO_RULES.get(path, (None,))[0]


def deepspeed_settings(args: argparse.Namespace, world: int, hidden_size: int) -> fzero.config.Settings:
    """``fzero.config.from_deepspeed`` with exactly the arguments the config's "auto" values ask for.

    from_deepspeed refuses an argument for a value the file sets itself (it would be ignored), so only those
    are passed; a flag typed on the command line that contradicts a value the file sets is refused here, as the
    HF Trainer refuses it, instead of being dropped.
    """
    cfg = read_json(args.deepspeed)
    values = {arg: getattr(args, flag) for flag, (arg, _) in AUTO_FLAGS.items()}
    values["hidden_size"] = hidden_size
    needed = {rule_of(path) for path in auto_paths(cfg)} - {None}
    check_flags(cfg, args)
    kwargs = {arg: values[arg] for arg in needed}
    if args.no_decay:  # a parameter group, not a config value: DeepSpeed takes it from model_parameters
        kwargs["no_decay"] = args.no_decay
    settings = fzero.config.from_deepspeed(args.deepspeed, world_size=world, **kwargs)
    got = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[settings.precision.compute]
    if "precision" in args.given and got != args.precision:
        raise SystemExit(f"hf_causal_lm.py: --precision {args.precision}, but {args.deepspeed} trains in {got} (it has "
                         f"no \"auto\" {args.precision} block that the flag could switch on). Edit the config or drop the flag.")
    return settings


def read_json(path: str) -> dict:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise SystemExit(f"hf_causal_lm.py: --deepspeed {path}: cannot read it as a DeepSpeed JSON config ({e}).") from None


def check_flags(cfg: dict, args: argparse.Namespace) -> None:
    """A typed flag whose config value is set (not "auto") must agree with it."""
    flag_of = {arg: flag for flag, (arg, _) in AUTO_FLAGS.items()}
    rules = {**{path: (arg, lambda v: v) for path, arg in BATCH_KEYS.items()},
             **{path: (arg, fn) for path, (arg, fn, _) in fzero.config.AUTO_RULES.items()}}
    for path, (arg, fn) in rules.items():
        flag = flag_of.get(arg)
        if flag not in args.given:
            continue
        node = cfg
        for key in path.split("."):
            node = node.get(key) if isinstance(node, dict) else None
        if node is None or node == "auto":
            continue
        mine = fn(getattr(args, flag))
        if (list(mine) if isinstance(mine, tuple) else mine) != node:
            raise SystemExit(f"hf_causal_lm.py: --{flag.replace('_', '-')} gives {path} = {json.dumps(mine)}, but "
                             f"{args.deepspeed} sets it to {json.dumps(node)}. Drop the flag, or write \"auto\" there.")


# -- the mesh --------------------------------------------------------------------------------------------
def make_mesh(args: argparse.Namespace):
    """(mesh, rank, world size). Under torchrun each process is one rank (gloo on CPU)."""
    if args.mesh == "dist":
        mesh = fzero.dist_mesh()
        return mesh, mesh.rank, mesh.size
    return fzero.local_mesh(args.ranks), 0, args.ranks


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    mesh, rank, world = make_mesh(args)
    try:
        return train(args, mesh, rank, world)
    finally:
        if args.mesh == "dist" and dist.is_initialized():
            dist.destroy_process_group()


def train(args: argparse.Namespace, mesh, rank: int, world: int) -> dict:
    is_main = rank == 0
    log = tqdm.write if is_main else (lambda *a, **k: None)  # prints above the progress bar; rank 0 only
    if args.plot and is_main:
        check_matplotlib()  # before training, not after it
    os.makedirs(args.out_dir, exist_ok=True)
    ckpt_dir = os.path.join(args.out_dir, "checkpoints")

    train_data, _ = train_val_split(load_corpus(args.data, max_bytes=args.max_bytes))
    total = ((read_json(args.deepspeed).get("scheduler") or {}).get("params") or {}).get("total_num_steps")
    if "steps" not in args.given and isinstance(total, (int, float)):
        args.steps = int(total)  # the config's schedule spans its own run length: train that long
    torch.manual_seed(args.seed)  # every rank builds the same model
    model = build_model(args.model, args.size, args.seq)
    settings = deepspeed_settings(args, world, model.config.hidden_size)
    log(str(settings))

    def loss_fn(params, batch):
        # use_cache=False: a training forward has no use for the KV cache (fzero trains correctly with it too)
        out = fzero.apply(model, params, input_ids=batch["x"], use_cache=False)
        return F.cross_entropy(out.logits.flatten(0, 1).float(), batch["y"].flatten())

    step = fzero.compile(loss_fn, config=settings, mesh=mesh)
    state = step.init(fzero.params_of(model))
    first = 0
    if args.resume:  # the newest complete checkpoint, resharded for this step's stage and world size
        state = fzero.checkpoint.load(ckpt_dir, like=step)
        first = fzero.checkpoint.read_extra(ckpt_dir)["next_batch"]

    per_rank = settings.batch_per_rank  # micro batch x accumulation: what one rank passes to one step call
    psi = sum(p.numel() for p in model.parameters())
    log(f"{args.model} {args.size}: {psi:,} params | ZeRO-{step.stage} on {world} ranks ({args.mesh} mesh) | "
        f"{per_rank} x {args.seq} bytes per rank per step | {len(train_data):,} training bytes")

    losses: list[float] = []
    start = time.perf_counter()
    bar = tqdm(total=args.steps, initial=first, disable=not is_main, mininterval=1.0, unit="step", dynamic_ncols=True)
    for k in range(first, args.steps):
        batch = batch_at(train_data, k, batch_size=per_rank * world, seq_len=args.seq, seed=args.seed)
        if args.mesh == "dist":  # every process drew the same global batch; each keeps its own slice
            batch = {name: t[rank * per_rank:(rank + 1) * per_rank] for name, t in batch.items()}
        state, metrics = step(state, batch)  # the old state is donated: only the returned one is valid
        losses.append(metrics["loss"])
        bar.update(1)
        bar.set_postfix(loss=f"{metrics['loss']:.3f}", lr=f"{metrics['lr']:.2e}", refresh=False)
        if (k + 1) % args.log_every == 0 or k == first:
            skipped = "  (skipped: inf/NaN gradients)" if metrics["skipped"] else ""
            log(f"step {k + 1:5d}  loss {metrics['loss']:.4f}  lr {metrics['lr']:.2e}  grad norm {metrics['grad_norm']:.3f}{skipped}")
        if args.save_every and (k + 1) % args.save_every == 0:  # collective under torchrun: every rank saves
            fzero.checkpoint.save(ckpt_dir, state, extra={"next_batch": k + 1}, keep=args.keep)
    bar.close()
    elapsed = time.perf_counter() - start
    if losses:
        tail = sum(losses[-10:]) / len(losses[-10:])
        log(f"{len(losses)} steps in {elapsed:.1f} s | loss {losses[0]:.3f} -> {tail:.3f} (mean of the last {min(10, len(losses))})")
    if args.plot and is_main and losses:
        plot_losses(losses, args.plot, first=first, title=f"{args.model} {args.size}, ZeRO-{step.stage} on {world} ranks "
                                                           f"({os.path.basename(args.deepspeed)})")
        log(f"loss curve: {args.plot}")

    export_weights(step, state, model, args.out_dir)  # collective under torchrun: every rank takes part
    log(f"weights: {args.out_dir} (safetensors + config.json, for from_pretrained)")
    generated = None
    if is_main and args.generate:
        generated = generate(args.out_dir, args.prompt, args.generate)
        log(f"greedy from {args.prompt!r}: {generated!r}")
    result = {"losses": losses, "first_step": first, "steps": len(losses), "stage": step.stage, "world_size": world,
              "mesh": args.mesh, "num_params": psi, "plot": args.plot or None, "out_dir": args.out_dir,
              "generated": generated, "elapsed_s": elapsed}
    if args.json_out and is_main:
        with open(args.json_out, "w") as f:
            json.dump(result, f, indent=1)
    return result


# -- weights out and back in -----------------------------------------------------------------------------
def export_weights(step, state, model: torch.nn.Module, out_dir: str) -> None:
    """The trained params and buffers as safetensors under ``model.state_dict()``'s names (tied weights once), with
    ``config.json``: a directory ``AutoModelForCausalLM.from_pretrained`` reads, as DeepSpeed's
    ``stage3_gather_16bit_weights_on_model_save`` gives. Streamed one unit at a time (fp32: the masters when the run
    keeps them), never a second copy of the model; under torchrun every rank gathers and rank 0 writes."""
    fzero.checkpoint.save_weights(step, state, out_dir, model=model, format="safetensors", dtype="fp32")
    if not dist.is_initialized() or dist.get_rank() == 0:
        model.config.save_pretrained(out_dir)


def generate(out_dir: str, prompt: str, n: int) -> str:
    """Load the exported weights into a fresh model and continue ``prompt`` by ``n`` bytes, greedily."""
    from transformers import AutoModelForCausalLM

    fresh = AutoModelForCausalLM.from_pretrained(out_dir).eval()
    ids = torch.tensor([list(prompt.encode())])
    with torch.no_grad():
        out = fresh.generate(ids, max_new_tokens=n, do_sample=False, attention_mask=torch.ones_like(ids))
    return bytes(out[0, ids.shape[1]:].tolist()).decode("utf-8", errors="replace")


# -- the loss curve --------------------------------------------------------------------------------------
def check_matplotlib() -> None:
    if importlib.util.find_spec("matplotlib") is None:
        raise SystemExit("hf_causal_lm.py: the loss curve needs matplotlib (pip install -e '.[examples]'); "
                         "or pass --plot '' to skip it.")


def plot_losses(losses: list[float], path: str, *, first: int, title: str) -> None:
    """Training loss per step and its running mean, drawn with the Agg canvas (no display needed)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    steps = list(range(first + 1, first + len(losses) + 1))
    window = max(1, len(losses) // 20)
    smooth = [sum(losses[max(0, i - window + 1):i + 1]) / len(losses[max(0, i - window + 1):i + 1]) for i in range(len(losses))]
    ax.plot(steps, losses, lw=0.8, alpha=0.4, label="loss per step")
    ax.plot(steps, smooth, lw=1.8, label=f"mean of {window}")
    ax.set(xlabel="optimizer step", ylabel="cross-entropy (nats per byte)", title=title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)


if __name__ == "__main__":
    main()
