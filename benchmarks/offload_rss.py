"""Peak RSS per rank of a ZeRO-3 GPT whose optimizer state lives on disk, against its model-state size.

    torchrun --standalone --nproc_per_node 2 benchmarks/offload_rss.py --layers 24 --width 1024 --offload disk --dir /tmp/fzero-offload

Each rank reports VmHWM (peak resident set, from /proc/self/status) twice: over the whole process,
and over the training steps only (reset by writing 5 to /proc/self/clear_refs after ``Step.init``).
The module is moved to the meta device after its params are copied out: at stage 3 ``fzero.apply``
needs its structure, not its weights. The init peak is several full copies of the params (the module,
``params_of``'s copy), because this script passes whole params to ``Step.init``, as its first table
did; ``benchmarks/largest_gpt.py`` measures the streaming init (``materialize=``) through the main job.

One process, no torchrun (issue 27: host bytes per parameter of ``offload="cpu"``, stage 3, bf16, remat)::

    python benchmarks/offload_rss.py --one-process --layers 12 --width 960 --offload cpu --precision bf16 --remat

``--one-process`` runs ``local_mesh(1)`` with a meta-device model and the streaming init, so the numbers are
the state's and the step's alone (on a CPU machine device and host are one memory): resident bytes per
parameter after ``Step.init`` and at its peak, and the peak over the steps (VmHWM reset after init). Set
``MALLOC_MMAP_THRESHOLD_=131072`` to take glibc's heap out of the peak (its dynamic mmap threshold keeps freed
unit-sized buffers resident on the heap). ``--device cuda`` puts the params on the GPU; the numbers are then the
host's alone (ZeRO-Offload's arithmetic: 16 bytes per parameter).

``--phases`` (with ``--one-process``) also reads the host's resident memory at the points of each step where
offload's host buffers change, by wrapping the functions that run there (nothing in fzero is changed): when the
gradient is done (``finish`` starts), after each unit's gradient is copied into its host buffer
(``CPUOffload.apply``), after the optimizer's kernel (``apply_inplace``), after the params follow the masters
(``apply_update``), and when the step returns; each as B/param above the base, current and peak since the step
began, with the resident set's anonymous and shared (page-locked) parts, and a row when the optimizer took its pure
path instead of torch's fused kernel. On a GPU, a phase that grows by more than its arithmetic (4 B/param
for the gradient's host copy, 0 for the update) names where the host holds more than ZeRO-Offload's 16 B/param::

    python benchmarks/offload_rss.py --one-process --device cuda --layers 20 --width 2048 --heads 16 --seq 512 \
        --steps 2 --offload cpu --precision bf16 --remat --phases
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
import traceback
from typing import Any

import torch
import torch.distributed as dist

import fzero
from fzero.models import GPT, GPTConfig, gpt_loss, num_params


def vm_hwm() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def reset_hwm() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--offload", choices=("none", "cpu", "disk"), default="disk")
    ap.add_argument("--dir", default="/tmp/fzero-offload")
    ap.add_argument("--precision", choices=("fp32", "bf16"), default="fp32")
    ap.add_argument("--remat", action="store_true")
    ap.add_argument("--one-process", action="store_true", help="local_mesh(1), meta model, streaming init; no torchrun")
    ap.add_argument("--device", default="cpu", help="--one-process: where the params live (cpu, cuda); RSS is the host's")
    ap.add_argument("--phases", action="store_true", help="--one-process: host RSS at each phase of a step")
    ap.add_argument("--stack-above", type=float, default=None,
                    help="--phases: B/param above the base over which the sampler notes the step's Python stack")
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args()
    if args.one_process:
        return one_process(args)
    mesh = fzero.dist_mesh()
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=args.layers, d_model=args.width, n_head=args.heads, seq_len=args.seq, vocab_size=args.vocab))
    psi = num_params(model)
    params = fzero.params_of(model)
    model.to("meta")  # stage 3 needs the module's structure only

    step = stage3_step(model, args, mesh=mesh)
    state = step.init(params)
    del params
    init_peak = vm_hwm()
    reset_hwm()
    times = []
    g = torch.Generator().manual_seed(mesh.rank)
    for _ in range(args.steps):
        x = torch.randint(0, args.vocab, (1, args.seq + 1), generator=g)
        t0 = time.perf_counter()
        state, m = step(state, {"x": x[:, :-1], "y": x[:, 1:]})
        times.append(time.perf_counter() - t0)
    train_peak = vm_hwm()
    rows = [None] * mesh.size
    dist.all_gather_object(rows, {"rank": mesh.rank, "init_peak": init_peak, "train_peak": train_peak})
    if mesh.rank == 0:
        states = 16 * psi
        out = {"params": psi, "model_states_bytes": states, "offload": args.offload, "ranks": rows,
               "step_s": sorted(times)[len(times) // 2], "loss": m["loss"]}
        print(json.dumps(out, indent=1))
        for r in rows:
            print(f"rank {r['rank']}: fp32 model states {states / 2**30:.2f} GiB (16 B x {psi:,} params); peak RSS "
                  f"training {r['train_peak'] / 2**30:.2f} GiB ({states / r['train_peak']:.2f}x smaller), "
                  f"incl. init {r['init_peak'] / 2**30:.2f} GiB")
        if args.json_out:
            with open(args.json_out, "w") as f:
                json.dump(out, f, indent=1)
    dist.destroy_process_group()


def stage3_step(model, args: argparse.Namespace, **settings):
    """The measured step: stage 3 of a GPT LM loss, AdamW, with ``--offload`` (and ``--dir`` for disk)."""

    def loss_fn(p, b):
        return gpt_loss(fzero.apply(model, p, b["x"]), b["y"])

    if args.offload == "disk":
        os.makedirs(args.dir, exist_ok=True)
        settings.update(offload="disk", offload_dir=args.dir)
    elif args.offload != "none":
        settings["offload"] = args.offload
    return fzero.compile(loss_fn, optimizer=fzero.optim.adamw(1e-4), stages=3, **settings)


def vm_rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def one_process(args: argparse.Namespace) -> dict:
    """Bytes per parameter on one rank of ``local_mesh(1)``: resident after init, and peak over the steps."""
    cfg = GPTConfig(n_layer=args.layers, d_model=args.width, n_head=args.heads, seq_len=args.seq, vocab_size=args.vocab)
    with torch.device("meta"):
        model = GPT(cfg)
    psi = num_params(model)

    step = stage3_step(model, args, mesh=fzero.local_mesh(1), precision=args.precision, remat=args.remat)
    g = torch.Generator().manual_seed(0)
    base = vm_rss()  # the interpreter, torch and the meta model
    phases: list[list[dict]] = []  # --phases: per step, the rows watch_phases wrote
    reset_hwm()
    t_init = time.perf_counter()
    state = step.init(fzero.params_of(model),
                      materialize=lambda path, m: (torch.randn(m.shape, generator=g) * 0.02).to(args.device))
    init_rss, init_peak = vm_rss() - base, vm_hwm() - base
    reset_hwm()
    peaks, times, device_peaks = [], [], []
    init_s = time.perf_counter() - t_init
    print(f"init: {init_s:.1f} s, {init_rss / psi:.2f} B/param resident (peak {init_peak / psi:.2f})", file=sys.stderr, flush=True)
    rows: list[dict] = []
    if args.phases:
        watch_phases(rows, base, psi, args.stack_above)
    for _ in range(args.steps):
        x = torch.randint(0, args.vocab, (1, args.seq + 1), generator=g).to(args.device)
        if args.phases:  # each step's rows peak since that step began (the first step's one-time buffers apart)
            reset_hwm()
        cuda = torch.device(args.device).type == "cuda"
        if cuda:  # the device's peak too: the params, activations and what backward holds of the gradient
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        state, m = step(state, {"x": x[:, :-1], "y": x[:, 1:]})
        times.append(time.perf_counter() - t0)  # the metrics are host numbers: the step has finished on the device
        peaks.append(vm_hwm() - base)
        if cuda:
            device_peaks.append(torch.cuda.max_memory_allocated())
        print(f"step: {times[-1]:.1f} s, peak {peaks[-1] / psi:.2f} B/param"
              + (f", device peak {device_peaks[-1] / psi:.2f} B/param" if cuda else ""), file=sys.stderr, flush=True)
        if args.phases:
            rows.append({"phase": "step returned", "rss": (vm_rss() - base) / psi, "peak": peaks[-1] / psi,
                         "sampled": float("nan"), **rss_kinds(psi)})
            for row in rows:
                print(f"  {row['phase']:<40} rss {row['rss']:6.2f}  peak {row['peak']:6.2f}  "
                      f"sampled since the row before {row['sampled']:6.2f}  anon {row['anon']:6.2f}  "
                      f"shmem {row['shmem']:6.2f} B/param", file=sys.stderr, flush=True)
                if row.get("stack_at_sampled"):  # a reading above --stack-above: where the step was
                    print("    at its highest, the step was in: " + " <- ".join(reversed(row["stack_at_sampled"])),
                          file=sys.stderr, flush=True)
            phases.append(list(rows))
            rows.clear()
    out = {"params": psi, "device": args.device, "offload": args.offload, "precision": args.precision, "remat": args.remat,
           "largest_unit": max(u.numel for u in state[0].meta.layout.units),
           "init_bytes_per_param": init_rss / psi, "init_peak_bytes_per_param": init_peak / psi,
           "train_peak_bytes_per_param": max(peaks) / psi,
           "peak_per_step": [p / psi for p in peaks], "device_peak_per_step": [p / psi for p in device_peaks], "init_s": init_s, "step_s": times, "loss": m["loss"],
           "phases": phases}
    print(json.dumps(out, indent=1))
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(out, f, indent=1)
    return out


def rss_kinds(psi: int) -> dict[str, float]:
    """The resident set by kind, B/param (absolute, not above the base): anonymous memory (the heap, torch's host
    tensors) and shared memory (fzero's page-locked buffers are shared anonymous mappings, ``fzero.zero._pinned``)."""
    got = {}
    with open("/proc/self/status") as f:
        for line in f:
            for key, name in (("RssAnon:", "anon"), ("RssShmem:", "shmem")):
                if line.startswith(key):
                    got[name] = int(line.split()[1]) * 1024 / psi
    return got


def where(thread_id: int) -> list[str]:
    """The innermost lines of a thread's Python stack, as text. The frame is let go before this returns: a frame
    kept alive keeps its locals (the step's tensors) alive, which would change the memory measured."""
    frame = sys._current_frames().get(thread_id)
    try:
        return [] if frame is None else [f"{os.path.relpath(f.filename)}:{f.lineno} {f.name}"
                                         for f in traceback.extract_stack(frame)[-8:]]
    finally:
        del frame


def watch_phases(rows: list[dict], base: int, psi: int, stack_above: float | None = None) -> None:
    """Wrap the functions that run where offload's host memory changes, so that each appends to ``rows`` the host's
    resident memory (current, and the peak since the step began) in B/param above ``base``. Benchmark-only: the
    wrappers replace module attributes of this process, and change no number of the step."""
    from fzero import optim
    import fzero.optim._fused as fused
    import fzero.step as step_pkg
    import fzero.step._step as step_mod
    import fzero.zero._policies as policies

    # VmHWM moves only when the kernel updates it (at an unmap, say), so a peak freed otherwise (glibc's trim uses
    # madvise) can show in a later phase than its own: a sampler thread reads VmRSS every millisecond instead, and
    # each row's "sampled" is the highest it saw since the row before (torch's ops release the GIL, so it runs)
    # With ``stack_above`` (B/param) the sampler also keeps where the main thread was (its Python stack) at the
    # highest reading above that since the row before: a host peak inside a torch op shows as the line that called
    # it. Only above it: reading another thread's stack holds its frames (and their tensors) for a moment, which
    # fzero's own checks can see (remat's check that a unit's forward left no tensor alive failed on a GPU so), so
    # the bar is set where only the transient being looked for reaches.
    sampled: dict[str, Any] = {"max": 0, "stack": []}
    main_id = threading.get_ident()
    bar = None if stack_above is None else base + stack_above * psi

    def sample() -> None:
        while True:
            now = vm_rss()
            if now > sampled["max"]:
                sampled["max"] = now
                if bar is not None and now > bar:
                    sampled["stack"] = where(main_id)
            time.sleep(0.001)

    threading.Thread(target=sample, name="rss-sampler", daemon=True).start()

    def note(phase: str) -> None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        now = vm_rss()
        high, sampled["max"], stack, sampled["stack"] = max(sampled["max"], now), now, sampled["stack"], []
        rows.append({"phase": phase, "rss": (now - base) / psi, "peak": (vm_hwm() - base) / psi,
                     "sampled": (high - base) / psi, **rss_kinds(psi), "stack_at_sampled": stack})

    def wrap(owner: Any, name: str, before: str | None, after: str | None) -> None:
        fn = getattr(owner, name)

        def wrapped(*a: Any, **k: Any) -> Any:
            if before:
                note(before)
            out = fn(*a, **k)
            if after:
                note(after)
            return out

        setattr(owner, name, wrapped)

    wrap(step_mod, "finish", "gradient done (finish starts)", None)
    wrap(policies, "_host_params", None, "host copies made (_host_params)")
    wrap(optim, "apply_inplace", None, "optimizer's kernel done (apply_inplace)")
    wrap(step_pkg, "apply_update", None, "params follow the masters (apply_update)")
    kernel_groups = fused._kernel_groups

    def groups(*lists: Any) -> Any:  # None: the update took the pure path (whole-size temporaries), not torch's kernel
        out = kernel_groups(*lists)
        if out is None:
            rows.append({"phase": "optimizer: pure update path, not the fused kernel", "rss": 0.0, "peak": 0.0,
                         "sampled": 0.0, "anon": 0.0, "shmem": 0.0})
        return out

    fused._kernel_groups = groups


if __name__ == "__main__":
    main()
