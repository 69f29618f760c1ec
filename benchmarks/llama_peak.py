"""Peak host memory of a bf16 Hugging Face Llama step: fzero stage 3 (and 2) against FSDP2 and plain PyTorch.

Each system runs in a fresh process (so every peak is that system's own), or, under torchrun, in a fresh
process pair. Driver, both worlds (about 2 minutes on 2 cores at the default size):

    .venv/bin/python benchmarks/llama_peak.py --systems fzero-s3,fzero-s2,fsdp2,plain --world 1,2

One system by hand (world 1 directly, world 2 under torchrun):

    .venv/bin/python benchmarks/llama_peak.py --system fzero-s3 --json-out s3.json
    .venv/bin/python -m torch.distributed.run --standalone --nproc_per_node 2 benchmarks/llama_peak.py --system fsdp2 --json-out f.json

Model: ``LlamaForCausalLM`` from ``LlamaConfig`` with its defaults except the size (``--layers``, ``--width``;
heads of 64, intermediate 8/3 x width rounded to 64, ``--vocab``, ``use_cache=False``), seed 0, batch ``--batch``
x ``--seq`` per rank, random tokens. Policy (the same for every system): bf16 compute, fp32 gradient reduction,
fp32 master weights / params for the optimizer, AdamW(lr 3e-4, wd 0.01), no clipping, loss = cross-entropy on
fp32 logits.

* ``fzero-s3`` / ``fzero-s2``: ``fzero.compile(stages=S, mesh=local_mesh(1) or dist_mesh(),
  precision=Precision(compute=bf16, reduce=fp32))``, ``fzero.optim.adamw``; after ``step.init`` the module's
  parameters are put on the meta device (fzero reads only its structure; buffers such as the rotary
  ``inv_freq`` stay).
* ``fzero-s3-donate``: as ``fzero-s3``, but ``step.init(fzero.params_of(model, copy=False), donate=True)``: the
  module's parameters are freed as their units are packed, instead of after the whole state exists.
* ``fsdp2``: ``fully_shard`` on each decoder layer and on the root, ``MixedPrecisionPolicy(param_dtype=bf16,
  reduce_dtype=fp32)``, ``torch.optim.AdamW(fused=True)`` (torch 2.13's fused CPU kernel takes FSDP2's DTensors).
* ``plain``: the module in fp32, forward under ``torch.autocast("cpu", bf16)``, ``AdamW(fused=True)``.

Measured per rank: ``base`` = RSS once fzero and FSDP2 are imported and the model is built (it holds the fp32
module), then VmHWM is reset
(write 5 to ``/proc/self/clear_refs``); ``peak`` = VmHWM over set-up and ``--steps`` steps. Reported: (peak - base)
per parameter, with glibc's defaults or (``--mmap-threshold``) ``MALLOC_MMAP_THRESHOLD_`` set for every system alike.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

import torch

SYSTEMS = ("fzero-s3", "fzero-s3-donate", "fzero-s2", "fsdp2", "plain")
LR, WEIGHT_DECAY = 3e-4, 0.01


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--system", default=None, help="worker: run this one system in this process (or process pair)")
    p.add_argument("--systems", default=",".join(SYSTEMS), help="driver: systems, comma-separated")
    p.add_argument("--world", default="1,2", help="driver: world sizes, comma-separated (2: under torchrun)")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=2, help="sequences per rank")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--mmap-threshold", type=int, default=0, help="set MALLOC_MMAP_THRESHOLD_ for every system (0: glibc default)")
    p.add_argument("--timeout", type=float, default=300, help="driver: seconds allowed per run")
    p.add_argument("--json-out", default=None)
    return p.parse_args(argv)


def build_llama(layers: int, width: int, vocab: int, seq: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    heads = max(1, width // 64)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=width, intermediate_size=max(64, width * 8 // 3 // 64 * 64),
                      num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads,
                      max_position_embeddings=seq, use_cache=False)
    return LlamaForCausalLM(cfg)


def lm_loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))


def batch_at(k: int, args, rank: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * k + rank)
    t = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=g)
    return {"x": t[:, :-1].contiguous(), "y": t[:, 1:].contiguous()}


def rss_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def params_to_meta(model: torch.nn.Module) -> None:
    """Free the module's parameters (fzero reads only its structure), keeping its buffers (rotary ``inv_freq``)."""
    for m in model.modules():
        for name, p in list(m._parameters.items()):
            if p is not None:
                m._parameters[name] = torch.nn.Parameter(p.detach().to("meta"), requires_grad=p.requires_grad)


def make_system(name: str, model, world: int):
    """Returns step(batch) -> loss for ``name`` on ``model`` (built identically on every rank)."""
    if name.startswith("fzero"):
        import fzero

        stage = int(name.split("-")[1][1:])
        donate = name.endswith("-donate")
        mesh = fzero.dist_mesh() if world > 1 else fzero.local_mesh(1)

        def loss_fn(params, batch):
            return lm_loss(fzero.apply(model, params, batch["x"]).logits, batch["y"])

        step = fzero.compile(loss_fn, optimizer=fzero.optim.adamw(LR, weight_decay=WEIGHT_DECAY), stages=stage, mesh=mesh,
                             precision=fzero.Precision(compute=torch.bfloat16, reduce=torch.float32))
        if donate:  # the module's parameters are freed unit by unit as the state is made
            box = {"state": step.init(fzero.params_of(model, copy=False), donate=True)}
        else:
            box = {"state": step.init(fzero.params_of(model))}
            params_to_meta(model)

        def run(batch):
            box["state"], metrics = step(box["state"], batch)
            return metrics["loss"]

        return run
    if name == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mesh = init_device_mesh("cpu", (world,))
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh, mp_policy=mp)
        fully_shard(model, mesh=mesh, mp_policy=mp)
        opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, fused=True)

        def run(batch):
            opt.zero_grad(set_to_none=True)
            loss = lm_loss(model(batch["x"]).logits, batch["y"])
            loss.backward()
            opt.step()
            return float(loss.detach())

        return run
    if name == "plain":
        if world > 1:
            raise SystemExit("llama_peak.py: plain runs at world 1 only")
        opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, fused=True)

        def run(batch):
            opt.zero_grad(set_to_none=True)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                logits = model(batch["x"]).logits
            loss = lm_loss(logits, batch["y"])
            loss.backward()
            opt.step()
            return float(loss.detach())

        return run
    raise SystemExit(f"llama_peak.py: unknown system {name!r}; choose from {', '.join(SYSTEMS)}")


def worker(args) -> dict:
    """One system in this process (world 1) or in each process of a torchrun pair; rank 0 writes the result."""
    import torch.distributed as dist

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 or args.system == "fsdp2":
        if world > 1:
            dist.init_process_group("gloo")
        else:  # FSDP2 needs a process group even alone: one rank, in this process
            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    rank = dist.get_rank() if dist.is_initialized() else 0
    import fzero  # noqa: F401  (every system pays the same imports, before the base is read)
    import torch.distributed.fsdp  # noqa: F401
    model = build_llama(args.layers, args.width, args.vocab, args.seq)
    psi = sum(p.numel() for p in model.parameters())
    base = rss_kib("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    run = make_system(args.system, model, world)
    del model  # the system holds what it needs
    setup = rss_kib("VmHWM")
    losses = [run(batch_at(0, args, rank))]
    first = rss_kib("VmHWM")
    with open("/proc/self/clear_refs", "w") as f:  # the later steps' own peak, from the RSS held after the first
        f.write("5")
    losses += [run(batch_at(k, args, rank)) for k in range(1, args.steps)]
    later = rss_kib("VmHWM")
    row = {"rank": rank, "base_kib": base, "setup_peak_kib": setup, "peak_kib": max(first, later), "train_peak_kib": later,
           "losses": losses}
    rows = [row]
    if world > 1:
        rows = [None] * world
        dist.all_gather_object(rows, row)
    result = {"system": args.system, "world": world, "num_params": psi, "ranks": rows,
              "above_base_bytes_per_param": max((r["peak_kib"] - r["base_kib"]) * 1024 / psi for r in rows),
              "setup_above_base_bytes_per_param": max((r["setup_peak_kib"] - r["base_kib"]) * 1024 / psi for r in rows),
              "train_above_base_bytes_per_param": max((r["train_peak_kib"] - r["base_kib"]) * 1024 / psi for r in rows),
              "malloc_mmap_threshold": os.environ.get("MALLOC_MMAP_THRESHOLD_")}
    if rank == 0 and args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(result, f, indent=1)
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    return result


def launch(args, system: str, world: int) -> dict:
    """``system`` in a fresh process (world 1) or a fresh torchrun pair; its result."""
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    env.pop("MALLOC_MMAP_THRESHOLD_", None)
    if args.mmap_threshold:
        env["MALLOC_MMAP_THRESHOLD_"] = str(args.mmap_threshold)
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "r.json")
        run = [sys.executable] if world == 1 else [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                                    "--nproc_per_node", str(world)]
        cmd = run + [os.path.abspath(__file__), "--system", system, "--json-out", out]
        for k in ("layers", "width", "vocab", "seq", "batch", "steps"):
            cmd += [f"--{k}", str(getattr(args, k))]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
        if proc.returncode != 0 or not os.path.exists(out):
            return {"system": system, "world": world, "error": (proc.stderr or proc.stdout).strip().splitlines()[-5:]}
        with open(out) as f:
            return json.load(f)


def driver(args) -> None:
    systems = [s for s in args.systems.split(",") if s]
    worlds = [int(w) for w in args.world.split(",") if w]
    results = []
    for world in worlds:
        for s in systems:
            if s == "plain" and world > 1:
                continue
            r = launch(args, s, world)
            results.append(r)
            line = "FAILED: " + " | ".join(r["error"]) if "error" in r else \
                (f"peak {r['above_base_bytes_per_param']:.2f} B/param above base (set-up {r['setup_above_base_bytes_per_param']:.2f}, "
                 f"steps 2-{args.steps} {r['train_above_base_bytes_per_param']:.2f}; {r['num_params'] / 1e6:.1f}M params)")
            print(f"world {world}  {s:9s} {line}", flush=True)
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=1)


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.system:
        worker(args)
    else:
        driver(args)


if __name__ == "__main__":
    main()
