"""fzero against its peers on 2 ranks over gloo: step time (interleaved) and peak RSS per rank (fresh processes).

Driver (about 6.5 minutes on a 2-core CPU):

    .venv/bin/python benchmarks/peers.py --json-out runs/peers.json

It runs two phases, each under ``torchrun --standalone --nproc_per_node 2`` (launched as
``python -m torch.distributed.run``):

1. Step time: every system built in the same two processes and run interleaved: ``--rounds`` rounds of
   ``--round-steps`` steps per system, the order rotating (and reversed every other round), so that the
   machine's slow drifts hit every system alike. ``vs DDP`` is the median over rounds of the ratio of
   the round medians. By hand:
   ``torchrun --standalone --nproc_per_node 2 benchmarks/peers.py --interleave ddp,fzero-s3 --json-out t.json``
2. Peak RSS: one fresh torchrun per system (so every peak is that system's own), ``--warmup`` + ``--steps``
   steps, with glibc's default malloc, then again with ``MALLOC_MMAP_THRESHOLD_=131072`` for every
   system alike (``--mmap-threshold 0`` skips that pass). By hand:
   ``torchrun --standalone --nproc_per_node 2 benchmarks/peers.py --system fzero-s3 --json-out s3.json``

Model: the repo's GPT, 12 layers x 512 wide, 8 heads, vocab 256, seq 128, tied embeddings (37.9M params),
fp32; batch 2 sequences per rank; ``OMP_NUM_THREADS=1`` per rank (torchrun's default, 2 ranks on 2 cores).
Every system: AdamW(lr 3e-4, betas (0.9, 0.999), eps 1e-8, weight decay 0.01), **no gradient clipping**
(DeepSpeed's default of 1.0 is switched off explicitly), same init (seed 0, rank 0's weights) and the same
batches. Systems:

* ``ddp``: ``DistributedDataParallel`` (default 25 MB buckets) + ``torch.optim.AdamW(fused=True)``.
* ``fsdp2``: ``torch.distributed.fsdp.fully_shard`` on each block, then on the root (defaults:
  reshard after forward), on a 1-D CPU device mesh + ``torch.optim.AdamW`` (foreach; see ``--fsdp-fused``).
* ``fzero-s0`` .. ``fzero-s3``: ``fzero.compile(stages=S, mesh=fzero.dist_mesh())`` with
  ``fzero.optim.adamw`` (torch's fused kernel). After ``step.init`` the user's module is moved to the
  meta device (fzero needs only its structure), as FSDP2 and DeepSpeed free the module's full weights.
* ``fzero-s3-nopf``: stage 3 with ``prefetch=False``: step time with vs without prefetch overlap.
* ``fzero-s2-head``, ``fzero-s3-head`` (with ``--untied``): stages 2-3 with the LM head a unit of its own
  (``units=units_of(model) + ("lm_head",)``), to time against ``fzero-s2``/``fzero-s3`` in one run. ``--head-unit``
  does the same for every fzero system at stages 2-3 and gives FSDP2 the head's own ``fully_shard``, as torchtitan
  does.
* ``fzero-s2-jit``, ``fzero-s3-jit``: stages 2-3 with ``jit=True`` (each unit's forward through
  ``torch.compile``, plain autograd), against ``fsdp2-compile``: FSDP2 with each block ``.compile()``d before
  ``fully_shard`` (torchtitan's regional compilation). Compilation happens in the warm-up steps.
* ``fsdp2-meta`` and ``fzero-s3-meta`` (memory runs only): the model is built on the meta device, so no
  rank ever holds it whole. FSDP2's recipe: ``fully_shard`` on meta, ``to_empty``, then each parameter's
  value (``GPT.init_value``) distributed so each rank keeps its shard. fzero's:
  ``step.init(params, materialize=model.init_value)``, one unit at a time. Same values as the others.
* ``deepspeed-z3``: DeepSpeed ZeRO-3 on its CPU accelerator (gloo), client ``torch.optim.AdamW``, with
  the ZeRO settings at DeepSpeed 0.19.8's defaults, written out explicitly in ``DS_ZERO3``.
* ``deepspeed-z3-small``: the same with 5 M-element buckets (reduce, allgather, prefetch) and
  ``stage3_max_live_parameters`` 5 M: the memory-lean setting.

Memory runs, per rank: ``peak`` = VmHWM from just before the model is built to the end (set-up
included: the reset is a write of 5 to ``/proc/self/clear_refs``), ``training-only peak`` = VmHWM over
the timed steps (reset again after warm-up; it starts from the RSS then held, including memory freed
but kept by malloc), ``base`` = RSS after imports and process-group init, before the model. "Best peer"
is the peer (DDP, FSDP2, DeepSpeed) with the lowest peak. With ``MALLOC_MMAP_THRESHOLD_=131072`` glibc
returns every freed buffer above 128 KiB to the OS at once, so RSS follows live memory more closely;
it also makes every large allocation fresh page-faulted memory, which slows the systems that allocate
big buffers every step (the memory runs' step times show it).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time

import torch

from _common import (LR, WEIGHT_DECAY, build_model, gpt_loss, machine, make_batch, markdown_table, median, now,
                     num_params, peak_rss_reset, rss_kib, write_json)

SYSTEMS = ("ddp", "fsdp2", "deepspeed-z3", "deepspeed-z3-small", "fzero-s0", "fzero-s1", "fzero-s2", "fzero-s3",
           "fzero-s3-nopf", "fsdp2-meta", "fzero-s3-meta", "fsdp2-compile", "fzero-s2-jit", "fzero-s3-jit", "fzero-s2-head", "fzero-s3-head")
PEERS = ("ddp", "fsdp2", "deepspeed-z3", "deepspeed-z3-small", "fsdp2-meta", "fsdp2-compile")
META = ("fsdp2-meta", "fzero-s3-meta")  # built on the meta device; memory runs only

# DeepSpeed 0.19.8's ZeRO-3 defaults, spelled out (deepspeed/runtime/zero/config.py), so the comparison
# does not depend on a default changing. Clipping is off (DeepSpeed's default is 1.0).
DS_ZERO3 = {
    "stage": 3,
    "contiguous_gradients": True,
    "overlap_comm": True,  # the default at stage 3
    "reduce_scatter": True,
    "reduce_bucket_size": 500_000_000,
    "allgather_bucket_size": 500_000_000,
    "stage3_prefetch_bucket_size": 50_000_000,
    "stage3_param_persistence_threshold": 100_000,
    "stage3_max_live_parameters": 1_000_000_000,
    "stage3_max_reuse_distance": 1_000_000_000,
    "sub_group_size": 1_000_000_000,
}
DS_ZERO3_SMALL = {**DS_ZERO3, "reduce_bucket_size": 5_000_000, "allgather_bucket_size": 5_000_000,
                  "stage3_prefetch_bucket_size": 5_000_000, "stage3_max_live_parameters": 5_000_000}


def default_systems() -> str:
    return ",".join(SYSTEMS)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--system", default=None, help="memory worker (under torchrun): run this one system")
    p.add_argument("--interleave", default=None, help="timing worker (under torchrun): these systems, interleaved")
    p.add_argument("--systems", default=default_systems(), help="driver: comma-separated systems to run")
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--untied", action="store_true", help="a separate LM head (the 218M reference workload of docs/benchmarks.md: "
                   "--layers 12 --width 1024 --heads 16 --vocab 32768 --batch 1 --untied)")
    p.add_argument("--head-unit", action="store_true",
                   help="with --untied: the LM head is a unit of its own, for FSDP2 (fully_shard(model.lm_head), as "
                        "torchtitan wraps its output layer) and for fzero at stages 2-3 (units=units_of(model) + ('lm_head',)); "
                        "default: it is in the root unit with the embeddings")
    p.add_argument("--bucket-elements", type=int, default=0,
                   help="fzero at stages 2-3: reduce consecutive units' gradients together up to this many elements "
                        "(compile(bucket_elements=...); examples/train_gpt.py uses 2**20); default 0: one reduction per unit")
    p.add_argument("--batch", type=int, default=2, help="sequences per rank")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=3, help="timed steps of a memory run")
    p.add_argument("--rounds", type=int, default=6, help="interleaved timing rounds (0: skip the timing run)")
    p.add_argument("--round-steps", type=int, default=2, help="steps per system per timing round")
    p.add_argument("--nproc", type=int, default=2, help="driver: ranks per torchrun")
    p.add_argument("--mmap-threshold", type=int, default=131072,
                   help="driver: also run every system once with MALLOC_MMAP_THRESHOLD_=this (0: don't)")
    p.add_argument("--fsdp-fused", action="store_true", help="FSDP2 with AdamW(fused=True) instead of foreach")
    p.add_argument("--timeout", type=float, default=180, help="driver: seconds allowed per memory run")
    p.add_argument("--timing-timeout", type=float, default=600, help="driver: seconds allowed for the timing run")
    p.add_argument("--json-out", default=None)
    args = p.parse_args(argv)
    if args.head_unit and not args.untied:
        p.error("--head-unit needs --untied: a tied head reads the embedding's weight, so it cannot be a unit of its own")
    return args


# -- the systems (worker side) ----------------------------------------------------------------------
def torch_adamw(params, **kw):
    return torch.optim.AdamW(params, lr=LR, betas=(0.9, 0.999), eps=1e-8, weight_decay=WEIGHT_DECAY, **kw)


def torch_step(module, opt):
    """The plain PyTorch training step that DDP and FSDP2 both run: zero, forward, backward, step."""
    def step(batch):
        opt.zero_grad(set_to_none=True)
        loss = gpt_loss(module(batch["x"]), batch["y"])
        loss.backward()
        opt.step()
        return float(loss.detach())

    return step


def make_system(name: str, args, model):
    """Returns (step(batch) -> loss, notes). ``model`` is freshly built on CPU, identical on every rank."""
    import torch.distributed as dist

    if name == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        ddp = DDP(model)  # broadcasts rank 0's weights
        return torch_step(ddp, torch_adamw(ddp.parameters(), fused=True)), "DDP(bucket_cap_mb=25) + AdamW(fused=True)"

    if name in ("fsdp2", "fsdp2-meta", "fsdp2-compile"):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor import distribute_tensor

        meta = name.endswith("-meta")
        for p in () if meta else model.parameters():  # same start as every other system: rank 0's weights
            dist.broadcast(p.data, src=0)
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for block in model.blocks:
            if name == "fsdp2-compile":  # regional compilation, as torchtitan: each block compiled, then sharded
                block.compile()
            fully_shard(block, mesh=mesh)
        if args.head_unit:
            fully_shard(model.lm_head, mesh=mesh)
        fully_shard(model, mesh=mesh)
        if meta:  # sharded on meta: allocate the local shards, then fill them one parameter at a time
            model.to_empty(device="cpu")
            with torch.no_grad():
                for pname, p in model.named_parameters():
                    p.copy_(distribute_tensor(model.init_value(pname, p), p.device_mesh, p.placements))
        kind = {"fused": True} if args.fsdp_fused else {"foreach": True}
        compiled = ", each block torch.compile'd" if name == "fsdp2-compile" else ""
        head = " + lm_head" if args.head_unit else ""
        return torch_step(model, torch_adamw(model.parameters(), **kind)), f"fully_shard per block{head} + root{compiled}, reshard_after_forward=True, AdamW({next(iter(kind))}=True)"

    if name.startswith("deepspeed"):
        import deepspeed

        zero = DS_ZERO3_SMALL if name.endswith("small") else DS_ZERO3
        config = {
            "train_micro_batch_size_per_gpu": args.batch,
            "gradient_accumulation_steps": 1,
            "gradient_clipping": 0.0,
            "zero_optimization": zero,
            "steps_per_print": 10**9,
            "wall_clock_breakdown": False,
        }
        opt = torch_adamw(model.parameters())  # DeepSpeed replaces its params by fp32 flat partitions
        engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=config,
                                               dist_init_required=False)

        def step(batch):
            loss = gpt_loss(engine(batch["x"]), batch["y"])
            engine.backward(loss)
            engine.step()
            return float(loss.detach())

        return step, f"DeepSpeed {deepspeed.__version__} ZeRO-3 {json.dumps(zero)}, client AdamW, clipping 0"

    if name.startswith("fzero"):
        import fzero

        stage = int(name[len("fzero-s")])
        kw = {"prefetch": False} if name.endswith("nopf") else {}
        head_unit = args.head_unit or name.endswith("-head")
        if head_unit and model.lm_head is None:
            raise SystemExit(f"peers.py: {name} needs --untied: a tied head reads the embedding's weight, so it cannot be a unit of its own")
        units = {"units": fzero.units_of(model) + ("lm_head",)} if head_unit and stage >= 2 else {}
        if args.bucket_elements and stage >= 2:
            units["bucket_elements"] = args.bucket_elements

        def loss_fn(params, batch):
            return gpt_loss(fzero.apply(model, params, batch["x"]), batch["y"])

        opt = fzero.optim.adamw(LR, weight_decay=WEIGHT_DECAY)
        if name.endswith("-jit"):  # each unit's forward through torch.compile (stages 2-3), composed by hand
            grads_kw = {k: v for k, v in units.items() if k == "bucket_elements" or stage == 2}
            fstep = fzero.shard_grads(fzero.shard_optimizer(fzero.train_step(loss_fn, opt, mesh=fzero.dist_mesh(), autodiff="autograd")), jit=True, **grads_kw)
            fstep = fzero.shard_params(fstep, **{k: v for k, v in units.items() if k == "units"}) if stage == 3 else fstep
        else:
            fstep = fzero.compile(loss_fn, optimizer=opt, stages=stage, mesh=fzero.dist_mesh(), **kw, **units)
        if name.endswith("-meta"):  # one unit at a time, from the meta-device model
            box = {"state": fstep.init(fzero.params_of(model, copy=False), materialize=model.init_value)}
        else:
            box = {"state": fstep.init(fzero.params_of(model))}  # broadcasts rank 0's params
            model.to("meta")  # fzero reads only the module's structure: drop its full weights

        def step(batch):
            box["state"], metrics = fstep(box["state"], batch)
            return metrics["loss"]

        jit = ", jit=True (autodiff='autograd')" if name.endswith("-jit") else ""
        head = ", units=units_of(model) + ('lm_head',)" if "units" in units else ""
        head += f", bucket_elements={units['bucket_elements']}" if "bucket_elements" in units else ""
        return step, f"fzero.compile(stages={stage}, mesh=dist_mesh(){', prefetch=False' if kw else ''}{head}{jit}), fzero.optim.adamw"

    raise SystemExit(f"unknown system {name!r}; choose from {', '.join(SYSTEMS)}")


def _init(args, systems):
    import torch.distributed as dist

    dist.init_process_group("gloo")
    if any(s.startswith("deepspeed") for s in systems):
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo")  # picks up the group above
    import fzero  # noqa: F401  (every system pays the same imports)

    dist.barrier()
    return dist.get_rank(), dist.get_world_size()


def _batch_fn(args, rank, world):
    def batch_at(k):
        b = make_batch(k, args.batch * world, args.seq, args.vocab)
        return {n: t[rank * args.batch:(rank + 1) * args.batch] for n, t in b.items()}

    return batch_at


def memory_worker(args) -> None:
    """One system in this fresh process: peak RSS (set-up included, and training only) and step times."""
    import torch.distributed as dist

    rank, world = _init(args, [args.system])
    batch_at = _batch_fn(args, rank, world)
    base = rss_kib("VmRSS")
    peak_rss_reset()
    with torch.device("meta") if args.system in META else contextlib.nullcontext():
        model = build_model(args.layers, args.width, args.heads, args.seq, args.vocab, tie=not args.untied)
    psi = num_params(model)
    step, notes = make_system(args.system, args, model)
    del model  # the system holds what it needs
    setup_rss = rss_kib("VmRSS")
    losses, times = [], []
    for k in range(args.warmup):
        losses.append(step(batch_at(k)))
    setup_peak = rss_kib("VmHWM")
    peak_rss_reset()
    for k in range(args.warmup, args.warmup + args.steps):
        dist.barrier()
        t0 = now()
        losses.append(step(batch_at(k)))
        times.append(now() - t0)
    train_peak = rss_kib("VmHWM")
    row = {"rank": rank, "times_s": times, "base_kib": base, "peak_kib": max(setup_peak, train_peak),
           "train_peak_kib": train_peak, "setup_rss_kib": setup_rss, "end_rss_kib": rss_kib("VmRSS"), "losses": losses}
    rows = [None] * world
    dist.all_gather_object(rows, row)
    if rank == 0:
        step_times = [max(r["times_s"][i] for r in rows) for i in range(args.steps)]  # the slowest rank's
        result = {"system": args.system, "notes": notes, "num_params": psi, "world_size": world,
                  "malloc_mmap_threshold": os.environ.get("MALLOC_MMAP_THRESHOLD_"), "step_times_s": step_times,
                  "median_step_s": median(step_times), "ranks": rows, "machine": machine()}
        write_json(args.json_out, result)
    dist.barrier()
    dist.destroy_process_group()


def timing_worker(args) -> None:
    """Every system in these same processes, interleaved: ``--rounds`` rounds of ``--round-steps`` steps each,
    the order rotating from round to round. A step's time is the slowest rank's (barrier before each step)."""
    import torch.distributed as dist

    names = [s.strip() for s in args.interleave.split(",") if s.strip()]
    if set(names) & set(META):
        raise SystemExit(f"peers.py: {sorted(set(names) & set(META))} are for memory runs; time their non-meta twins "
                         f"(the step is the same once built). Pass --rounds 0 to skip the timing run.")
    rank, world = _init(args, names)
    batch_at = _batch_fn(args, rank, world)
    systems, notes, psi = {}, {}, None
    for n in names:
        model = build_model(args.layers, args.width, args.heads, args.seq, args.vocab, tie=not args.untied)
        psi = num_params(model)
        systems[n], notes[n] = make_system(n, args, model)
        del model
    k = 0
    for n in names:
        for w in range(args.warmup):
            systems[n](batch_at(w))
    k = args.warmup
    times = {n: [] for n in names}
    rounds = {n: [] for n in names}
    losses = {n: [] for n in names}
    for r in range(args.rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        if r % 2:
            order = order[::-1]
        for n in order:
            ts = []
            for i in range(args.round_steps):
                dist.barrier()
                t0 = now()
                loss = systems[n](batch_at(k + i))
                ts.append(now() - t0)
                losses[n].append(loss)
            slowest = torch.tensor(ts, dtype=torch.float64)
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
            times[n] += slowest.tolist()
            rounds[n].append(median(slowest.tolist()))
        k += args.round_steps
        if rank == 0:
            print(f"round {r + 1}/{args.rounds}: " + "  ".join(f"{n} {rounds[n][-1]:.2f}" for n in names),
                  file=sys.stderr, flush=True)
    if rank == 0:
        result = {"systems": names, "notes": notes, "num_params": psi, "world_size": world, "times_s": times,
                  "round_medians_s": rounds, "losses_rank0": losses, "machine": machine()}
        write_json(args.json_out, result)
    dist.barrier()
    dist.destroy_process_group()


# -- the driver -------------------------------------------------------------------------------------
def _kill_group(proc) -> None:
    import signal

    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=10)
            return
        except subprocess.TimeoutExpired:
            pass


def launch(args, worker_args: list[str], mmap: int | None, label: str, timeout: float) -> dict:
    env = dict(os.environ)
    env.pop("MALLOC_MMAP_THRESHOLD_", None)
    if mmap:
        env["MALLOC_MMAP_THRESHOLD_"] = str(mmap)
    env.setdefault("DS_ACCELERATOR", "cpu")
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(args.nproc),
               os.path.abspath(__file__), "--json-out", out] + worker_args
        for name in ("layers", "width", "heads", "vocab", "seq", "batch", "warmup"):
            cmd += [f"--{name}", str(getattr(args, name))]
        if args.fsdp_fused:
            cmd.append("--fsdp-fused")
        if args.untied:
            cmd.append("--untied")
        if args.head_unit:
            cmd.append("--head-unit")
        if args.bucket_elements:
            cmd += ["--bucket-elements", str(args.bucket_elements)]
        t0 = time.time()
        # A session of its own, so that a timeout ends torchrun's workers too, not only the launcher.
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)
        try:
            output, _ = proc.communicate(timeout=timeout)
            rc = proc.returncode
        except BaseException:
            _kill_group(proc)
            output, rc = proc.communicate()[0], "timeout"
            if not isinstance(sys.exc_info()[1], subprocess.TimeoutExpired):
                raise
        if rc != 0 or not os.path.exists(out):
            lines = output.strip().splitlines()
            tail = [x for x in lines if "Error" in x or "error:" in x][-5:] + lines[-15:]
            print(f"  {label}: FAILED (rc {rc})\n    " + "\n    ".join(tail), file=sys.stderr, flush=True)
            return {"error": "\n".join(tail), "malloc_mmap_threshold": mmap}
        with open(out) as f:
            result = json.load(f)
    result["wall_s"] = time.time() - t0
    return result


def memory_run(args, system: str, mmap: int | None) -> dict:
    r = launch(args, ["--system", system, "--steps", str(args.steps)], mmap, system, args.timeout)
    if "error" in r:  # seen once with DeepSpeed: a rank aborted (SIGABRT); the same run passes when repeated
        first_error = r["error"]
        r = launch(args, ["--system", system, "--steps", str(args.steps)], mmap, system + " (retry)", args.timeout)
        r["first_attempt_error"] = first_error
    r.setdefault("system", system)
    if "error" not in r:
        print(f"  {system:20s} mmap={mmap or '-':>6}  {r['median_step_s']:.3f} s/step  peak "
              f"{max(x['peak_kib'] for x in r['ranks']) / 1024:.0f} MiB  ({r['wall_s']:.0f} s)", file=sys.stderr, flush=True)
    return r


def _ranks(xs) -> str:
    return " / ".join(f"{x:.0f}" for x in xs)


def memory_stats(results: list[dict], systems: list[str], mmap: int | None) -> dict:
    want = str(mmap) if mmap else None
    stats = {}
    for s in systems:
        r = next((r for r in results if r["system"] == s and (r.get("malloc_mmap_threshold") or None) == want), None)
        if r is None or "error" in r:
            stats[s] = {"error": (r or {}).get("error", "not run").splitlines()[-1][:160]}
            continue
        ranks = r["ranks"]
        stats[s] = {
            "peak_mib": [x["peak_kib"] / 1024 for x in ranks],
            "above_base_mib": [(x["peak_kib"] - x["base_kib"]) / 1024 for x in ranks],
            "train_peak_mib": [x["train_peak_kib"] / 1024 for x in ranks],
            "base_mib": [x["base_kib"] / 1024 for x in ranks],
            "setup_rss_mib": [x["setup_rss_kib"] / 1024 for x in ranks],
            "median_step_s": r["median_step_s"], "step_times_s": r["step_times_s"],
            # mean over ranks (what fzero reports on every rank; the peers' losses are per rank)
            "final_loss": sum(x["losses"][-1] for x in ranks) / len(ranks),
        }
    ok = [p for p in PEERS if p in stats and "peak_mib" in stats[p]]
    best = min(ok, key=lambda p: max(stats[p]["peak_mib"])) if ok else None
    best_train = min(ok, key=lambda p: max(stats[p]["train_peak_mib"])) if ok else None
    for s, st in stats.items():
        if "peak_mib" in st and best:
            st["peak_vs_best_peer"] = max(st["peak_mib"]) / max(stats[best]["peak_mib"])
            st["train_peak_vs_best_peer"] = max(st["train_peak_mib"]) / max(stats[best_train]["train_peak_mib"])
    return {"systems": stats, "best_peer": best, "best_peer_train": best_train}


def driver(args) -> None:
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    if not args.untied and args.systems == default_systems():
        systems = [s for s in systems if not s.endswith("-head")]  # the default list, on a tied model: no head of its own
    for s in systems:
        if s not in SYSTEMS:
            raise SystemExit(f"unknown system {s!r}; choose from {', '.join(SYSTEMS)}")
    t0 = time.time()
    out: dict = {"args": vars(args)}
    if args.rounds:
        print(f"step time: all systems in one torchrun, {args.rounds} interleaved rounds", file=sys.stderr, flush=True)
        out["timing"] = launch(args, ["--interleave", ",".join(systems), "--rounds", str(args.rounds),
                                      "--round-steps", str(args.round_steps)], None, "interleaved timing",
                               args.timing_timeout)
    print("peak RSS: one fresh torchrun per system", file=sys.stderr, flush=True)
    runs = [memory_run(args, s, None) for s in systems]
    if args.mmap_threshold:
        runs += [memory_run(args, s, args.mmap_threshold) for s in systems]
    out["memory_runs"] = runs
    psi = next((r["num_params"] for r in runs if "num_params" in r), None)
    info = next((r["machine"] for r in runs if "machine" in r), machine())
    out.update(num_params=psi, machine=info, total_s=time.time() - t0)
    print(f"\nGPT {args.layers}x{args.width}, {args.heads} heads, vocab {args.vocab}, seq {args.seq}, {'untied' if args.untied else 'tied'} embeddings, "
          f"{psi:,} params, fp32 | batch {args.batch} per rank x {args.nproc} ranks, gloo, OMP_NUM_THREADS=1 | "
          f"no gradient clipping | {info['cpu']}, {info['cores']} cores, torch {info['torch']} | "
          f"{out['total_s']:.0f} s in all\n")

    mem = {"default": memory_stats(runs, systems, None)}
    if args.mmap_threshold:
        mem[f"mmap{args.mmap_threshold}"] = memory_stats(runs, systems, args.mmap_threshold)
    out["memory"] = mem

    timing = out.get("timing")
    if timing and "error" not in timing:
        rm, ts = timing["round_medians_s"], timing["times_s"]
        out["timing_summary"] = {}
        rows = []
        for s in systems:
            ratios = [a / b for a, b in zip(rm[s], rm["ddp"])] if "ddp" in rm else []
            nopf = [a / b for a, b in zip(rm["fzero-s3-nopf"], rm["fzero-s3"])] if s == "fzero-s3" and "fzero-s3-nopf" in rm else []
            fresh = mem["default"]["systems"][s].get("median_step_s")
            out["timing_summary"][s] = {"median_s": median(ts[s]), "min_s": min(ts[s]),
                                        "vs_ddp": median(ratios) if ratios else None}
            rows.append([s, median(ts[s]), min(ts[s]), f"{median(ratios):.2f}x" if ratios else "",
                         f"{fresh:.3f}" if fresh else "failed"])
        print(f"Step time, interleaved in one torchrun: {args.rounds} rounds x {args.round_steps} steps per system "
              f"after {args.warmup} warm-up steps; vs DDP = median over rounds of (system / DDP) round medians; "
              f"last column: median of the {args.steps} timed steps of the fresh-process memory run.\n")
        print(markdown_table(["system", "median s/step", "min s/step", "vs DDP", "fresh process s/step"], rows) + "\n")
    elif timing:
        print("interleaved timing FAILED:\n" + timing["error"] + "\n")

    for key, m in mem.items():
        rows = []
        for s in systems:
            st = m["systems"][s]
            if "error" in st:
                rows.append([s, "failed: " + st["error"], "", "", "", "", ""])
                continue
            rows.append([s, _ranks(st["peak_mib"]), _ranks(st["above_base_mib"]), f"{st['peak_vs_best_peer']:.2f}x",
                         _ranks(st["train_peak_mib"]), f"{st['train_peak_vs_best_peer']:.2f}x", f"{st['final_loss']:.4f}"])
        what = "glibc malloc defaults" if key == "default" else f"MALLOC_MMAP_THRESHOLD_={args.mmap_threshold}"
        print(f"Peak RSS per rank, MiB, {what} (fresh torchrun per system; best peer: {m['best_peer']} for the whole "
              f"run, {m['best_peer_train']} for training only):\n")
        print(markdown_table(["system", "peak (rank 0 / 1)", "peak - base", "peak vs best peer",
                              "training-only peak", "training-only vs best peer", "mean loss, last step"], rows) + "\n")
    write_json(args.json_out, out)


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.system:
        memory_worker(args)
    elif args.interleave:
        timing_worker(args)
    else:
        driver(args)


if __name__ == "__main__":
    main()
