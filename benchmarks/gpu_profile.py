"""Where a stage-3 step's time goes on one GPU: fzero against plain PyTorch (and FSDP2), profiled side by side.

    python benchmarks/gpu_profile.py --out runs/profile                 # GPT-2 124M and 350M, HF Llama 941M
    python benchmarks/gpu_profile.py --sizes 124M --systems plain,fzero-s3 --out runs/p124

For each size and system (built alone, as ``benchmarks/gpu.py`` builds them: same init, batches, optimizer):
``--warmup`` untimed steps, ``--steps`` timed steps (median step time, tokens/s, peak allocated memory), then
``--prof-steps`` steps under ``torch.profiler`` (CPU and CUDA). From the profile: the GPU's busy time per step
(the union of its kernels' and copies' intervals) against the step's wall time, so an idle GPU (launch-bound
host, synchronisations) shows as the gap; the number of kernel launches, copies and host synchronisations per
step; the top operators by self CPU and by self CUDA time; and fzero's own ranges (``fzero.unit:*``, each
collective). Writes ``summary.json`` and ``tables.txt`` under ``--out`` and, with ``--trace SIZE:SYSTEM``, a
gzipped Chrome trace of that one; ``--syncs SIZE:SYSTEM`` lists where that one's host waits for the GPU
(``syncs.txt``).

At the end a markdown table gives each row's speed against plain PyTorch's and FSDP2's of its size (also at the
top of ``tables.txt``). ``--jit``: fzero with ``jit=True``; plain PyTorch and FSDP2 under ``torch.compile`` on the
Llama rows (on the GPT rows they run eager, as ``benchmarks/gpu.py`` builds them).

``llama941M`` is a Hugging Face ``LlamaForCausalLM`` (``LlamaConfig`` defaults but its size: 16 layers x 2048,
heads of 64, intermediate 5440, vocab 32000, ``use_cache=False``): a model nobody here wrote. ``fzero-s3-m2``
is stage 3 on ``local_mesh(2)`` (two simulated ranks, one GPU) with the same global batch: its time over
``fzero-s3``'s is the first figure of what two ranks' collectives cost.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import shutil
import statistics
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import gpu  # noqa: E402  (benchmarks/gpu.py: the systems, built the same way)

LLAMA = {"llama941M": (16, 2048, 32000)}
SYSTEMS = ("plain", "fsdp2", "fzero-s3", "fzero-s3-m2")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="124M,350M,llama941M")
    p.add_argument("--systems", default="plain,fsdp2,fzero-s3")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--prof-steps", type=int, default=2)
    p.add_argument("--jit", action="store_true", help="fzero with jit=True, plain and FSDP2 under torch.compile")
    p.add_argument("--extra", action="append", default=[], help="SIZE:SYSTEM to run as well (after its size's systems)")
    p.add_argument("--cprofile", action="append", default=[],
                   help="SIZE:SYSTEM whose host side to profile with cProfile as well (cprofile.txt: top functions)")
    p.add_argument("--syncs", action="append", default=[],
                   help="SIZE:SYSTEM whose waits for the GPU to list by Python stack (syncs.txt; CUDA only)")
    p.add_argument("--triton-min-elements", type=int, default=None,
                   help="fzero's Adam: leaves from this size take the Triton kernel (default: fzero.optim._fused's)")
    p.add_argument("--mesh-timeout", type=float, default=60.0, help="local_mesh timeout of fzero-s3-m2, seconds")
    p.add_argument("--trace", action="append", default=[], help="SIZE:SYSTEM whose Chrome trace to keep (gzipped)")
    p.add_argument("--out", default="runs/profile")
    p.add_argument("--device", default="cuda", help="cuda, or cpu for a smoke run (sizes 'tiny', seq 32)")
    return p.parse_args(argv)


def gpt_args(seq: int):
    a = gpu.parse_args(["--seq", str(seq)])
    return a


def build_llama(layers: int, width: int, vocab: int, seq: int, device):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=width, intermediate_size=width * 8 // 3 // 64 * 64 + 64,
                      num_hidden_layers=layers, num_attention_heads=width // 64, num_key_value_heads=width // 64,
                      max_position_embeddings=seq, use_cache=False)
    with torch.device(device):
        return LlamaForCausalLM(cfg)


def llama_systems(name: str, spec, args, device):
    """step(batch) -> loss float for an HF Llama under ``name``; the policy of ``gpu.py``'s systems."""
    import fzero

    layers, width, vocab = spec
    model = build_llama(layers, width, vocab, args.seq, device)
    loss = lambda logits, y: gpu.lm_loss(logits, y)  # noqa: E731
    if name == "plain":
        opt = torch.optim.AdamW(model.parameters(), lr=gpu.LR, weight_decay=gpu.WEIGHT_DECAY, fused=True)
        fwd = torch.compile(model) if args.jit else model

        def step(batch):
            opt.zero_grad(set_to_none=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = fwd(input_ids=batch["x"]).logits
            out = loss(logits, batch["y"])
            out.backward()
            opt.step()
            return float(out.detach())
        return step
    if name == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        gpu.process_group(device)
        mesh = init_device_mesh("cuda", (1,))
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh, mp_policy=mp)
        fully_shard(model, mesh=mesh, mp_policy=mp)
        opt = torch.optim.AdamW(model.parameters(), lr=gpu.LR, weight_decay=gpu.WEIGHT_DECAY, fused=True)
        fwd = torch.compile(model) if args.jit else model

        def step(batch):
            opt.zero_grad(set_to_none=True)
            out = loss(fwd(input_ids=batch["x"]).logits, batch["y"])
            out.backward()
            opt.step()
            return float(out.detach())
        return step

    def loss_fn(params, batch):
        return loss(fzero.apply(model, params, input_ids=batch["x"]).logits, batch["y"])

    mesh = fzero.local_mesh(2, timeout=args.mesh_timeout) if name.endswith("-m2") else fzero.local_mesh(1)
    fstep = fzero.compile(loss_fn, optimizer=fzero.optim.adamw(gpu.LR, weight_decay=gpu.WEIGHT_DECAY), stages=3,
                          mesh=mesh, precision=fzero.Precision(compute=torch.bfloat16, reduce=torch.float32),
                          **({"jit": True} if args.jit else {}))
    box = {"state": fstep.init(fzero.params_of(model, copy=False))}
    for m in model.modules():  # fzero reads the structure; buffers (rotary inv_freq) stay
        for n, p in list(m._parameters.items()):
            if p is not None:
                m._parameters[n] = torch.nn.Parameter(p.detach().to("meta"), requires_grad=p.requires_grad)

    def step(batch):
        box["state"], metrics = fstep(box["state"], batch)
        return metrics["loss"]
    return step


def gpt_system(name: str, shape, args, device):
    a = gpt_args(args.seq)
    cfg = gpu.gpt_config(shape, a)
    if name.startswith("fzero"):
        import fzero

        model = gpu.build_gpt(cfg, device)

        def loss_fn(params, batch):
            return gpu.lm_loss(fzero.apply(model, params, batch["x"]), batch["y"])

        mesh = fzero.local_mesh(2, timeout=args.mesh_timeout) if name.endswith("-m2") else fzero.local_mesh(1)
        fstep = fzero.compile(loss_fn, optimizer=fzero.optim.adamw(gpu.LR, weight_decay=gpu.WEIGHT_DECAY), stages=3,
                              mesh=mesh, precision=gpu.precision(a), **({"jit": True} if args.jit else {}))
        box = {"state": fstep.init(fzero.params_of(model, copy=False))}
        model.to("meta")

        def step(batch):
            box["state"], metrics = fstep(box["state"], batch)
            return metrics["loss"]
        return step
    step, _ = gpu.MAKERS[name](cfg, a, device)
    return step


def device_work(events) -> list:
    """The device events that are work (kernels, copies, memsets), not ranges: a ``record_function`` range (fzero's
    ``fzero.unit:...``, torch's ``Optimizer.step#...``) also shows on the device, spanning from its first kernel to its
    last with the gaps between them, so counted as busy it made a system with ranges look busier than it is."""
    return [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA and not getattr(e, "is_user_annotation", False)
            and not e.name.startswith(("fzero.", "Optimizer.", "ProfilerStep"))]


def busy_us(events) -> float:
    """The union of the device intervals (kernels, copies, memsets), in microseconds."""
    spans = sorted((e.time_range.start, e.time_range.end) for e in events)
    total, end = 0.0, -1.0
    for s, t in spans:
        if s >= end:
            total += t - s
            end = t
        elif t > end:
            total += t - end
            end = t
    return total


def profile_one(step, batches, args, trace_path=None) -> dict:
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available() and args.device == "cuda"
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    sync()
    with profile(activities=acts) as prof:
        t0 = time.perf_counter()
        for k in range(args.prof_steps):
            step(batches[k % len(batches)])
        sync()
        wall = (time.perf_counter() - t0) / args.prof_steps
    if trace_path:
        raw = trace_path[:-3]
        prof.export_chrome_trace(raw)
        with open(raw, "rb") as f, gzip.open(trace_path, "wb") as g:
            shutil.copyfileobj(f, g)
        os.remove(raw)
    events = prof.events()
    dev = device_work(events)
    n = args.prof_steps
    names = [e.name for e in events]
    count = lambda pred: sum(1 for x in names if pred(x)) / n  # noqa: E731
    ka = prof.key_averages()
    top_cpu = sorted(ka, key=lambda e: -e.self_cpu_time_total)[:30]
    top_dev = sorted(ka, key=lambda e: -getattr(e, "self_device_time_total", 0))[:30]
    ranges = {}
    copies: dict[tuple[str, str], int] = {}  # (the op that launched it, the copy's kind and size class): count
    for e in events:
        for k in getattr(e, "kernels", None) or []:
            if "memcpy" in k.name.lower():
                key = (e.name, k.name)
                copies[key] = copies.get(key, 0) + 1
        if e.name.startswith("fzero."):
            key = e.name.split(":")[0]
            r = ranges.setdefault(key, [0, 0.0])
            r[0] += 1
            r[1] += e.cpu_time_total
    return {
        "wall_ms_profiled": wall * 1e3,
        "device_busy_ms": busy_us(dev) / n / 1e3,
        "kernels_per_step": len([e for e in dev if "memcpy" not in e.name.lower() and "memset" not in e.name.lower()]) / n,
        "memcpy_per_step": len([e for e in dev if "memcpy" in e.name.lower()]) / n,
        "launches_per_step": count(lambda x: x in ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernelEx")),
        "syncs_per_step": count(lambda x: "Synchronize" in x),
        "memcpy_calls_per_step": count(lambda x: x.startswith("cudaMemcpy")),
        "record_event_per_step": count(lambda x: x == "cudaEventRecord"),
        "top_self_cpu": [(e.key, e.count / n, e.self_cpu_time_total / n / 1e3) for e in top_cpu],
        "top_self_device": [(e.key, e.count / n, getattr(e, "self_device_time_total", 0) / n / 1e3) for e in top_dev],
        "fzero_ranges": {k: (c / n, t / n / 1e3) for k, (c, t) in sorted(ranges.items(), key=lambda kv: -kv[1][1])[:40]},
        # which op makes each device copy, and of which kind (HtoD / DtoH / DtoD, pageable or pinned)
        "memcpy_by_op": [(f"{op} -> {kind}", c / n) for (op, kind), c in sorted(copies.items(), key=lambda kv: -kv[1])[:20]],
    }


def host_profile(step, batches, args, path: str, title: str) -> None:
    """cProfile over ``--steps`` steps: where the host's time goes (appended to ``path``)."""
    import cProfile
    import io
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    for k in range(args.steps):
        step(batches[k % len(batches)])
    prof.disable()
    out = io.StringIO()
    stats = pstats.Stats(prof, stream=out)
    stats.sort_stats("tottime").print_stats(45)
    stats.sort_stats("cumtime").print_stats(70)
    with open(path, "a") as f:
        f.write(f"==== {title}: {args.steps} steps\n" + out.getvalue())


def sync_points(step, batches, args, path: str, title: str) -> None:
    """Where the host waits for the GPU: two steps under ``torch.cuda.set_sync_debug_mode("warn")``, which warns at
    each synchronising call (``.item()``, ``.cpu()``, ``.tolist()``, a blocking copy, ...); each distinct Python
    stack is counted and appended to ``path``. A wait lets the GPU run dry while the host then launches the next
    kernels, so this lists the step's bubbles by cause."""
    import collections
    import traceback
    import warnings

    found: collections.Counter = collections.Counter()

    def record(message, category, filename, lineno, file=None, line=None):
        frames = [f for f in traceback.extract_stack()[:-1] if "warnings" not in f.filename]
        ours = [f"{os.path.relpath(f.filename, os.path.dirname(HERE))}:{f.lineno} {f.name}" for f in frames
                if "site-packages" not in f.filename and "/lib/python" not in f.filename][-6:]
        found[(str(message).split(".")[0][:80], " <- ".join(reversed(ours)))] += 1

    torch.cuda.synchronize()
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            for k in range(2):
                step(batches[k % len(batches)])
        finally:
            torch.cuda.set_sync_debug_mode(0)
    with open(path, "a") as f:
        f.write(f"==== {title}: waits for the GPU in 2 steps (count, what, where: innermost first)\n")
        for (what, where), n in found.most_common():
            f.write(f"{n:5d}  {what}\n       {where}\n")


def ratio_table(results: list[dict]) -> str:
    """Markdown: each row's step time, and its speed against plain PyTorch's and FSDP2's of the same size (> 1: faster)."""
    ref = {(r["size"], r["system"]): r.get("step_ms") for r in results}
    lines = ["| size | system | ms/step | tokens/s | vs plain | vs FSDP2 | GPU busy ms | peak GiB |", "|---|---|---|---|---|---|---|---|"]
    for r in results:
        ms = r.get("step_ms")
        cells = [r["size"], r["system"] + (" (jit)" if r.get("jit") else "")]
        if ms is None:
            lines.append("| " + " | ".join(cells + ["error"] + [""] * 5) + " |")
            continue
        ratio = lambda other: f"{ref[(r['size'], other)] / ms:.2f}x" if ref.get((r["size"], other)) else ""  # noqa: E731
        busy, peak = r.get("device_busy_ms"), r.get("peak_gib")
        cells += [f"{ms:.1f}", f"{r['tokens_per_s']:.0f}", ratio("plain"), ratio("fsdp2"),
                  f"{busy:.1f}" if busy else "", f"{peak:.3f}" if peak is not None else ""]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> None:
    args = parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    if args.triton_min_elements is not None:
        from fzero.optim import _fused

        _fused.TRITON_MIN_ELEMENTS = args.triton_min_elements
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    results = []
    tables = []
    for size in [s for s in args.sizes.split(",") if s]:
        extra = [e.split(":", 1)[1] for e in args.extra if e.split(":", 1)[0] == size]
        for name in [s for s in args.systems.split(",") if s] + extra:
            row = {"size": size, "system": name, "jit": args.jit}
            gpu.free_memory(device)
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated() if cuda else 0
            try:
                if size in LLAMA:
                    vocab = LLAMA[size][2]
                    step = llama_systems(name, LLAMA[size], args, device)
                else:
                    vocab = 50304
                    step = gpt_system(name, {**gpu.GPT2, **gpu.SMOKE}[size], args, device)
                batches = gpu.make_batches(4, args.batch, args.seq, vocab, device)
                for k in range(args.warmup):
                    step(batches[k % 4])
                times = []
                for k in range(args.steps):
                    sync()
                    t0 = time.perf_counter()
                    row.setdefault("losses", []).append(step(batches[k % 4]))
                    sync()
                    times.append(time.perf_counter() - t0)
                row["step_ms"] = statistics.median(times) * 1e3
                row["tokens_per_s"] = args.batch * args.seq / statistics.median(times)
                row["peak_gib"] = (torch.cuda.max_memory_allocated() - base) / 2**30 if cuda else None
                trace = os.path.join(args.out, f"trace-{size}-{name}.json.gz") if f"{size}:{name}" in args.trace else None
                row.update(profile_one(step, batches, args, trace))
                if f"{size}:{name}" in args.syncs and cuda:
                    sync_points(step, batches, args, os.path.join(args.out, "syncs.txt"), f"{size} {name}")
                if f"{size}:{name}" in args.cprofile:
                    host_profile(step, batches, args, os.path.join(args.out, "cprofile.txt"), f"{size} {name}")
                del step
            except Exception as e:  # noqa: BLE001  a row records its failure; the others still run
                import traceback

                row["error"] = "".join(traceback.format_exception(e))[-3000:]
            results.append(row)
            print(json.dumps({k: v for k, v in row.items() if not k.startswith("top") and k not in ("fzero_ranges", "memcpy_by_op")}), flush=True)
            lines = [f"== {size} {name}{' jit' if args.jit else ''}: " + json.dumps({k: row.get(k) for k in (
                "step_ms", "tokens_per_s", "peak_gib", "wall_ms_profiled", "device_busy_ms", "kernels_per_step",
                "memcpy_per_step", "launches_per_step", "syncs_per_step", "memcpy_calls_per_step", "record_event_per_step")})]
            if "error" in row:
                lines.append(row["error"])
            for key in ("top_self_cpu", "top_self_device"):
                lines.append(f"-- {key} (name, calls/step, ms/step)")
                lines += [f"{ms:9.3f} {c:7.1f}  {k[:110]}" for k, c, ms in row.get(key, [])]
            if row.get("memcpy_by_op"):
                lines.append("-- device copies (the op that made it -> its kind, per step)")
                lines += [f"{c:7.1f}  {what[:140]}" for what, c in row["memcpy_by_op"]]
            if row.get("fzero_ranges"):
                lines.append("-- fzero ranges (name, calls/step, cpu ms/step incl. children)")
                lines += [f"{ms:9.3f} {c:7.1f}  {k}" for k, (c, ms) in row["fzero_ranges"].items()]
            tables.append("\n".join(lines))
            with open(os.path.join(args.out, "tables.txt"), "w") as f:
                f.write(ratio_table(results) + "\n\n" + "\n\n".join(tables) + "\n")
            with open(os.path.join(args.out, "summary.json"), "w") as f:
                json.dump(results, f, indent=1, default=str)
            gpu.free_memory(device)
    print(ratio_table(results), flush=True)


if __name__ == "__main__":
    main()
